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
        with pytest.raises(ValueError, match=r"lm_head.weight: \(3, 3\)"):
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
        # load_state_dict tells a full state dict from this rank's pieces by the shapes first
        refused = ValueError if how == "load_state_dict" else RuntimeError
        with pytest.raises(refused) as error:
            getattr(model, how)(wrong)
        return state, calls, str(error.value)

    for state, calls, said in _run(2, fn):
        assert calls == loaded_calls
        torch.testing.assert_close(state, other, atol=0, rtol=0)
        if how == "load_state_dict":
            assert "blocks.0.mlp.0.weight: (144, 35)" in said
        else:
            assert (
                f"{shape_said}torch.Size([144, 35]) from checkpoint, the shape in current model "
                "is torch.Size([144, 36])." in said
            )
