"""The public API of a wrapped model: identity, names, parameter groups, clipping, state dicts
and ``gathered()``, each against a deep-copied plain model over real optimizer steps.

Proves that a wrapped model keeps its class, attributes, methods and names (Hugging Face
models included); that its parameters are 1-D shards summing to the original sizes, empty on
some ranks without harm; that parameter groups by name, ``clip_grad_norm_``,
``full_state_dict``, ``load_full_state_dict``, ``gathered()`` and a multi-grad hook on the
parameters behave as their plain-PyTorch counterparts do on the whole model.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_api.py -q``
"""

from __future__ import annotations

import copy
import gc
import logging
import warnings
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, WithBatchNorm, make_batch
from tests.support.peers import full_param
from tests.support.ranks import run_ranks

GLOBAL_BATCH = 8  # divisible by every world size tested, so mean of rank means == global mean
STEPS = 3

ParamGroups = Callable[[Iterable[tuple[str, nn.Parameter]]], list[dict[str, Any]]]


# helpers -----------------------------------------------------------------------------


def _group(pg: ProcessGroup) -> ProcessGroup | None:
    """World size 1 runs without a process group, as ``python train.py`` does."""
    return pg if pg.size() > 1 else None


def _wrap(model: nn.Module, pg: ProcessGroup, auto_wrap: Any = Block) -> Any:
    return ShardedModule(copy.deepcopy(model), auto_wrap=auto_wrap, process_group=_group(pg))


def _rank_mean(x: Tensor, pg: ProcessGroup) -> float:
    t = x.detach().clone()
    pg.allreduce([t]).wait()
    return t.item() / pg.size()


def _rank_sum(n: int, pg: ProcessGroup) -> int:
    t = torch.tensor([n])
    pg.allreduce([t]).wait()
    return int(t.item())


def _local(t: Tensor, pg: ProcessGroup) -> Tensor:
    return t.chunk(pg.size())[pg.rank()]


def _gpt(seed: int = 0, tied: bool = False) -> GPT:
    torch.manual_seed(seed)
    return GPT(tied=tied)


def _no_decay(name: str) -> bool:
    return "bias" in name or "ln" in name or "norm" in name


def _decay_groups(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    """The usual AdamW grouping: no weight decay on biases and norms."""
    named = list(named)
    return [
        {"params": [p for n, p in named if not _no_decay(n)], "weight_decay": 0.5},
        {"params": [p for n, p in named if _no_decay(n)], "weight_decay": 0.0},
    ]


def _all_decay(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    return [{"params": [p for _, p in named], "weight_decay": 0.5}]


def _one_group(named: Iterable[tuple[str, nn.Parameter]]) -> list[dict[str, Any]]:
    return [{"params": [p for _, p in named]}]


def _reference_adamw_losses(
    model: nn.Module, steps: int, groups: ParamGroups = _one_group
) -> list[float]:
    """Per-step loss of the plain model trained with AdamW on the whole global batch."""
    ref = copy.deepcopy(model)
    opt = torch.optim.AdamW(groups(ref.named_parameters()), lr=1e-2)
    losses = []
    for step in range(steps):
        idx, targets = make_batch(step, GLOBAL_BATCH)
        loss = ref(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _sharded_adamw_losses(
    m: nn.Module, pg: ProcessGroup, steps: int, groups: ParamGroups = _one_group
) -> list[float]:
    """Per-step global loss of the sharded model, each rank on its slice of the batch."""
    opt = torch.optim.AdamW(groups(m.named_parameters()), lr=1e-2)
    losses = []
    for step in range(steps):
        idx, targets = make_batch(step, GLOBAL_BATCH)
        loss = m(_local(idx, pg), _local(targets, pg))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_rank_mean(loss, pg))
    return losses


def _assert_state_dicts_equal(
    got: dict[str, Tensor], expected: dict[str, Tensor], atol: float = 0.0
) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert got[key].device.type == "cpu", key
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0.0, msg=key)


# identity ----------------------------------------------------------------------------


class ConfiguredGPT(GPT):
    """A GPT with a method of its own, to check that methods survive wrapping."""

    def loss_on(self, idx: Tensor, targets: Tensor) -> Tensor:
        return self(idx, targets)

    def depth(self) -> int:
        return len(self.blocks)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_wrapped_model_keeps_class_attributes_and_names(world_size: int) -> None:
    torch.manual_seed(0)
    model = ConfiguredGPT()
    model.config = {"width": 36, "depth": 3}
    model.run_name = "tiny"
    numels = {n: p.numel() for n, p in model.named_parameters()}
    idx, targets = make_batch(0, GLOBAL_BATCH)
    ref_loss = model(idx, targets).item()

    def fn(rank: int, pg: ProcessGroup) -> None:
        original = copy.deepcopy(model)
        m = ShardedModule(original, auto_wrap=Block, process_group=_group(pg))
        assert m is original
        assert isinstance(m, ConfiguredGPT) and isinstance(m, GPT)
        assert isinstance(m, ShardedModule)
        assert isinstance(m.blocks[0], Block) and isinstance(m.blocks[0].attn.qkv, nn.Linear)
        assert m.config == {"width": 36, "depth": 3} and m.run_name == "tiny"
        assert m.context == 16 and m.depth() == 3
        assert [n for n, _ in m.named_parameters()] == list(numels)
        assert list(m.state_dict()) == list(model.state_dict())
        assert [n for n, _ in m.named_modules()] == [n for n, _ in model.named_modules()]
        dims = {n: p.dim() for n, p in model.named_parameters()}
        for name, p in m.named_parameters():
            # this rank's piece, along the last dimension, in as many dimensions as the parameter
            assert isinstance(p, nn.Parameter) and p.dim() == dims[name], name
            assert p.shape[:-1] == (1,) * (p.dim() - 1), name
            assert _rank_sum(p.numel(), pg) == numels[name], name
        loss = m.loss_on(_local(idx, pg), _local(targets, pg))
        assert _rank_mean(loss, pg) == pytest.approx(ref_loss, abs=1e-5)

    run_ranks(world_size, fn)


class WithOwnSummary(GPT):
    """A model with a ``summary()`` of its own, a clipping method, an attribute ``comm_stats``
    and an ``id``: names of which the first three are shardwrap's on a sharded model."""

    def summary(self) -> str:
        return "the model's own summary"

    def clip_grad_norm_(self, max_norm: float) -> None:
        raise AssertionError("the model's own clipping ran")


def test_names_the_sharded_model_answers_with_shardwraps_own_are_warned_at_wrapping() -> None:
    """A model whose class or instance holds ``summary``, ``clip_grad_norm_`` or ``comm_stats``
    is warned at wrapping, naming each and how to reach the model's own (before: each was
    replaced by shardwrap's without a word); names shardwrap leaves alone (``id``) stay the
    model's, and a model without such names wraps without the warning."""
    torch.manual_seed(0)
    model = WithOwnSummary()
    model.comm_stats = ["the model's own"]
    model.id = 3
    with pytest.warns(UserWarning, match="answers with shardwrap's own") as caught:
        m = ShardedModule(model, auto_wrap=Block)
    (said,) = [str(w.message) for w in caught if "shardwrap's own" in str(w.message)]
    assert "summary (WithOwnSummary's: call WithOwnSummary.summary(model))" in said
    assert "clip_grad_norm_ (WithOwnSummary's" in said
    assert "comm_stats (an attribute: read it as vars(model)['comm_stats'])" in said
    assert "'id'" not in said and "module" not in said
    assert WithOwnSummary.summary(m) == "the model's own summary"
    assert vars(m)["comm_stats"] == ["the model's own"] and m.id == 3
    assert "unit" in m.summary()  # shardwrap's
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedModule(GPT(), auto_wrap=Block)


_REGISTERED: dict[str, type] = {}


class Registered(nn.Module):
    """A base class whose ``__init_subclass__`` takes a required class argument and records
    each subclass under it, as model registries do."""

    def __init_subclass__(cls, *, key: str, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _REGISTERED[key] = cls


class RegisteredGPT(Registered, key="gpt"):
    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT()

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        return self.gpt(idx, targets)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_model_class_with_an_init_subclass_hook_wraps_and_trains(world_size: int) -> None:
    """The class a wrapped model takes runs none of its class's ``__init_subclass__`` hooks
    (before: wrapping raised the hook's TypeError for its missing required argument; a
    registry would have recorded shardwrap's class); the wrapped model's loss is the plain
    model's."""
    torch.manual_seed(0)
    model = RegisteredGPT()
    idx, targets = make_batch(0, GLOBAL_BATCH)
    want = model(idx, targets).item()

    def fn(rank: int, pg: ProcessGroup) -> float:
        m = _wrap(model, pg)
        assert isinstance(m, RegisteredGPT) and isinstance(m, ShardedModule)
        loss = m(_local(idx, pg), _local(targets, pg))
        loss.backward()
        return _rank_mean(loss, pg)

    for got in run_ranks(world_size, fn):
        assert got == pytest.approx(want, abs=1e-5)
    assert _REGISTERED == {"gpt": RegisteredGPT}


class TinyHead(nn.Module):
    """A layer and a one-output head, whose bias (one element) fits on a single rank."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(5, 6)
        self.head = nn.Linear(6, 1)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 5) -> (B,)
        return self.head(torch.tanh(self.body(x))).squeeze(-1)


@pytest.mark.parametrize("world_size", [2, 4])
def test_empty_shards_train_with_adamw_and_clipping(world_size: int) -> None:
    torch.manual_seed(0)
    model = TinyHead()
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(4, GLOBAL_BATCH, 5, generator=generator)
    data = list(zip(inputs, torch.randn(4, GLOBAL_BATCH, generator=generator)))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    ref_losses, ref_norms = [], []
    for x, y in data:
        loss = F.mse_loss(ref(x), y)
        loss.backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.2).item())
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    assert all(n > 0.2 for n in ref_norms)  # every step clips

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], list[float]]:
        m = _wrap(model, pg, auto_wrap=None)
        shard = dict(m.named_parameters())
        assert _rank_sum(shard["head.bias"].numel(), pg) == 1
        assert _rank_sum(int(any(p.numel() == 0 for p in m.parameters())), pg) >= 1
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        losses, norms = [], []
        for x, y in data:
            loss = F.mse_loss(m(_local(x, pg)), _local(y, pg))
            loss.backward()
            norms.append(m.clip_grad_norm_(0.2).item())
            opt.step()
            opt.zero_grad()
            losses.append(_rank_mean(loss, pg))
        return losses, norms

    for losses, norms in run_ranks(world_size, fn):
        assert losses == pytest.approx(ref_losses, abs=1e-5)
        assert norms == pytest.approx(ref_norms, rel=1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_hugging_face_gpt2_keeps_class_and_config(world_size: int) -> None:
    """Hugging Face training parity is ``tests/engine/test_parity.py``'s; here, identity."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = GPT2Config(vocab_size=67, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).eval()
    idx, _ = make_batch(0, GLOBAL_BATCH)
    ref_loss = model(input_ids=idx, labels=idx).loss.item()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap=GPT2Block)
        assert isinstance(m, GPT2LMHeadModel) and isinstance(m, ShardedModule)
        assert m.config is not None and m.config.n_embd == 32 and m.config.n_layer == 2
        assert isinstance(m.transformer.h[1], GPT2Block)
        assert list(m.state_dict()) == list(model.state_dict())
        local = _local(idx, pg)
        with torch.no_grad():
            loss = m(input_ids=local, labels=local).loss
        assert _rank_mean(loss, pg) == pytest.approx(ref_loss, abs=1e-5)

    run_ranks(world_size, fn)


# optimizer and clipping --------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_parameter_groups_by_name_train_in_loss_parity(world_size: int) -> None:
    model = _gpt()
    ref_losses = _reference_adamw_losses(model, STEPS, _decay_groups)
    # The grouping matters: decaying everything gives measurably different losses.
    assert abs(_reference_adamw_losses(model, STEPS, _all_decay)[-1] - ref_losses[-1]) > 1e-4

    def fn(rank: int, pg: ProcessGroup) -> list[float]:
        return _sharded_adamw_losses(_wrap(model, pg), pg, STEPS, _decay_groups)

    for losses in run_ranks(world_size, fn):
        assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize(("norm_type", "max_norm"), [(2.0, 0.1), (float("inf"), 0.005), (1.0, 1.0)])
def test_clip_grad_norm_matches_torch_and_clipped_steps_keep_parity(
    world_size: int, norm_type: float, max_norm: float
) -> None:
    model = _gpt()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    ref_norms = []
    for step in range(STEPS):
        idx, targets = make_batch(step, GLOBAL_BATCH)
        ref(idx, targets).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm, norm_type))
        ref_opt.step()
        ref_opt.zero_grad()
    assert all(n > max_norm for n in ref_norms)  # every step clips

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Tensor], dict[str, Tensor]]:
        m = _wrap(model, pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        norms = []
        for step in range(STEPS):
            idx, targets = make_batch(step, GLOBAL_BATCH)
            m(_local(idx, pg), _local(targets, pg)).backward()
            norms.append(m.clip_grad_norm_(max_norm, norm_type=norm_type))
            opt.step()
            opt.zero_grad()
        return norms, m.full_state_dict()

    for norms, state in run_ranks(world_size, fn):
        for got, expected in zip(norms, ref_norms):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        _assert_state_dicts_equal(state, ref.state_dict(), atol=1e-5)


def _norms_and_weights_match(
    model: nn.Module, train: Callable[[nn.Module, int, int], list[float]]
) -> list[float]:
    """Train a copy of ``model`` unwrapped and one wrapped at 2 ranks with ``train(m, rank,
    world)``: the norms it returns and the weights after must match. Returns the norms."""
    ref = copy.deepcopy(model)
    ref_norms = train(ref, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor]]:
        m = _wrap(model, pg)
        return train(m, rank, pg.size()), m.full_state_dict()

    for norms, state in run_ranks(2, fn):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        _assert_state_dicts_equal(state, ref.state_dict(), atol=1e-5)
    return ref_norms


def test_the_norm_of_the_gradients_joined_into_one_vector_is_the_whole_models() -> None:
    """Clipping written by hand over ``parameters_to_vector`` of the gradients (``torch.cat`` of
    their views): the joined pieces were a plain tensor, so its norm was each rank's own part,
    different on each rank, and the ranks clipped differently. Shard gradients of one group
    joined are now this rank's pieces of the joined vector: its norm is the whole model's."""
    model = _gpt()

    def train(m: nn.Module, rank: int, world: int) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        norms = []
        for step in range(STEPS):
            idx, targets = make_batch(step, GLOBAL_BATCH)
            m(idx.chunk(world)[rank], targets.chunk(world)[rank]).backward()
            grads = [p.grad for p in m.parameters()]
            norm = torch.nn.utils.parameters_to_vector(grads).norm()
            for g in grads:
                g.mul_(torch.clamp(0.5 / (norm + 1e-6), max=1.0))
            norms.append(norm.item())
            opt.step()
            opt.zero_grad()
        return norms

    assert all(n > 0.5 for n in _norms_and_weights_match(model, train))  # every step clips


@pytest.mark.parametrize("adaptive", [False, True], ids=["sam", "asam"])
def test_sams_norm_of_scaled_gradients_is_the_whole_models(adaptive: bool) -> None:
    """SAM steps from weights moved by ``rho * g / |g|``, the norm over every parameter of
    ``1.0 * p.grad`` (adaptive SAM: of ``|p| * p.grad``, moved by ``p**2 * g``), as the widely
    copied implementation writes it. A product of a shard gradient was a plain tensor, so its
    norm was each rank's own part: the ranks moved their pieces by different amounts and
    trained apart from the plain model without an error. Elementwise arithmetic of a shard
    gradient is now a piece of it, whose norm completes."""
    model = _gpt()

    def train(m: nn.Module, rank: int, world: int) -> list[float]:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        params, norms = list(m.parameters()), []
        for step in range(STEPS):
            idx, targets = make_batch(step, GLOBAL_BATCH)
            batch = idx.chunk(world)[rank], targets.chunk(world)[rank]
            m(*batch).backward()
            with torch.no_grad():
                scaled = [(p.abs() if adaptive else 1.0) * p.grad for p in params]
                norm = torch.stack([s.norm(p=2) for s in scaled]).norm(p=2)
                moves = [(p.pow(2) if adaptive else 1.0) * p.grad * (0.05 / norm) for p in params]
                for p, move in zip(params, moves):
                    p.add_(move)
            norms.append(norm.item())
            opt.zero_grad()
            m(*batch).backward()
            with torch.no_grad():
                for p, move in zip(params, moves):
                    p.sub_(move)
            opt.step()
            opt.zero_grad()
        return norms

    _norms_and_weights_match(model, train)


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
def test_clip_grad_norm_of_a_float64_model_is_reduced_in_float64(norm_type: float) -> None:
    model = _gpt().double()
    idx, targets = make_batch(0, GLOBAL_BATCH)
    ref = copy.deepcopy(model)
    ref(idx, targets).backward()
    expected = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type)

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = _wrap(model, pg)
        m(_local(idx, pg), _local(targets, pg)).backward()
        return torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01, norm_type)

    for got in run_ranks(2, fn):
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=1e-13, atol=0)


def test_wrapping_logs_a_summary_on_rank_0_and_summary_shows_it(
    caplog: pytest.LogCaptureFixture, default_stage: int
) -> None:
    model = _gpt()
    caplog.set_level(logging.INFO, logger="shardwrap")

    def fn(rank: int, pg: ProcessGroup) -> str:
        return _wrap(model, pg).summary()

    summaries = run_ranks(2, fn)
    logged = [r.getMessage() for r in caplog.records if r.name == "shardwrap"]
    assert logged == [summaries[0]]  # once, from rank 0
    shard_mib = sum(p.numel() for p in model.parameters()) * 4 / 2 / 2**20
    for text in summaries:
        assert text.startswith(f"shardwrap: GPT over 2 ranks on cpu, ZeRO stage {default_stage}")
        assert "3 units and the root" in text and "offload: none" in text
        assert f"shards {shard_mib:.1f} MiB" in text, text
        assert "buckets of up to 4.0 MiB: 4 of 4 units fit one" in text, text


# full state dict ---------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_full_state_dict_is_the_plain_state_dict(world_size: int) -> None:
    model = _gpt(tied=True)
    expected = model.state_dict()
    assert "wte.weight" in expected and "lm_head.weight" in expected

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        m = _wrap(model, pg)
        return m.full_state_dict(), m.full_state_dict(rank0_only=True)

    for rank, (full, rank0_only) in enumerate(run_ranks(world_size, fn)):
        _assert_state_dicts_equal(full, expected)
        torch.testing.assert_close(full["wte.weight"], full["lm_head.weight"], atol=0, rtol=0)
        if rank == 0:
            _assert_state_dicts_equal(rank0_only, expected)
        else:
            assert rank0_only == {}


@pytest.mark.parametrize("world_size", [1, 2])
def test_full_state_dict_includes_buffers(world_size: int) -> None:
    torch.manual_seed(0)
    model = WithBatchNorm()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(GLOBAL_BATCH, 13, generator=generator)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        local_ref = copy.deepcopy(model)
        local_ref(_local(x, pg))  # batch norm statistics are those of the local batch
        m = _wrap(model, pg, auto_wrap=None)
        m(_local(x, pg))
        return m.full_state_dict(), local_ref.state_dict()

    for full, expected in run_ranks(world_size, fn):
        assert {"net.1.running_mean", "net.1.running_var", "net.1.num_batches_tracked"} <= set(full)
        assert full["net.1.num_batches_tracked"].item() == 1
        _assert_state_dicts_equal(full, expected, atol=1e-6)


# load full state dict ----------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("tied", [False, True])
def test_load_full_state_dict_then_training_continues_in_parity(
    world_size: int, tied: bool
) -> None:
    model = _gpt(seed=0, tied=tied)
    other = _gpt(seed=1, tied=tied).state_dict()
    loaded = _gpt(seed=0, tied=tied)
    loaded.load_state_dict(other)
    ref_losses = _reference_adamw_losses(loaded, STEPS)
    idx, _ = make_batch(0, GLOBAL_BATCH)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[float]]:
        m = _wrap(model, pg)
        with torch.no_grad():
            m(_local(idx, pg))  # leaves the root unit gathered: the load must make it stale
        m.load_full_state_dict(other)
        state = m.full_state_dict()
        return state, _sharded_adamw_losses(m, pg, STEPS)

    for state, losses in run_ranks(world_size, fn):
        _assert_state_dicts_equal(state, other)
        assert losses == pytest.approx(ref_losses, abs=1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_load_full_state_dict_rejects_wrong_keys_and_shapes(world_size: int) -> None:
    model = _gpt(seed=0)
    before = model.state_dict()
    wrong_keys = dict(_gpt(seed=1).state_dict())
    del wrong_keys["blocks.1.ln_2.bias"]
    wrong_keys["blocks.1.ln_3.bias"] = torch.zeros(36)
    wrong_shape = dict(_gpt(seed=1).state_dict())
    wrong_shape["blocks.2.mlp.0.weight"] = torch.zeros(144, 35)

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, str, dict[str, Tensor]]:
        m = _wrap(model, pg)
        with pytest.raises(KeyError) as keys:  # a RuntimeError too, as torch raises
            m.load_full_state_dict(wrong_keys)
        assert isinstance(keys.value, RuntimeError)
        with pytest.raises(ValueError) as shape:  # a RuntimeError too, as torch raises
            m.load_full_state_dict(wrong_shape)
        assert isinstance(shape.value, RuntimeError)
        return str(keys.value), str(shape.value), m.full_state_dict()

    for key_message, shape_message, state in run_ranks(world_size, fn):
        # torch's words, and read as plainly: a KeyError's str() would quote them
        assert key_message.startswith("load_full_state_dict: Error(s) in loading state_dict ")
        assert '\n\tMissing key(s) in state_dict: "blocks.1.ln_2.bias".' in key_message
        assert '\n\tUnexpected key(s) in state_dict: "blocks.1.ln_3.bias".' in key_message
        assert (
            "size mismatch for blocks.2.mlp.0.weight: copying a param with shape "
            "torch.Size([144, 35]) from checkpoint, the shape in current model is "
            "torch.Size([144, 36])." in shape_message
        )
        _assert_state_dicts_equal(state, before)  # a rejected dict leaves the model untouched


# gradient hooks ----------------------------------------------------------------------


class GPTWithUnused(GPT):
    """A GPT with a layer its forward never calls: that layer's parameters get no gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = nn.Linear(5, 3)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_multi_grad_hook_on_the_parameters_fires_once_per_backward(
    world_size: int, stage: int
) -> None:
    """``torch.autograd.graph.register_multi_grad_hook(params, fn)`` (mode ``"all"``: once every
    gradient of the module is in) calls ``fn`` once per backward, registered on the parameters
    before wrapping or after, with each parameter's gradient as ``p.register_hook`` sees it and
    ``None`` for one that got none; at world size 1 those are the plain model's gradients
    (before: ``fn`` was never called, as it waited for gradient nodes that never run)."""
    torch.manual_seed(0)
    model = GPTWithUnused()
    batches = [make_batch(step, GLOBAL_BATCH) for step in range(STEPS)]
    plain = copy.deepcopy(model)
    expected: list[list[Tensor | None]] = []
    torch.autograd.graph.register_multi_grad_hook(list(plain.parameters()), expected.append)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for idx, targets in batches:
        plain(idx, targets).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = copy.deepcopy(model)
        before: list[list[Tensor | None]] = []
        after: list[list[Tensor | None]] = []
        torch.autograd.graph.register_multi_grad_hook(list(m.parameters()), before.append)
        m = ShardedModule(m, auto_wrap=Block, process_group=_group(pg), stage=stage)
        params = list(m.parameters())
        torch.autograd.graph.register_multi_grad_hook(params, after.append)
        seen: dict[int, Tensor] = {}
        for i, p in enumerate(params):
            p.register_hook(lambda g, i=i: seen.__setitem__(i, g))
        opt = torch.optim.SGD(params, lr=0.1)
        for step, (idx, targets) in enumerate(batches):
            seen.clear()
            m(_local(idx, pg), _local(targets, pg)).backward()
            opt.step()
            opt.zero_grad()
            assert len(before) == len(after) == step + 1
            for grads in (before[step], after[step]):
                assert len(grads) == len(params)
                for i, g in enumerate(grads):
                    if seen.get(i) is None:
                        assert g is None, i
                    else:
                        assert g is not None and torch.equal(g, seen[i]), i
            if pg.size() == 1:
                for got, want in zip(after[step], expected[step]):
                    assert (got is None) == (want is None)
                    if want is not None:
                        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        assert after[-1][-1] is None  # the unused layer's bias

    run_ranks(world_size, fn)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_gradient_hook_on_a_parameter_the_forward_does_not_use_is_never_called(
    world_size: int,
) -> None:
    """As on the plain model, whose unused parameter's gradient accumulator never runs: a hook
    registered before wrapping or after is not called (before: called with ``None``, so a
    hook ``g * 2`` raised ``TypeError``), and the parameter's gradient stays ``None``."""
    torch.manual_seed(0)
    model = GPTWithUnused()
    idx, targets = make_batch(0, GLOBAL_BATCH)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = copy.deepcopy(model)
        m.unused.weight.register_hook(lambda g: g * 2)
        m = ShardedModule(m, auto_wrap=Block, process_group=_group(pg))
        calls: list[Tensor | None] = []
        params = dict(m.named_parameters())
        params["unused.bias"].register_hook(calls.append)
        m(_local(idx, pg), _local(targets, pg)).backward()
        assert calls == []
        assert params["unused.weight"].grad is None and params["unused.bias"].grad is None

    run_ranks(world_size, fn)


# gathered ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gathered_exposes_full_parameters_and_writes_back_on_request(world_size: int) -> None:
    model = _gpt()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    idx, _ = make_batch(0, GLOBAL_BATCH)
    edited = copy.deepcopy(model)
    with torch.no_grad():
        edited.lm_head.weight.fill_(0.25)
        ref_logits = edited(idx)

    def assert_sharded(m: nn.Module) -> None:
        for name, p in m.named_parameters():
            assert full_param(m, name) is p and p.shape[:-1] == (1,) * (p.dim() - 1), name

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(*[_local(t, pg) for t in make_batch(1, GLOBAL_BATCH)]).backward()
        opt.step()  # shards now differ from the original model's parameters
        trained = m.full_state_dict()

        with m.gathered():
            for name, shape in shapes.items():
                full = full_param(m, name)
                assert full.shape == shape, name
                torch.testing.assert_close(full, trained[name], atol=0, rtol=0, msg=name)
            with torch.no_grad():
                m.lm_head.weight.mul_(0)
                m.blocks[0].ln_1.bias.add_(1)
        assert_sharded(m)
        _assert_state_dicts_equal(m.full_state_dict(), trained)

        m.load_full_state_dict(model.state_dict())
        with m.gathered(writeback=True), torch.no_grad():
            m.lm_head.weight.fill_(0.25)
        assert_sharded(m)
        _assert_state_dicts_equal(m.full_state_dict(), edited.state_dict())
        with torch.no_grad():
            logits = m(_local(idx, pg))
        torch.testing.assert_close(logits, _local(ref_logits, pg), atol=1e-5, rtol=0)

    run_ranks(world_size, fn)


@pytest.mark.parametrize("device", ["cpu:0", torch.device("cpu", 0)])
def test_a_device_named_with_its_index_reuses_buffers_as_its_plain_name_does(device: Any) -> None:
    """``device="cuda"`` names the tensors' ``cuda:0``, and ``cpu:0`` their ``cpu``: the model
    keeps the tensors' own name, so a released buffer is found again by the next unit."""

    def makes(rank: int, pg: ProcessGroup, device: Any) -> tuple[int, torch.device]:
        m = ShardedModule(GPT(), auto_wrap=Block, process_group=pg, device=device)
        pool = m._shardwrap_root.pool
        made, make = [], pool._make
        pool._make = lambda key: made.append(key) or make(key)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(3):
            x, y = (t.chunk(2)[rank] for t in make_batch(step, 4))
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
        return len(made), next(m.parameters()).device

    plain = run_ranks(2, lambda rank, pg: makes(rank, pg, "cpu"))
    named = run_ranks(2, lambda rank, pg: makes(rank, pg, device))
    assert named == plain
    assert all(where == torch.device("cpu") for _, where in named)


def test_a_dropped_model_is_freed() -> None:
    """Autograd hooks hold the model only weakly: deleting it frees shards and groups."""
    model = ShardedModule(GPT(), auto_wrap=Block)
    model(*make_batch(0, 2)).backward()
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_dropped_model_with_frozen_parameters_is_freed_by_one_collection() -> None:
    """A unit with frozen parameters counts its inputs' gradients with hooks that torch keeps
    in a cycle through the autograd graph; they hold the model weakly, so one collection
    frees it (a strong hold kept it alive until a second collection)."""
    plain = GPT()
    for block in plain.blocks:
        block.attn.requires_grad_(False)
    model = ShardedModule(plain, auto_wrap=Block)
    model(*make_batch(0, 2)).backward()
    ref = weakref.ref(model)
    gc.disable()  # no automatic collection from here: the one below is the only one
    try:
        del model, plain, block
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()


def test_a_dropped_model_whose_forward_had_no_backward_is_freed_by_one_collection() -> None:
    """A forward with gradients enabled and no backward (a loss computed and dropped) leaves
    its graph to torch's cycles; the saved-tensor hooks in it hold the model weakly, so one
    collection frees the model (before, it was never freed)."""
    model = ShardedModule(GPT(), auto_wrap=Block)
    model(*make_batch(0, 2))
    ref = weakref.ref(model)
    gc.disable()  # no automatic collection from here: the one below is the only one
    try:
        del model
        gc.collect()
        assert ref() is None
    finally:
        gc.enable()


def test_a_profiler_trace_names_shardwrap_phases() -> None:
    """Under ``torch.profiler`` each hook of a step shows as a ``shardwrap::<phase>`` range."""
    model = ShardedModule(GPT(), auto_wrap=Block)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        model(*make_batch(0, 2)).backward()
    names = {event.key for event in prof.key_averages()}
    phases = ["pre_forward", "post_forward", "pre_backward", "post_backward", "end_backward"]
    assert {f"shardwrap::{p}" for p in [*phases, "reduce"]} <= names, sorted(names)
