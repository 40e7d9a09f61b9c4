"""``model.load_state_dict`` on a sharded model: full state dicts load, shards round-trip.

PyTorch users call ``model.load_state_dict(torch.load(path))`` with the plain model's state
dict. Proves, at world sizes 1, 2 and 4: a full state dict (of the unwrapped model) loads into
every rank's pieces and training then goes on in parity with the plain model; some of its keys
(``strict=False``) load alike, the rest kept, reported as the plain model reports them; this
rank's own
``state_dict()`` (shards) loads back into a model wrapped the same way; another rank's
``state_dict()`` is refused even where every piece has the same shape (it records whose shards
it holds); a state dict of other shapes is refused naming ``load_full_state_dict`` and
``load_checkpoint``; an unwrapped model's optimizer ``state_dict`` loaded into a sharded model's
optimizer is cut to this rank's pieces, and one of other shapes (another world size's pieces) is
refused before it changes anything. (Saving a rank's ``state_dict()`` with ``torch.save`` is
refused: ``tests/api/test_from_ddp.py``.)

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_state_dict.py -q``
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def _run(world_size: int, fn):  # noqa: ANN001, ANN202
    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=30.0)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_state_dict_loads_and_training_goes_on_in_parity(world_size: int) -> None:
    torch.manual_seed(0)
    start = GPT(tied=True)
    torch.manual_seed(1)
    trained = GPT(tied=True)  # other weights: the ones to load
    full = copy.deepcopy(trained.state_dict())
    x, y = make_batch(0, 4)
    ref = copy.deepcopy(trained)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x, y).backward()
    opt.step()

    def fn(rank: int, pg: ProcessGroup | None) -> dict[str, torch.Tensor]:
        m = ShardedModule(copy.deepcopy(start), auto_wrap=Block, process_group=pg)
        result = m.load_state_dict(full)
        assert result.missing_keys == [] and result.unexpected_keys == []
        o = torch.optim.SGD(m.parameters(), lr=0.1)
        n = 4 // world_size
        m(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).backward()
        o.step()
        return m.full_state_dict()

    for state in _run(world_size, fn):
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_a_partial_full_state_dict_loads_with_strict_false(world_size: int) -> None:
    """A pretrained backbone loaded under a new head (``strict=False``, the fine-tuning line),
    and a whole state dict loaded one key at a time: the keys given load into every rank's
    pieces, the rest keep their values, and the missing and unexpected keys are those the
    plain model reports (before: refused, "strict=False of a full state dict is not
    supported"). A shape that differs is refused, loading nothing."""
    torch.manual_seed(0)
    start = GPT(tied=False)
    torch.manual_seed(1)
    pretrained = GPT(tied=False).state_dict()
    backbone = {k: v for k, v in pretrained.items() if not k.startswith("lm_head.")}
    backbone["extra.weight"] = torch.zeros(2)
    plain = copy.deepcopy(start)
    want_keys = plain.load_state_dict(backbone, strict=False)
    assert want_keys.missing_keys == ["lm_head.weight"]

    def fn(rank: int, pg: ProcessGroup | None) -> tuple:
        m = ShardedModule(copy.deepcopy(start), auto_wrap=Block, process_group=pg)
        keys = m.load_state_dict(backbone, strict=False)
        after_backbone = m.full_state_dict()
        for k, v in pretrained.items():  # one key at a time
            m.load_state_dict({k: v}, strict=False)
        after_each = m.full_state_dict()
        with pytest.raises(ValueError, match=r"size mismatch for lm_head.weight: .*\[3, 3\]"):
            m.load_state_dict({"lm_head.weight": torch.zeros(3, 3)}, strict=False)
        return keys, after_backbone, after_each, m.full_state_dict()

    for keys, after_backbone, after_each, after_refusal in _run(world_size, fn):
        assert keys == want_keys
        torch.testing.assert_close(after_backbone, plain.state_dict(), atol=0, rtol=0)
        torch.testing.assert_close(after_each, pretrained, atol=0, rtol=0)
        torch.testing.assert_close(after_refusal, pretrained, atol=0, rtol=0)


@pytest.mark.parametrize("world_size", [1, 2])
def test_own_shards_round_trip(world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    torch.manual_seed(1)
    other = GPT()

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        a = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        b = ShardedModule(copy.deepcopy(other), auto_wrap=Block, process_group=pg)
        b.load_state_dict({k: v.clone() for k, v in a.state_dict().items()})
        want, got = a.full_state_dict(), b.full_state_dict()
        assert all(torch.equal(want[k], got[k]) for k in want)

    _run(world_size, fn)


def test_other_shapes_are_refused_naming_the_right_calls() -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(GPT(), auto_wrap=Block, process_group=pg, sync_module_states=False)
        wrong = {k: torch.zeros(3) for k in nn_state_keys(m)}
        with pytest.raises(ValueError, match="load_full_state_dict.*load_checkpoint"):
            m.load_state_dict(wrong)

    run_ranks(2, fn, timeout=30.0)


def nn_state_keys(model: ShardedModule) -> list[str]:
    return list(torch.nn.Module.state_dict(model).keys())


def test_another_ranks_state_dict_is_refused_even_with_equal_shapes() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(torch.nn.Linear(4, 4, bias=False) for _ in range(3)))
    saved: dict[int, dict[str, torch.Tensor]] = {}  # ranks are threads of this process

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=torch.nn.Linear, process_group=pg)
        saved[rank] = copy.deepcopy(m.state_dict())
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks have kept theirs
        mine, theirs = saved[rank], saved[1 - rank]
        m.load_state_dict(mine)
        assert all(v.shape == mine[k].shape == (1, 8) for k, v in theirs.items())
        with pytest.raises(ValueError, match=f"rank {1 - rank} of 2.*save_checkpoint"):
            m.load_state_dict(theirs)

    run_ranks(2, fn, timeout=30.0)


def test_optimizer_state_of_another_shape_is_refused_before_it_changes_anything() -> None:
    """``opt.load_state_dict(sd)`` on a sharded model's optimizer where ``sd`` holds state of
    neither a parameter's shape (which is cut to this rank's piece) nor this rank's piece's (say,
    another world size's pieces): torch would take it, and the step fail half-way. The load
    refuses it, before or after the first step, changing nothing (before the first step it was
    the step that refused it); the model then trains."""
    torch.manual_seed(0)
    plain = GPT()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    x, y = make_batch(0, 4)
    plain(x, y).backward()
    plain_opt.step()
    other = copy.deepcopy(plain_opt.state_dict())
    other["state"][0]["exp_avg"] = other["state"][0]["exp_avg"].reshape(-1)[:7].clone()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(plain), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of parameter 0 has"):
            opt.load_state_dict(other)
        assert not opt.state
        m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        opt.step()
        fresh = torch.optim.AdamW(m.parameters(), lr=1e-2)
        fresh.step()
        state = copy.deepcopy(fresh.state_dict())
        with pytest.raises(ValueError, match=r"optimizer state 'exp_avg' of parameter 0 has"):
            fresh.load_state_dict(other)
        torch.testing.assert_close(fresh.state_dict(), state, atol=0, rtol=0)
        # state put in by hand, bypassing load_state_dict: its first step refuses it
        direct = torch.optim.AdamW(m.parameters(), lr=1e-2)
        wte = m.wte.weight
        direct.state[wte] = {k: v.clone() for k, v in other["state"][0].items()}
        before = {k: v.clone() for k, v in m.state_dict().items()}
        with pytest.raises(ValueError, match=r"AdamW holds state 'exp_avg' of 'wte.weight'"):
            direct.step()
        assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())

    run_ranks(2, fn, timeout=30.0)


def _hooked(model: GPT, said: list[str]) -> GPT:
    """``model`` with state-dict hooks that make new values: a unit's cast to float16, a scale
    inside another unit, keys renamed at the root, a pre-hook noting ``keep_vars``."""

    def cast(module: nn.Module, state: dict, prefix: str, metadata: dict) -> None:
        for k in [k for k in state if k.startswith(prefix)]:
            state[k] = state[k].to(torch.float16)

    def scale(module: nn.Module, state: dict, prefix: str, metadata: dict) -> None:
        for k in [k for k in state if k.startswith(prefix)]:
            state[k] = state[k] * 2

    def rename(module: nn.Module, state: dict, prefix: str, metadata: dict) -> dict:
        return type(state)((k.replace("ln_f.", "final_norm."), v) for k, v in state.items())

    model.blocks[0]._register_state_dict_hook(cast)
    model.blocks[1].mlp.register_state_dict_post_hook(scale)
    model._register_state_dict_hook(rename)
    model.register_state_dict_pre_hook(lambda m, prefix, keep_vars: said.append(str(keep_vars)))
    return model


def test_state_dict_hooks_see_the_full_values_in_full_state_dict() -> None:
    """A module's state-dict hook that makes a new value from a parameter (a cast, a scale)
    made it from this rank's piece, and ``full_state_dict()`` handed that out as the whole
    tensor: (1, 1296)-shaped float16 pieces of (36, 36) weights, saved without a word. The
    hooks now see the full values, as on the unwrapped model, and ``full_state_dict()`` equals
    the plain model's ``state_dict()`` with the same hooks, dtypes and renamed keys included."""
    torch.manual_seed(0)
    base = GPT(width=36, depth=2)
    said_plain: list[str] = []
    want = _hooked(copy.deepcopy(base), said_plain).state_dict()

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, torch.Tensor], list[str]]:
        said: list[str] = []
        model = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        _hooked(model, said)
        return model.full_state_dict(), said

    for state, said in _run(2, fn):
        assert list(state) == list(want) and said == said_plain == ["False"]
        for k, v in want.items():
            assert state[k].dtype == v.dtype, k
            torch.testing.assert_close(state[k], v, atol=0, rtol=0, msg=k)


def _load_hooked(model: GPT, calls: list[str]) -> GPT:
    """``model`` with load hooks: a unit's pre-hook renaming an older checkpoint's keys
    (``old_attn.`` to ``attn.``), the root's pre-hook (torch's private form, as libraries
    register it) and post-hook noting their calls."""

    def rename(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
        for k in [k for k in state if k.startswith(prefix + "old_attn.")]:
            state[k.replace("old_attn.", "attn.")] = state.pop(k)

    def noted(state: dict, prefix: str, *args: object) -> None:
        calls.append(f"pre {len(state)}")

    def after(module: nn.Module, keys: object) -> None:
        calls.append(f"post {keys.missing_keys} {keys.unexpected_keys}")  # type: ignore[attr-defined]

    model.blocks[1].register_load_state_dict_pre_hook(rename)
    model._register_load_state_dict_pre_hook(noted)
    model.register_load_state_dict_post_hook(after)
    return model


@pytest.mark.parametrize("how", ["load_state_dict", "load_full_state_dict"])
def test_load_hooks_run_as_on_the_unwrapped_model(how: str) -> None:
    """A full state dict loaded into a model whose modules have load hooks: the model loaded
    it without them (its keys checked and its values copied before any hook), so a pre-hook
    renaming an older checkpoint's keys never ran, the renamed keys were reported missing and
    the old ones unexpected (or raised with ``strict``), nothing of them was loaded, and no
    post-hook ran. Now the hooks run as on the unwrapped model and the values load; a
    parameter of another shape is refused by name (``load_full_state_dict`` names its whole
    shape as torch does, not its piece's)."""
    torch.manual_seed(0)
    base = GPT(width=36, depth=2)
    torch.manual_seed(1)
    other = GPT(width=36, depth=2).state_dict()
    old = {k.replace("blocks.1.attn.", "blocks.1.old_attn."): v for k, v in other.items()}
    wrong = dict(other)
    wrong["blocks.0.mlp.0.weight"] = torch.zeros(144, 35)
    plain_calls: list[str] = []
    plain = _load_hooked(copy.deepcopy(base), plain_calls)
    plain.load_state_dict(old)
    loaded_calls = list(plain_calls)
    with pytest.raises(RuntimeError) as plain_error:
        plain.load_state_dict(wrong)
    shape_said = "size mismatch for blocks.0.mlp.0.weight: copying a param with shape "
    assert shape_said in str(plain_error.value)

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, torch.Tensor], list[str], str]:
        calls: list[str] = []
        model = _load_hooked(
            ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg), calls
        )
        getattr(model, how)(old)
        calls = list(calls)
        state = model.full_state_dict()
        with pytest.raises(RuntimeError) as error:
            getattr(model, how)(wrong)
        return state, calls, str(error.value)

    for state, calls, said in _run(2, fn):
        assert calls == loaded_calls
        torch.testing.assert_close(state, other, atol=0, rtol=0)
        assert (
            f"{shape_said}torch.Size([144, 35]) from checkpoint, the shape in current model "
            "is torch.Size([144, 36])." in said
        )


class _Scale(nn.Module):
    def __init__(self, n: int) -> None:
        super().__init__()
        self.g = nn.Parameter(torch.ones(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.g


def test_a_value_of_the_pieces_shape_that_is_no_piece_is_refused_as_torch_refuses_it() -> None:
    """A tensor of the wrong size that happens to have this rank's piece shape (a ``Scale(5)``'s
    checkpoint loaded into a ``Scale(10)`` on two ranks; a file of pieces written by
    safetensors, which knows nothing of pieces) loaded silently as this rank's piece, even with
    ``strict=True``: both ranks took the same five values. torch refuses it, ``strict=False``
    too, naming both shapes; now so does the sharded model, on every rank, loading nothing.
    This rank's own ``state_dict()`` still loads, also as a copy without its metadata
    (``dict(sd)``, its tensors cloned), and another rank's copy is refused by its pieces'
    elements."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(10, 10), _Scale(10))
    wrong = {"1.g": torch.arange(5.0)}
    with pytest.raises(RuntimeError) as plain:
        copy.deepcopy(base).load_state_dict(wrong, strict=False)
    said = (
        "size mismatch for 1.g: copying a param with shape torch.Size([5]) from checkpoint, "
        "the shape in current model is torch.Size([10])."
    )
    assert said in str(plain.value)
    kept: dict[int, dict[str, torch.Tensor]] = {}

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=_Scale, process_group=pg)
        assert m.state_dict()["1.g"].shape == (5,)
        before = m.full_state_dict()
        for strict in (True, False):
            with pytest.raises(RuntimeError, match=f"^load_state_dict: {re.escape(said)} .*"):
                m.load_state_dict(wrong, strict=strict)
        pieces = {k: v.as_subclass(torch.Tensor).clone() for k, v in m.state_dict().items()}
        with pytest.raises(RuntimeError, match="size mismatch for 0.weight"):
            m.load_state_dict(pieces)  # what safetensors.load_file of a rank's pieces gives
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        kept[rank] = {k: v.clone() for k, v in m.state_dict().items()}  # no metadata
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks have kept theirs
        assert m.load_state_dict(kept[rank]).missing_keys == []
        with pytest.raises(ValueError, match=f"elements .* another rank's piece.* rank {rank}"):
            m.load_state_dict(kept[1 - rank])
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)

    run_ranks(2, fn, timeout=30.0)


def test_safetensors_of_a_ranks_pieces_is_refused_before_it_writes(tmp_path) -> None:  # noqa: ANN001
    """``safetensors.torch.save_file(model.state_dict(), path)`` (the habit of a script that
    saved its unwrapped model so) wrote this rank's pieces under the full names, the other
    ranks' elements lost: safetensors reads a tensor's memory, never pickling it, so the
    refusal of ``torch.save`` did not reach it. Now refused, naming the calls that save the
    whole model, and nothing is written; ``full_state_dict()`` saves as before."""
    st = pytest.importorskip("safetensors.torch")
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Tanh(), nn.Linear(8, 8, bias=False))

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=nn.Linear, process_group=pg)
        path = tmp_path / f"rank{rank}.safetensors"
        with pytest.raises(TypeError, match="safetensors was given this rank's piece.*export"):
            st.save_file(m.state_dict(), str(path))
        assert not path.exists()
        st.save_file(m.full_state_dict(), str(path))
        torch.testing.assert_close(st.load_file(str(path)), base.state_dict(), atol=0, rtol=0)

    run_ranks(2, fn, timeout=30.0)


class _Normed(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(7, 13), nn.BatchNorm1d(13))


def test_a_batch_norm_checkpoint_without_num_batches_tracked_loads_as_in_torch() -> None:
    """Checkpoints older than ``num_batches_tracked`` lack it; torch's batch norm fills it in
    as it loads, so the unwrapped model loads them strictly. The sharded model checked the keys
    itself and refused one (``strict=False``: reported it missing). Now torch's own loading
    runs: the same result, and the same values."""
    torch.manual_seed(0)
    base = nn.Sequential(_Normed(), nn.Linear(13, 5))
    torch.manual_seed(1)
    other = nn.Sequential(_Normed(), nn.Linear(13, 5))
    with torch.no_grad():
        other[0][1].running_mean.normal_()
    old = {k: v for k, v in other.state_dict().items() if not k.endswith("num_batches_tracked")}
    plain = copy.deepcopy(base)
    assert plain.load_state_dict(old) == plain.load_state_dict(old, strict=False)
    assert plain.load_state_dict(old).missing_keys == []

    def fn(rank: int, pg: ProcessGroup) -> None:
        for strict in (True, False):
            m = ShardedModule(copy.deepcopy(base), auto_wrap=_Normed, process_group=pg)
            result = m.load_state_dict(old, strict=strict)
            assert (result.missing_keys, result.unexpected_keys) == ([], [])
            torch.testing.assert_close(m.full_state_dict(), plain.state_dict(), atol=0, rtol=0)

    run_ranks(2, fn, timeout=30.0)


@pytest.mark.parametrize("how", ["load_state_dict", "load_full_state_dict"])
def test_tied_keys_holding_different_values_load_the_last_as_torch_does(how: str) -> None:
    """A state dict with different values under two tied names (an untied checkpoint loaded
    into a tied model): torch copies each key in turn, so the tied parameter ends with the
    last key's value (``lm_head.weight``); the sharded model kept the first."""
    torch.manual_seed(0)
    base = GPT(tied=True)
    state = dict(base.state_dict())
    state["wte.weight"], state["lm_head.weight"] = torch.randn(2, *state["wte.weight"].shape)
    plain = copy.deepcopy(base)
    plain.load_state_dict(state)
    assert torch.equal(plain.wte.weight, state["lm_head.weight"])

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        getattr(m, how)(state)
        torch.testing.assert_close(m.full_state_dict(), plain.state_dict(), atol=0, rtol=0)

    run_ranks(2, fn, timeout=30.0)
