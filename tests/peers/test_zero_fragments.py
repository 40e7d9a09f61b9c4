"""Tensor-fragment, clipping, optimizer and empty-parameter behaviours that DeepSpeed ZeRO's own
suite asserts, ported to shardwrap.

Upstream (``deepspeedai/DeepSpeed``): ``tests/unit/runtime/zero/test_zero_tensor_fragment.py``
(a parameter's full value, gradient and optimizer state, read and written through the ranks'
pieces: ``safe_get_full_*``, ``safe_set_full_*``, ``safe_update_full_grad_vectorized``),
``test_zero_grad_clip.py`` (clipping the local gradients elementwise),
``tests/unit/ops/muon/test_muon.py`` (Muon's update against the full-gradient reference) and
``tests/unit/runtime/half_precision/onebit/test_onebit.py`` and
``tests/unit/runtime/zero/test_zero_numel_param_shape.py`` (empty parameters), and
``tests/unit/runtime/zero/test_zero_allreduce_fetch_params.py`` (padding never read). Each
test names the upstream test it mirrors and trains a plain deep copy of its model on the whole
global batch beside a ``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3,
over several steps (``tests/support/peers.py``): SGD with momentum, parameters equal within
1e-5; AdamW, losses equal within 1e-5; plus what the test reads and writes through the pieces,
equal to the plain model's within 1e-5. 2 ranks unless a test says 4.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2
tests/peers/test_zero_fragments.py`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    adamw,
    assert_peer_parity,
    full_tensor,
    make_batches,
    no_step,
    note_grads,
    piece_range,
    plain_step,
    shapes_of,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
HIDDEN = 10


class Fragmented(nn.Module):
    """DeepSpeed's fragment model: a bottleneck of width 1, so that pieces split tiny
    parameters (a rank may hold none of one); ``frozen``: the first layer frozen."""

    def __init__(self, frozen: bool = False) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(HIDDEN, 1), nn.Linear(1, 1), nn.Linear(1, HIDDEN)])
        if frozen:
            self.linears[0].requires_grad_(False)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        for layer in self.linears:
            x = torch.relu(layer(x)) + 0.1 * x.mean(-1, keepdim=True)
        return F.cross_entropy(x, y)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return model(x, y)


CLASSES = make_batches(4, (8, HIDDEN), None)


def _state_of(side: Side, opt: torch.optim.Optimizer, shapes: dict[str, torch.Size]) -> dict:
    """Every parameter's full Adam moments (``None`` for a parameter with no state)."""
    out: dict[str, Any] = {}
    for name, param in side.model.named_parameters():
        state = opt.state.get(param, {})
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{name}.{key}"] = full_tensor(side, state.get(key), shapes[name])
    return out


@stages
@pytest.mark.parametrize("frozen", [False, True], ids=["trainable", "first-frozen"])
def test_full_values_gradients_and_optimizer_state_read_from_pieces(
    stage: int, frozen: bool
) -> None:
    """Mirrors test_zero_tensor_fragment.py::TestTensorFragmentGet::test_zero_fragments: after
    each backward every parameter's full value and gradient, and after each step its full Adam
    moments, read from the ranks' pieces, equal the plain model's; a frozen parameter has no
    gradient and no optimizer state."""
    torch.manual_seed(0)
    model = Fragmented(frozen)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        values = {n: full_tensor(side, p, shapes[n]) for n, p in side.model.named_parameters()}
        side.note("values", values)
        note_grads(side, shapes)
        opt.step()
        side.note("optimizer state", _state_of(side, opt, shapes))
        opt.zero_grad()
        return loss

    assert_peer_parity(
        model, stage=stage, batches=CLASSES, step=step, make_optimizer=adamw, auto_wrap=nn.Linear
    )


def _random_like(shape: torch.Size, seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) / 4


def _write_pieces(side: Side, tensor: Tensor | None, full: Tensor) -> None:
    """Write this rank's part of ``full`` into ``tensor`` (a piece, or the whole tensor on the
    reference), as ``safe_set_full_*`` does."""
    start, stop = piece_range(side, full if tensor is None else tensor)
    if tensor is not None:
        with torch.no_grad():
            tensor.copy_(full.reshape(-1)[start:stop].view_as(tensor))


@stages
def test_full_values_gradients_and_optimizer_state_written_through_pieces(stage: int) -> None:
    """Mirrors test_zero_tensor_fragment.py::TestTensorFragmentSet::test_zero_fragments: after
    backward, new full values and gradients, and after the step new full Adam moments, each
    rank writing its part; read back whole they are what was written, and the training that
    follows matches the plain model given the same values."""
    torch.manual_seed(0)
    model = Fragmented()
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        seed = 100 * side.step_index
        for i, (name, p) in enumerate(side.model.named_parameters()):
            _write_pieces(side, p, 1 + _random_like(shapes[name], seed + i))
            _write_pieces(side, p.grad, _random_like(shapes[name], seed + 50 + i))
        side.note(
            "values", {n: full_tensor(side, p, shapes[n]) for n, p in side.model.named_parameters()}
        )
        note_grads(side, shapes)
        opt.step()
        for i, (name, p) in enumerate(side.model.named_parameters()):
            state = opt.state[p]
            _write_pieces(side, state["exp_avg"], _random_like(shapes[name], seed + 70 + i))
            moment = _random_like(shapes[name], seed + 90 + i).abs()
            _write_pieces(side, state["exp_avg_sq"], moment)
        side.note("optimizer state", _state_of(side, opt, shapes))
        opt.zero_grad()
        return loss

    assert_peer_parity(
        model, stage=stage, batches=CLASSES, step=step, make_optimizer=adamw, auto_wrap=nn.Linear
    )


@stages
def test_gradients_updated_in_place_through_pieces(stage: int) -> None:
    """Mirrors test_zero_tensor_fragment.py::TestTensorFragmentUpdate::test_zero_fragments
    (``safe_update_full_grad_vectorized``): after backward a full tensor is added to every
    gradient, each rank adding its part; the updated gradients and the step match the plain
    model's."""
    torch.manual_seed(0)
    model = Fragmented()
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        for i, (name, p) in enumerate(side.model.named_parameters()):
            full = _random_like(shapes[name], 10 * side.step_index + i)
            start, stop = piece_range(side, p.grad)
            with torch.no_grad():
                p.grad.add_(full.reshape(-1)[start:stop].view_as(p.grad))
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=CLASSES, step=step, auto_wrap=nn.Linear)


@stages
def test_local_gradients_clamped_elementwise(stage: int) -> None:
    """Mirrors test_zero_grad_clip.py::TestZeroGradClip::test_grad_clip_and_norm_update: each
    rank clamps its local gradients to [-c, c] (DeepSpeed's ``safe_get_local_grad`` /
    ``safe_set_local_grad``); the global norm after is below the one before, and the step
    matches the plain model clamping its whole gradients."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN))
    shapes = shapes_of(model)
    batches = make_batches(3, (8, HIDDEN), (8, HIDDEN))
    clip = 0.05

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = F.mse_loss(side.model(side.local(batch[0])), side.local(batch[1]))
        loss.backward()
        params = list(side.model.parameters())
        before = torch.nn.utils.get_total_norm([p.grad for p in params])
        for p in params:
            with torch.no_grad():
                p.grad.copy_(torch.clamp(p.grad, -clip, clip))
        after = torch.nn.utils.get_total_norm([p.grad for p in params])
        assert float(after) < float(before)
        side.note("norms before and after", [float(before), float(after)])
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=nn.Linear)


class Both:
    """Muon for the matrices, AdamW for the rest, stepped as one optimizer."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        params = list(params)
        self.optimizers = [
            torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
        ]

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


class MuonBlock(nn.Module):
    """A pre-norm residual MLP block: two matrices for Muon, a norm and biases for AdamW."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 3 * width)
        self.down = nn.Linear(3 * width, width)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


@stages
def test_muon_at_four_ranks_matches_the_plain_model(stage: int) -> None:
    """Mirrors test_muon.py::TestMuonZero12NumericalCorrectness::
    test_update_matches_full_gradient_reference, at 4 ranks: Muon stepping the matrices (AdamW
    the rest) of the wrapped model, each rank its slice, trains as on the plain model given the
    whole batch's gradient: the losses match.

    The plain model takes the whole batch's gradient as the sum of its four slices' (in rank
    order), the same gradient as one pass over the batch but for the last bits of a float32
    sum; Muon's bfloat16 Newton-Schulz iteration turns those bits into 2e-4 after four steps
    (docs/optimizers.md), so a one-pass reference would measure the summation order, not
    shardwrap."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), MuonBlock(), MuonBlock(), nn.Linear(32, 32))
    batches = make_batches(4, (8, 32), (8, 32), seed=1)
    world = 4

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = batch
        slices = (
            [(side.local(x), side.local(y))]
            if side.sharded
            else zip(x.chunk(world), y.chunk(world))
        )
        total = torch.zeros(())
        for xs, ys in slices:
            loss = F.mse_loss(side.model(xs), ys) / (1 if side.sharded else world)
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=step,
        world_size=world,
        make_optimizer=Both,
        auto_wrap=MuonBlock,
    )


class OddSizes(nn.Module):
    """Parameters of 5 and 7 elements scaling a linear layer's outputs: at 2 ranks every flat
    group ends in padding."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 12)
        self.five = nn.Parameter(torch.arange(1.0, 6.0) / 5)
        self.seven = nn.Parameter(torch.arange(1.0, 8.0) / 7)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x) * torch.cat([self.five, self.seven])


class TwoOddSizes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = OddSizes()
        self.b = OddSizes()

    def forward(self, x: Tensor) -> Tensor:
        return self.a(x) + self.b(x)


def _garbage(make: Any) -> Any:
    """``make`` (``torch.empty`` and kin), its tensors filled with NaN (integers: 77)."""

    def made(*args: Any, **kwargs: Any) -> Tensor:
        t = make(*args, **kwargs)
        if t.device.type != "meta" and t.numel() and t.dtype != torch.bool:
            t.fill_(float("nan") if t.is_floating_point() else 77)
        return t

    return made


@stages
@pytest.mark.parametrize("bucket_mb", [0, 25], ids=["bucket_mb=0", "bucket_mb=25"])
def test_padding_that_starts_as_garbage_never_reaches_values_or_gradients(
    stage: int, bucket_mb: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mirrors test_zero_allreduce_fetch_params.py: parameters of odd sizes, padded at 2 ranks,
    gather back exactly whatever uninitialised memory holds: every ``torch.empty``,
    ``empty_like``, ``empty_strided`` and ``Tensor.new_empty`` made while wrapping and training
    is NaN. The whole values after wrapping (inside ``gathered()``), the gradients, the clipped
    norm and every step are the plain model's."""
    torch.manual_seed(0)
    model = TwoOddSizes()
    shapes = shapes_of(model)
    for name in ("empty", "empty_like", "empty_strided"):
        monkeypatch.setattr(torch, name, _garbage(getattr(torch, name)))
    monkeypatch.setattr(Tensor, "new_empty", _garbage(Tensor.new_empty))

    def whole(m: nn.Module) -> dict[str, Tensor]:
        """Every parameter read as its module's attribute."""
        split = [k.rpartition(".") for k in shapes]
        return {f"{a}.{k}": getattr(m.get_submodule(a), k).detach().clone() for a, _, k in split}

    def prepare(side: Side) -> None:
        if side.sharded:
            with side.model.gathered():
                side.note("whole values", whole(side.model))
        else:
            side.note("whole values", whole(side.model))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = F.mse_loss(side.model(side.local(batch[0])), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        if side.sharded:
            norm = side.model.clip_grad_norm_(0.5)
        else:
            norm = torch.nn.utils.clip_grad_norm_(side.model.parameters(), 0.5)
        side.note("norm", norm)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        model,
        stage=stage,
        batches=make_batches(3, (8, 3), (8, 12), seed=4),
        step=step,
        prepare=prepare,
        auto_wrap=OddSizes,
        bucket_mb=bucket_mb,
    )


class WithEmpty(nn.Module):
    """A linear layer beside an empty (0 x 10) parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.empty_param = nn.Parameter(torch.empty(0, HIDDEN))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        extra = self.empty_param.sum()  # zero, and an (empty) gradient for it
        return F.cross_entropy(self.linear(x), y) + extra


@stages
def test_empty_parameter_beside_others(stage: int) -> None:
    """Mirrors test_onebit.py::TestOneBitLambEmptyParameters::test: a parameter with no elements
    beside a linear layer in one unit, in a parameter group of its own; it stays empty and
    everything else trains as on the plain model."""
    torch.manual_seed(0)
    optimizers: dict[int, torch.optim.Optimizer] = {}

    def prepare(side: Side) -> None:
        m = side.model
        groups = [
            {"params": [m.linear.weight, m.linear.bias], "weight_decay": 0.01},
            {"params": [m.empty_param], "weight_decay": 0.0},
        ]
        optimizers[id(side)] = torch.optim.SGD(groups, lr=0.05, momentum=0.9)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        optimizers[id(side)].step()
        optimizers[id(side)].zero_grad()
        assert side.model.empty_param.numel() == 0
        return loss

    assert_peer_parity(
        WithEmpty(),
        stage=stage,
        batches=CLASSES,
        step=step,
        prepare=prepare,
        make_optimizer=no_step,
        compare_parameters=True,
    )


class EmptyTail(nn.Module):
    """A linear layer, then one of no outputs: a (0, 8) weight used in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(8, 8, bias=False)
        self.empty = nn.Linear(8, 0, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.dense(x)
        return h.square().mean() + self.empty(h).sum()


@stages
def test_a_zero_element_weight_keeps_its_shape_through_steps_and_checkpoints(
    stage: int, tmp_path: Path
) -> None:
    """Mirrors test_zero_numel_param_shape.py (the shape survives wrapping and a step, a second
    step runs; ``TestZeroNumelParameterCheckpoint``): a (0, 8) weight used in forward, its own
    unit: Adam steps the model as the plain one, every full state dict names the weight
    (0, 8), and a checkpoint of the trained model loads into a fresh wrap that computes what
    the trained one does."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Initializing zero-element tensors is a no-op")
        torch.manual_seed(0)
        model = EmptyTail()
    batches = make_batches(3, (4, 8), None)
    probe = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = side.model(side.local(batch[0]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        state = side.model.full_state_dict() if side.sharded else side.model.state_dict()
        side.note("shapes", {k: tuple(v.shape) for k, v in state.items()})
        return loss

    def finish(side: Side) -> None:
        if not side.sharded:
            return
        save_checkpoint(tmp_path / f"stage{stage}", side.model)
        fresh = ShardedModule(
            copy.deepcopy(model), process_group=side.pg, auto_wrap=nn.Linear, stage=stage
        )
        load_checkpoint(tmp_path / f"stage{stage}", fresh)
        assert {k: tuple(v.shape) for k, v in fresh.full_state_dict().items()} == {
            "dense.weight": (8, 8),
            "empty.weight": (0, 8),
        }
        with torch.no_grad():
            x = side.local(probe)
            torch.testing.assert_close(fresh(x), side.model(x), atol=0, rtol=0)

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=step,
        finish=finish,
        make_optimizer=adamw,
        auto_wrap=nn.Linear,
    )


class EmptyUnit(nn.Module):
    """A unit all of whose parameters have zero elements (``nn.Linear(h, 0)``)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(HIDDEN, HIDDEN)
        self.nothing = nn.Linear(HIDDEN, 0)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        h = self.body(x)
        return F.cross_entropy(h, y) + self.nothing(h).sum()


@stages
@pytest.mark.filterwarnings("ignore:Initializing zero-element tensors is a no-op")
def test_unit_whose_parameters_are_all_empty(stage: int) -> None:
    """Mirrors test_onebit.py::TestOneBitLambEmptyParameters::test, an empty parameter as a unit
    of its own: ``nn.Linear(h, 0)`` as a unit (both its parameters empty) runs, backward gives
    its empty parameters empty gradients, and the model trains as the plain one."""
    torch.manual_seed(0)
    assert_peer_parity(
        EmptyUnit(),
        stage=stage,
        batches=CLASSES,
        step=plain_step(_loss),
        auto_wrap=nn.Linear,
    )
