"""State-dict, initialisation, gradient-clipping and gradient behaviours that PyTorch FSDP2's own
suite asserts, ported to shardwrap.

Upstream: ``test/distributed/_composable/fsdp/test_fully_shard_state_dict.py`` (sharded and
full state dicts), ``test_fully_shard_init.py`` (pieces, shared and duplicate modules, scalar
and channels-last parameters, meta-device initialisation, weights on rank 0 only, process
groups, parameters replaced or of mixed dtypes), ``test_fully_shard_clip_grad_norm_.py`` and
``test_fully_shard_grad.py`` (in-place and foreach operations on gradients). Each test names
the upstream test it mirrors and trains a plain deep copy of its model on the whole global
batch beside a ``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3, over
several steps (``tests/support/peers.py``): SGD with momentum, parameters equal within 1e-5;
plus each behaviour's own reads (state dicts, pieces, norms, outputs), equal to the plain
model's within 1e-5. 2 ranks unless a test says 4.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp_state.py
-q -n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.hybrid import hybrid_mesh
from tests.support.peer_models import MLP
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    assert_peer_parity,
    full_tensor,
    make_batches,
    note_grads,
    plain_step,
    shapes_of,
)
from tests.support.ranks import subgroup

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


def _model(dim: int = 5) -> nn.Sequential:
    """FSDP2's state-dict model: MLPs, one nested in a Sequential beside a linear layer."""
    torch.manual_seed(0)
    return nn.Sequential(MLP(dim), nn.Sequential(MLP(dim), nn.Linear(dim, dim)), MLP(dim))


# state dicts ------------------------------------------------------------------------------------


@stages
@pytest.mark.parametrize("dim", [2, 5], ids=["dim2", "dim5"])
def test_sharded_state_dict_holds_the_pieces_and_loads_back(stage: int, dim: int) -> None:
    """Mirrors test_fully_shard_state_dict.py::test_dp_state_dict_save_load: ``state_dict()``
    has the plain model's keys and this rank's pieces (whole again over the ranks), unchanged by
    a forward; a state dict of new values loads into the pieces; training then goes on as the
    plain model loaded alike."""
    model = _model(dim)
    batches = make_batches(3, (8, dim), (8, dim))
    plain = {k: v.clone() for k, v in model.state_dict().items()}

    def prepare(side: Side) -> None:
        state = {k: v.clone() for k, v in side.model.state_dict().items()}
        assert list(state) == list(plain)
        for key, value in state.items():
            whole = full_tensor(side, value, plain[key].shape)
            torch.testing.assert_close(whole, plain[key], rtol=0, atol=0)
        with torch.no_grad():
            side.model(side.local(batches[0][0]))
        after = side.model.state_dict()
        assert all(torch.equal(after[k], v) for k, v in state.items())
        side.model.load_state_dict({k: v * 0.5 + 0.01 for k, v in state.items()})
        for key, value in side.model.state_dict().items():
            torch.testing.assert_close(value, state[key] * 0.5 + 0.01)

    assert_peer_parity(
        model, stage=stage, batches=batches, step=plain_step(_mse), prepare=prepare, auto_wrap=MLP
    )


@stages
def test_state_dict_taken_once_follows_the_parameters(stage: int) -> None:
    """Mirrors test_fully_shard_state_dict.py::test_cached_state_dict: a state dict taken once,
    before training, shares the parameters' storage, so after the optimizer's steps it holds
    their new values, as a plain model's does."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))
    shapes = shapes_of(model)
    taken: dict[int, dict[str, Tensor]] = {}

    def prepare(side: Side) -> None:
        taken[id(side)] = side.model.state_dict()

    def finish(side: Side) -> None:
        state = taken[id(side)]
        params = dict(side.model.named_parameters())
        for name, shape in shapes.items():
            assert state[name].data_ptr() == params[name].data_ptr(), name
            side.note(f"{name} in the early state dict", full_tensor(side, state[name], shape))

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        finish=finish,
        auto_wrap=MLP,
    )


@stages
def test_full_state_dict_on_rank_zero_only(stage: int) -> None:
    """Mirrors test_fully_shard_state_dict.py::test_rank0_offload_full_state_dict:
    ``full_state_dict(rank0_only=True)`` gives rank 0 the plain model's state dict (same keys
    in the same order, full CPU tensors, equal to the plain model's after every step) and every
    other rank an empty dict."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = plain_step(_mse)(side, opt, batch)
        if side.sharded:
            on_zero = side.model.full_state_dict(rank0_only=True)
            state = side.model.full_state_dict()  # every rank's, to compare on every rank
            if side.rank == 0:
                assert list(on_zero) == list(state)
                assert all(torch.equal(on_zero[k], v) for k, v in state.items())
            else:
                assert on_zero == {}
            assert all(v.device.type == "cpu" for v in state.values())
        else:
            state = side.model.state_dict()
        side.note("full state dict", {k: v.clone() for k, v in state.items()})
        side.note("keys in order", list(state))
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_full_state_dict_loads_into_the_plain_model_and_a_fresh_wrap(stage: int) -> None:
    """Mirrors test_fully_shard_state_dict.py::test_dp_state_dict_save_load (a full state dict)
    and DeepSpeed's test_zero.py::TestZeroToFP32::test_1_param_group (consolidated weights): the
    trained model's ``full_state_dict()`` loads strictly into the plain model and, with
    ``load_full_state_dict``, into a fresh wrap of the untrained model; both then compute what
    the trained plain model computes."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))
    probe = torch.randn(8, 5, generator=torch.Generator().manual_seed(9))

    def finish(side: Side) -> None:
        with torch.no_grad():
            side.note(
                "trained output", full_tensor(side, side.model(side.local(probe)), probe.shape)
            )
        if not side.sharded:
            return
        state = side.model.full_state_dict()
        plain = copy.deepcopy(model)
        plain.load_state_dict(state, strict=True)
        fresh = ShardedModule(
            copy.deepcopy(model), process_group=side.pg, auto_wrap=MLP, stage=stage
        )
        fresh.load_full_state_dict(state)
        with torch.no_grad():
            torch.testing.assert_close(plain(probe), side_output(side, fresh, probe))
        assert all(torch.equal(v, fresh.full_state_dict()[k]) for k, v in state.items())

    def side_output(side: Side, m: nn.Module, x: Tensor) -> Tensor:
        return full_tensor(side, m(side.local(x)), x.shape)

    assert_peer_parity(
        model, stage=stage, batches=batches, step=plain_step(_mse), finish=finish, auto_wrap=MLP
    )


@stages
def test_weights_loaded_after_a_no_grad_forward_are_the_ones_used(stage: int) -> None:
    """Mirrors test_fully_shard_unsharded_views.py::test_views_survive_reshard_and_weight_loading
    and ::test_replaced_storage_recreates_view: after a no-grad forward (at stage 3 with
    upstream's ``reshard_after_forward=False``; stages 1 and 2 keep the full parameters), a
    state dict loaded into the model (the full one or this rank's pieces, with and without
    ``assign=True``) is what the next forward computes with and what training goes on from, as
    on the plain model loaded by copy. (On the plain model ``assign=True`` would leave the
    optimizer stepping the replaced parameters; shardwrap loads by copy.)"""
    model = _model()
    batches = make_batches(4, (8, 5), (8, 5))
    probe = torch.randn(8, 5, generator=torch.Generator().manual_seed(9))

    def output(side: Side) -> Tensor:
        with torch.no_grad():
            return full_tensor(side, side.model(side.local(probe)), probe.shape)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        side.note("output before loading", output(side))
        scale = 0.9 - 0.1 * side.step_index
        if not side.sharded:
            state = side.model.state_dict()
        elif side.step_index < 2:
            state = side.model.full_state_dict()
        else:
            state = side.model.state_dict()  # this rank's pieces
        assign = side.sharded and side.step_index % 2 == 1
        side.model.load_state_dict({k: v * scale for k, v in state.items()}, assign=assign)
        side.note("output after loading", output(side))
        return plain_step(_mse)(side, opt, batch)

    wrap = {"reshard_after_forward": False} if stage == 3 else {}
    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP, **wrap)


# pieces, shared modules, unusual parameters ------------------------------------------------------


@stages
def test_pieces_are_the_parameters_split_in_order(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_shard_tensor_parameters and
    ::test_fully_shard_module_and_param_fqns: every parameter the optimizer sees keeps its name
    and its number of dimensions, and the ranks' pieces, in rank order, are the parameter
    (odd sizes: uneven pieces; a linear layer shared by two MLPs: one parameter)."""
    torch.manual_seed(0)
    model = nn.Sequential(*[MLP(3, 3) for _ in range(3)])
    model[0].in_proj = model[1].in_proj
    plain = dict(model.named_parameters())

    def prepare(side: Side) -> None:
        params = dict(side.model.named_parameters())
        assert list(params) == list(plain)
        for name, param in params.items():
            assert param.ndim == plain[name].ndim, name
            whole = full_tensor(side, param, plain[name].shape)
            assert torch.equal(whole, plain[name]), name
        assert side.model[0].in_proj is side.model[1].in_proj

    batches = make_batches(3, (8, 3), (8, 3))
    assert_peer_parity(
        model, stage=stage, batches=batches, step=plain_step(_mse), prepare=prepare, auto_wrap=MLP
    )


@stages
def test_one_module_twice_in_the_model(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_managed_modules_duplicate: the same MLP object at
    two places of a Sequential is one unit, run twice per forward, its parameters counted
    once."""
    torch.manual_seed(0)
    mlp = MLP(7)
    model = nn.Sequential(mlp, nn.Tanh(), mlp)
    batches = make_batches(3, (8, 7), (8, 7))

    def prepare(side: Side) -> None:
        assert len(list(side.model.parameters())) == 4
        assert side.model[0] is side.model[2]

    assert_peer_parity(
        model, stage=stage, batches=batches, step=plain_step(_mse), prepare=prepare, auto_wrap=MLP
    )


class Buffered(MLP):
    """An MLP with a buffer that scales its output."""

    def __init__(self) -> None:
        super().__init__(7)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 7))

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x) * self.scale


@stages
def test_parameters_and_buffers_shared_across_modules(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_managed_states_shared_params_and_buffers and
    ::test_move_states_to_device_tensor: one weight shared by three MLPs' input projections
    (placed once, where all its uses meet) and one buffer shared by two of them; buffers stay
    whole, unsharded tensors; training matches the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Buffered() for _ in range(3)])
    model[0].in_proj.weight = model[1].in_proj.weight
    model[2].in_proj.weight = model[1].in_proj.weight
    model[1].scale = model[2].scale
    batches = make_batches(3, (8, 7), (8, 7))

    def prepare(side: Side) -> None:
        assert side.model[1].scale is side.model[2].scale
        assert all(b.shape == (7,) for b in side.model.buffers())

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        auto_wrap=Buffered,
    )


class ScalarGain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mlp = MLP(6)
        self.gain = nn.Parameter(torch.tensor(1.3))  # zero dimensions

    def forward(self, x: Tensor) -> Tensor:
        return self.mlp(x) * self.gain


@stages
def test_scalar_parameter_trains(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_raise_scalar_parameter: FSDP2 refuses a parameter
    of zero dimensions ("Change scalar_p to a 1D tensor"); shardwrap shards it like any other,
    its piece ``(1,)`` on the rank that holds it and ``(0,)`` elsewhere (so that its optimizer
    state, never 0-d, is told from the optimizer's ``step`` alike on every rank), and trains it
    as the plain model does."""
    torch.manual_seed(0)

    def prepare(side: Side) -> None:
        assert not side.sharded or side.model.gain.shape in ((1,), (0,))

    batches = make_batches(3, (8, 6), (8, 6))
    assert_peer_parity(
        ScalarGain(),
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        auto_wrap=MLP,
    )


class ChannelsLast(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 3*5*5) flattened images
        h = self.conv(x.view(-1, 3, 5, 5)).mean((2, 3))
        return self.head(torch.relu(h))


@stages
def test_channels_last_convolution_weight_trains(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_raise_noncontiguous_parameter: FSDP2 refuses a
    non-contiguous (channels-last) parameter; on shardwrap the convolution trains as the plain
    channels-last model does."""
    torch.manual_seed(0)
    assert not ChannelsLast().conv.weight.is_contiguous()
    batches = make_batches(3, (8, 75), (8, 2))
    assert_peer_parity(
        ChannelsLast(), stage=stage, batches=batches, step=plain_step(_mse), auto_wrap=nn.Conv2d
    )


class LateNorm(nn.Module):
    """A model whose ``weight_norm`` parameter is replaced after construction."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(6, 6, bias=False)
        self.layer2 = nn.Linear(6, 6, bias=False)
        self.weight_norm = nn.Parameter(torch.zeros(6))

    def forward(self, x: Tensor) -> Tensor:
        return self.layer2(self.layer1(x)) + self.weight_norm


@stages
def test_parameter_replaced_after_wrapping_is_the_one_used(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_reset_sharded_param_in_lazy_init: a parameter
    replaced after wrapping (``model.weight_norm = nn.Parameter(...)``, same shape), before the
    optimizer is built, is the one forward uses and the optimizer trains, as on the plain
    model."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, 6), (8, 6))

    def prepare(side: Side) -> None:
        side.model.weight_norm = nn.Parameter(torch.linspace(-1, 1, 6))

    assert_peer_parity(
        LateNorm(),
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


@stages
def test_parameter_replaced_by_one_of_another_shape_is_refused(stage: int) -> None:
    """The other half of test_fully_shard_init.py::test_reset_sharded_param_in_lazy_init: a
    replacement of another shape cannot fit the unit's flat buffer; it is refused with an error
    that names shardwrap and the parameter, instead of training something else."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, 6), (8, 6))

    def finish(side: Side) -> None:
        if side.sharded:
            with pytest.raises((ValueError, RuntimeError, TypeError)) as raised:
                side.model.weight_norm = nn.Parameter(torch.zeros(1, 6))
                side.model(side.local(batches[0][0]))
            message = str(raised.value)
            assert "weight_norm" in message and "ShardedModule" in message, message

    assert_peer_parity(
        LateNorm(),
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        finish=finish,
        auto_wrap=nn.Linear,
    )


class Float8Frozen(nn.Module):
    """A frozen float8 weight beside float32 ones (a quantized frozen base)."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(6, 6) / 3
        self.w_fp8 = nn.Parameter(base.to(torch.float8_e4m3fn), requires_grad=False)
        self.w_fp32 = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: Tensor) -> Tensor:
        return x @ self.w_fp32 + x @ self.w_fp8.to(x.dtype)


@stages
def test_frozen_float8_parameter_beside_float32_ones(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_mixed_dtypes_no_grad_param: a frozen float8
    parameter beside trainable float32 ones, with the default wrap; it keeps its dtype and
    values, the rest trains as on the plain model."""
    torch.manual_seed(0)
    model = Float8Frozen()
    batches = make_batches(3, (8, 6), (8, 6))
    _, runs = assert_peer_parity(model, stage=stage, batches=batches, step=plain_step(_mse))
    for run in runs:
        assert run.state["w_fp8"].dtype == torch.float8_e4m3fn
        assert torch.equal(run.state["w_fp8"].float(), model.w_fp8.float())


# initialisation ---------------------------------------------------------------------------------


def _pattern(module: nn.Module) -> None:
    """A deterministic initialiser: each parameter of ``module`` (not its children) from its
    shape alone, in place."""
    for name, param in module.named_parameters(recurse=False):
        with torch.no_grad():
            n = torch.arange(param.numel(), dtype=torch.float32)
            param.copy_((torch.sin(n * 0.37 + len(name)) * 0.4).reshape(param.shape))


@stages
@pytest.mark.parametrize("dim", [8, 3, 1], ids=["even", "uneven", "empty-pieces"])
def test_meta_device_model_initialised_by_param_init_fn(stage: int, dim: int) -> None:
    """Mirrors test_fully_shard_init.py::test_meta_device_1d_init: a model built on the meta
    device is materialised by the wrap, each module initialised by ``param_init_fn`` (sizes
    that split evenly, unevenly and into empty pieces); it trains exactly as the plain model
    built normally and initialised by the same function."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(dim, 1, bias=False), MLP(dim, 1, bias=False))
    model.apply(_pattern)

    def build(rank: int) -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(MLP(dim, 1, bias=False), MLP(dim, 1, bias=False))

    def prepare(side: Side) -> None:
        assert all(p.device.type == "cpu" for p in side.model.parameters())

    batches = make_batches(3, (8, dim), (8, dim))
    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        build=build,
        param_init_fn=_pattern,
        auto_wrap=MLP,
    )


class Unwritten(nn.Module):
    """A module whose parameter no initialiser writes (it has no ``reset_parameters``)."""

    def __init__(self) -> None:
        super().__init__()
        self.loose = nn.Parameter(torch.empty(5))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.loose


@stages
def test_meta_device_model_initialised_by_reset_parameters(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_meta_device_1d_init (``reset_parameters()``) and
    ::test_invalid_meta_device_init: a meta-device model is materialised with every module's
    ``reset_parameters()`` (weights drawn, LayerNorm's constants exact), the same on every rank;
    a meta tensor no initialiser writes is refused on every rank, naming it. Loaded with the
    plain model's weights, it trains as the plain model."""
    model = nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5), MLP(5))
    plain = copy.deepcopy(model.state_dict())

    def build(rank: int) -> nn.Module:
        with torch.device("meta"):
            return nn.Sequential(nn.Linear(5, 5), nn.LayerNorm(5), MLP(5))

    def prepare(side: Side) -> None:
        if side.sharded:
            drawn = side.model.full_state_dict()
            assert torch.equal(drawn["1.weight"], torch.ones(5))
            assert torch.equal(drawn["1.bias"], torch.zeros(5))
            assert all(v.isfinite().all() and v.std() > 0 for k, v in drawn.items() if "2." in k)
            with torch.device("meta"):
                broken = nn.Sequential(nn.Linear(5, 5), Unwritten())
            with pytest.raises(ValueError, match="loose"):
                ShardedModule(broken, process_group=side.pg, stage=stage)
            side.model.load_full_state_dict(plain)

    batches = make_batches(3, (8, 5), (8, 5))
    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        prepare=prepare,
        build=build,
        auto_wrap=MLP,
    )


@stages
def test_weights_on_rank_zero_only_are_copied_to_every_rank(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_rank0_broadcast_meta_device_init: only rank 0
    holds the trained weights (the others hold other values); with ``sync_module_states=True``
    every rank starts from rank 0's and the model trains as the plain model, and the default
    wrap copies rank 0's too, as DDP does, warning on every rank with the tensors' names."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))

    def build(rank: int) -> nn.Module:
        if rank == 0:
            return copy.deepcopy(model)
        other = copy.deepcopy(model)
        with torch.no_grad():
            for p in other.parameters():
                p.add_(1.0)
        return other

    def finish(side: Side) -> None:
        if side.sharded:
            # (its warning: tests/api/test_from_ddp.py; ranks as threads share warning filters)
            again = ShardedModule(build(side.rank), process_group=side.pg, stage=stage)
            got = again.full_state_dict()
            torch.testing.assert_close(got, dict(model.state_dict()), atol=0, rtol=0)

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        finish=finish,
        build=build,
        sync_module_states=True,
        auto_wrap=MLP,
    )


def _pairs(pg: ProcessGroup) -> ProcessGroup:
    """Ranks {0, 1} and {2, 3}: each pair shards a model of its own."""
    first = pg.rank() - pg.rank() % 2
    return subgroup(pg, [first, first + 1], "pair")


@stages
def test_process_group_of_a_subset_of_the_ranks(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_1d_process_group_init: 4 ranks, each pair a
    process group of its own that shards and trains one copy on the pair's global batch; each
    copy trains as the plain model."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))
    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        world_size=4,
        group=_pairs,
        auto_wrap=MLP,
    )


@stages
def test_replicas_start_from_the_first_replica(stage: int) -> None:
    """Mirrors test_fully_shard_init.py::test_hsdp_broadcast_across_replicas: hybrid sharding
    over 4 ranks (2 replicas of 2 shards), the second replica built with other values and a
    different buffer; ``sync_module_states=True`` makes every replica rank 0's, and training
    follows the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[Buffered() for _ in range(2)])
    batches = make_batches(3, (8, 7), (8, 7))

    def build(rank: int) -> nn.Module:
        built = copy.deepcopy(model)
        if rank >= 2:
            with torch.no_grad():
                for t in [*built.parameters(), *built.buffers()]:
                    t.fill_(1337.0)
        return built

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        world_size=4,
        group=hybrid_mesh,
        build=build,
        sync_module_states=True,
        auto_wrap=Buffered,
    )


# gradient clipping and operations on gradients -------------------------------------------------


NORMS = {"l2": 2.0, "l1": 1.0, "inf": math.inf}


def _clipping_step(
    norm_type: float, max_norm: float, foreach: bool | None, shapes: dict[str, torch.Size]
) -> Any:
    """A step that clips every gradient (each above ``max_norm``) by the global norm; with
    ``foreach=None`` through ``model.clip_grad_norm_`` on the wrapped model."""

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = 1000 * _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        grads = [p.grad.norm(norm_type).item() for p in side.model.parameters()]
        assert all(g > max_norm for g in grads), "clipping would be vacuous"
        if foreach is None and side.sharded:
            total = side.model.clip_grad_norm_(max_norm, norm_type=norm_type)
        else:
            total = torch.nn.utils.clip_grad_norm_(
                side.model.parameters(), max_norm, norm_type=norm_type, foreach=foreach
            )
        side.note("total norm / 1000 (the loss's scale)", float(total) / 1000)
        for p in side.model.parameters():
            assert float(p.grad.norm(norm_type)) <= max_norm + 1e-6
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss.detach() / 1000

    return step


@stages
@pytest.mark.parametrize("norm", list(NORMS))
def test_clip_grad_norm_over_all_ranks(stage: int, norm: str) -> None:
    """Mirrors test_fully_shard_clip_grad_norm_.py::test_clip_grad_norm_1d: with every gradient
    above the limit, ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)`` (foreach)
    returns the plain model's total norm (orders 2, 1 and inf), leaves every parameter's norm
    at most the limit and the gradients equal to the plain model's clipped ones."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))
    step = _clipping_step(NORMS[norm], 0.5, True, shapes_of(model))
    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
@pytest.mark.parametrize("foreach", [False, None], ids=["per-tensor", "method"])
def test_clip_grad_norm_per_tensor_and_by_the_method(stage: int, foreach: bool | None) -> None:
    """Mirrors test_fully_shard_grad.py::test_clip (``foreach=False``): the per-tensor path of
    ``torch.nn.utils.clip_grad_norm_`` and the wrapped model's own ``clip_grad_norm_`` clip by
    the global norm as on the plain model."""
    model = _model()
    batches = make_batches(3, (8, 5), (8, 5))
    step = _clipping_step(2.0, 0.5, foreach, shapes_of(model))
    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_clip_grad_norm_at_four_ranks(stage: int) -> None:
    """Mirrors test_fully_shard_clip_grad_norm_.py::test_clip_grad_norm_2d (4 ranks, order 3):
    the global norm over four ranks' pieces, some of them empty, equals the plain model's."""
    model = _model(3)
    batches = make_batches(3, (8, 3), (8, 3))
    step = _clipping_step(3.0, 0.5, True, shapes_of(model))
    assert_peer_parity(model, stage=stage, batches=batches, step=step, world_size=4, auto_wrap=MLP)


@stages
def test_in_place_and_foreach_operations_on_gradients(stage: int) -> None:
    """Mirrors test_fully_shard_grad.py::test_component_mutations: ``mul_``, ``div_``,
    ``torch._foreach_mul_`` and ``zero_grad(set_to_none=False)`` on the gradients act on each
    piece without any communication, and the step that follows matches the plain model's."""
    model = _model()
    batches = make_batches(4, (8, 5), (8, 5))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        calls = dict(side.model.comm_stats.calls) if side.sharded else {}
        grads = [p.grad for p in side.model.parameters()]
        for g in grads:
            g.mul_(4).div_(2)
        torch._foreach_mul_(grads, 0.25)
        if side.sharded:
            assert dict(side.model.comm_stats.calls) == calls
        opt.step()
        opt.zero_grad(set_to_none=False)
        assert all(not p.grad.any() for p in side.model.parameters())
        if side.sharded:
            assert dict(side.model.comm_stats.calls) == calls
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_a_state_dict_loaded_one_key_at_a_time(stage: int) -> None:
    """Mirrors test_fully_shard_state_dict.py::test_dp_state_dict_cpu_offload, which loads a
    state dict split into one-key dicts with ``strict=False``: before the first step both sides
    load another model's weights so, each call reporting the keys it lacks as the plain model
    does, and training from them is the plain model's."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(6), MLP(6))
    torch.manual_seed(1)
    other = nn.Sequential(MLP(6), MLP(6)).state_dict()

    def prepare(side: Side) -> None:
        for key, value in other.items():
            result = side.model.load_state_dict({key: value}, strict=False)
            side.notes.append((f"missing after {key}", len(result.missing_keys)))
            assert result.unexpected_keys == []

    own = model.state_dict()
    assert all((other[k] - own[k]).abs().max() > 0.01 for k in other), "nothing to load"
    batches = make_batches(3, (8, 6), (8, 6))
    assert_peer_parity(
        model, stage=stage, batches=batches, step=plain_step(_mse), prepare=prepare, auto_wrap=MLP
    )
