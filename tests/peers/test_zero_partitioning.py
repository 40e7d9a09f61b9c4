"""Partitioning, optimizer-state and fragment behaviours that DeepSpeed ZeRO's own suite asserts,
ported to shardwrap.

Upstream (``deepspeedai/DeepSpeed``): ``tests/unit/v1/zero/test_zero.py`` (gradient averaging,
partitioned parameters and the structures a model returns, large and many parameters, frozen
weights, optimizer step counts, empty parameter groups, train/eval switches, a module run in a
loop, parameters toggled between steps), ``tests/unit/runtime/zero/test_zero_tensor_fragment.py``
(a parameter's full value, gradient and optimizer state read and written through its pieces),
``test_zero_grad_clip.py`` (elementwise clipping of the local gradients),
``test_zero_adagrad.py`` (Adagrad's parameter groups),
``tests/unit/ops/muon/test_muon.py`` and ``tests/unit/runtime/half_precision/onebit/
test_onebit.py`` (empty parameters). Each test names the upstream test it mirrors and trains a
plain deep copy of its model on the whole global batch beside a ``ShardedModule`` copy on each
rank (its slice), at stages 1, 2 and 3, over several steps (``tests/support/peers.py``): SGD
with momentum, parameters equal within 1e-5; AdamW, losses equal within 1e-5; plus each
behaviour's own reads, equal to the plain model's within 1e-5. 2 ranks unless a test says 4.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2
tests/peers/test_zero_partitioning.py`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

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


class Simple(nn.Module):
    """DeepSpeed's ``SimpleModel``: linear layers, each mixed with its neighbour's output, and a
    cross-entropy loss on class ids."""

    def __init__(self, hidden: int = HIDDEN, layers: int = 1) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(hidden, hidden) for _ in range(layers))

    def forward(self, x: Tensor, y: Tensor) -> Tensor:  # x: (B, hidden), y: (B,) class ids
        if len(self.linears) == 1:
            x = self.linears[0](x)
        else:
            for i, layer in enumerate(self.linears):
                x = self.linears[i // 2](x) + layer(x)
        return F.cross_entropy(x, y)


def _simple_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return model(x, y)


CLASSES = make_batches(4, (8, HIDDEN), None)


@stages
def test_gradients_are_averaged_over_ranks_not_summed(stage: int) -> None:
    """Mirrors test_zero.py::TestGradientAllreduceOp::test (``gradient_allreduce_op="mean"``):
    every rank given the same samples gets the gradient one process gets on them, not the sum
    over the ranks."""
    torch.manual_seed(0)
    model = Simple(layers=2)
    shapes = shapes_of(model)
    same = [(torch.cat([x[:4], x[:4]]), torch.cat([y[:4], y[:4]])) for x, y in CLASSES]

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _simple_loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=same, step=step, auto_wrap=nn.Linear)


class Eltwise(nn.Module):
    """``weight * x``: one partitioned parameter; checks, while it runs, that it sees the whole
    parameter."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: Tensor) -> Tensor:
        assert self.weight.shape == x.shape[1:], "the unit runs on a piece of its weight"
        return self.weight * x


class PairNT(NamedTuple):
    hidden1: Tensor
    hidden2: Tensor
    y_hat: Tensor
    loss: Tensor


PairTuple = collections.namedtuple("PairTuple", ["hidden1", "hidden2", "y_hat", "loss"])


class EltwiseNetwork(nn.Module):
    """Three elementwise units; returns its hidden activations and loss in a ``kind`` of
    structure."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(Eltwise(nn.Parameter(torch.randn(3, 5))) for _ in range(3))

    def forward(self, x: Tensor, y: Tensor) -> Any:
        hidden1 = self.layers[0](x)
        hidden2 = self.layers[1](hidden1)
        y_hat = self.layers[2](hidden2)
        loss = F.l1_loss(y_hat, y)
        values = {"hidden1": hidden1, "hidden2": hidden2, "y_hat": y_hat, "loss": loss}
        if self.kind == "dict":
            return values
        if self.kind == "NamedTuple":
            return PairNT(**values)
        if self.kind == "namedtuple":
            return PairTuple(**values)
        as_tuple = tuple(values.values())
        return list(as_tuple) if self.kind == "list" else as_tuple


def _as_dict(kind: str, out: Any) -> dict[str, Tensor]:
    if kind == "dict":
        return out
    if kind in ("NamedTuple", "namedtuple"):
        return out._asdict()
    return dict(zip(["hidden1", "hidden2", "y_hat", "loss"], out))


@stages
@pytest.mark.parametrize("kind", ["dict", "NamedTuple", "namedtuple", "tuple", "list"])
def test_partitioned_units_return_structures_of_activations(stage: int, kind: str) -> None:
    """Mirrors test_zero.py::TestZero3ParamPartitioningBase::test_model_class: units whose whole
    weight is only there while they run, in a model returning its hidden activations and its
    loss in a dict, a NamedTuple, a namedtuple, a tuple or a list; the loss adds the reused
    activations, and the activations equal the plain model's."""
    torch.manual_seed(0)
    model = EltwiseNetwork(kind)
    batches = make_batches(3, (8, 3, 5), (8, 3, 5))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x = side.local(batch[0])
        out = _as_dict(kind, side.model(x, side.local(batch[1])))
        loss = out["loss"] + 0.1 * (out["hidden1"].mean() + out["hidden2"].pow(2).mean())
        loss.backward()
        for key in ("hidden1", "y_hat"):
            side.note(key, full_tensor(side, out[key], torch.Size([8, 3, 5])))
        if side.sharded:
            for layer in side.model.layers:
                assert layer.weight.numel() <= math.ceil(45 / 2)  # a piece outside forward
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=Eltwise)


class LargeParam(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.param = nn.Parameter(torch.randn(size))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.param


@stages
def test_large_parameter_split_over_ranks_and_gradients_accumulating(stage: int) -> None:
    """Mirrors test_zero.py::TestZero3ParamPartitioningLargeParam::test: one 8101-element
    parameter, each rank holding its contiguous range; forward sees all of it, and without
    ``zero_grad`` its gradient after the k-th backward is k times one backward's, as in plain
    PyTorch."""
    size = 8101
    torch.manual_seed(0)
    model = LargeParam(size)
    ones = torch.ones(4, size)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        out = side.model(side.local(ones))
        side.note("activation", full_tensor(side, out, ones.shape))
        loss = out.mean()
        loss.backward()
        start, stop = piece_range(side, side.model.param)
        if side.sharded:
            assert (start, stop) == ((0, 4051) if side.rank == 0 else (4051, size))
        side.note("gradient", full_tensor(side, side.model.param.grad, torch.Size([size])))
        return loss

    assert_peer_parity(
        model,
        stage=stage,
        batches=[(ones, ones)] * 3,
        step=step,
        make_optimizer=no_step,
        trains=False,
        compare_parameters=True,
    )


class ManyParams(nn.Module):
    """Many small units in a row, returning every activation."""

    def __init__(self, size: int = 13, layers: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            Eltwise(nn.Parameter(1 + torch.randn(size) / 10)) for _ in range(layers)
        )

    def forward(self, x: Tensor) -> list[Tensor]:
        activations = []
        for layer in self.layers:
            x = layer(x)
            activations.append(x)
        return activations


@stages
def test_many_small_units_return_all_activations(stage: int) -> None:
    """Mirrors test_zero.py::TestZero3ParamPartitioningManyParams::test: 24 small units in a row,
    the model returning the list of every activation; all of them, and the training, match the
    plain model."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, 13), (8, 13))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        activations = side.model(side.local(batch[0]))
        assert len(activations) == 24
        side.note("activations", full_tensor(side, torch.stack(activations, 1), (8, 24, 13)))
        loss = F.mse_loss(activations[-1], side.local(batch[1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(ManyParams(), stage=stage, batches=batches, step=step, auto_wrap=Eltwise)


class ParentInitialises(nn.Module):
    """A parent whose ``__init__`` sets its children's weights (``self.apply``)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(12, 1)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.copy_(torch.linspace(-1, 1, 12))


@stages
def test_weights_a_parent_initialised_are_what_the_pieces_hold(stage: int) -> None:
    """Mirrors test_zero.py::TestZero3InitForParentWeightInitialization::test: weights the
    parent set in its ``__init__`` are exactly what the ranks' pieces hold (each its range of
    the 12 elements), and the model trains from them as the plain model."""
    torch.manual_seed(0)
    model = ParentInitialises()

    def prepare(side: Side) -> None:
        weight = side.model.linear.weight
        if side.sharded:
            assert 0 < weight.numel() < 12  # split over the ranks
            start, stop = piece_range(side, weight)
            assert torch.equal(weight.reshape(-1), torch.linspace(-1, 1, 12)[start:stop])

    batches = make_batches(3, (8, 12), (8, 1))
    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(lambda m, x, y: F.mse_loss(m.linear(x), y)),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


class FrozenSecond(nn.Module):
    """DeepSpeed's frozen-weights model: ``l2`` frozen, returns ``(x, loss)``."""

    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(HIDDEN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)
        self.l2.requires_grad_(False)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        x = self.l2(torch.relu(self.l1(x)))
        return x, F.cross_entropy(x, y)


@stages
def test_frozen_layer_in_a_model_returning_output_and_loss(stage: int) -> None:
    """Mirrors test_zero.py::TestZeroFrozenWeights::test: a frozen second layer in a model that
    returns ``(output, loss)``: the frozen layer never changes, the first trains as on the plain
    model."""
    torch.manual_seed(0)
    model = FrozenSecond()
    _, runs = assert_peer_parity(
        model,
        stage=stage,
        batches=CLASSES,
        step=plain_step(lambda m, x, y: m(x, y)[1]),
        auto_wrap=nn.Linear,
    )
    for run in runs:
        assert torch.equal(run.state["l2.weight"], model.l2.weight)


class ReturnsStructure(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.l1 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor, y: Tensor) -> Any:
        x = self.l1(x)
        loss = F.cross_entropy(x, y)
        if self.kind == "dict":
            return {"a": x, "loss": loss, "b": 1, "c": None}
        return [x, loss] if self.kind == "list" else (x, loss)


@stages
@pytest.mark.parametrize("kind", ["tuple", "list", "dict"])
def test_model_returning_a_structure_with_non_tensors(stage: int, kind: str) -> None:
    """Mirrors test_zero.py::TestZero3DictFwd::test: the model returns a tuple, a list or a dict
    that also holds an int and ``None``; the loss taken from it trains as on the plain model and
    the non-tensor entries come back as they are."""
    torch.manual_seed(0)

    def loss_fn(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = model(x, y)
        if kind == "dict":
            assert out["b"] == 1 and out["c"] is None
            return out["loss"]
        return out[1]

    assert_peer_parity(
        ReturnsStructure(kind),
        stage=stage,
        batches=CLASSES,
        step=plain_step(loss_fn),
        make_optimizer=adamw,
    )


@stages
def test_every_parameter_has_the_same_optimizer_step_count(stage: int) -> None:
    """Mirrors test_zero.py::TestZeroAdamOptimizerStepCount::test: after each step every
    parameter's Adam state counts the same number of steps, on every rank, empty pieces
    included (12 small layers: some ranks hold none of a parameter)."""
    torch.manual_seed(0)
    model = Simple(hidden=4, layers=12)
    batches = make_batches(4, (8, 4), None)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _simple_loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        counts = {
            name: int(opt.state[p]["step"]) if p in opt.state else 0
            for name, p in side.model.named_parameters()
        }
        side.note("step counts", counts)
        return loss

    assert_peer_parity(
        model, stage=stage, batches=batches, step=step, make_optimizer=adamw, auto_wrap=nn.Linear
    )


@stages
@pytest.mark.parametrize("empty", ["weights", "biases"])
def test_optimizer_with_an_empty_parameter_group(stage: int, empty: str) -> None:
    """Mirrors test_zero.py::TestEmptyParameterGroup::test_empty_param_groups: an AdamW with two
    parameter groups chosen by name (weight decay on the weights, none on the biases), one of
    them empty; it steps the shard parameters as it steps the plain ones."""
    torch.manual_seed(0)
    model = Simple(hidden=6, layers=4)

    optimizers: dict[int, torch.optim.Optimizer] = {}

    def prepare(side: Side) -> None:
        named = dict(side.model.named_parameters())
        weights = [p for n, p in named.items() if n.endswith("weight")]
        biases = [p for n, p in named.items() if n.endswith("bias")]
        groups = [
            {"params": [] if empty == "weights" else weights, "weight_decay": 0.01},
            {"params": biases if empty == "weights" else [], "weight_decay": 0.0},
        ]
        optimizers[id(side)] = torch.optim.AdamW(groups, lr=0.01)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        mine = optimizers[id(side)]
        loss = _simple_loss(side.model, side.local(batch[0][:, :6]), side.local(batch[1] % 6))
        loss.backward()
        mine.step()
        mine.zero_grad()
        return loss

    assert_peer_parity(
        model,
        stage=stage,
        batches=CLASSES,
        step=step,
        prepare=prepare,
        make_optimizer=no_step,
        auto_wrap=nn.Linear,
    )


@stages
def test_adagrad_with_parameter_groups_of_their_own_settings(stage: int) -> None:
    """Mirrors test_zero_adagrad.py::TestZeroAdagradParamGroups::
    test_groups_and_updates_match_torch: a torch Adagrad over two groups chosen by name, each
    with its own ``lr``, ``eps`` and ``initial_accumulator_value`` (the state it starts from)
    and a key of the caller's own (``name``): the groups keep every setting, and the steps
    move the shard parameters as they move the plain ones (each parameter's full value after
    every step)."""
    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    shapes = shapes_of(model)
    batches = make_batches(3, (4, 4), None)
    settings = [
        {"name": "weight", "lr": 0.03, "eps": 1e-8, "initial_accumulator_value": 0.1},
        {"name": "bias", "lr": 0.12, "eps": 1e-5, "initial_accumulator_value": 0.2},
    ]
    optimizers: dict[int, torch.optim.Optimizer] = {}

    def prepare(side: Side) -> None:
        named = dict(side.model.named_parameters())
        groups = [
            {**group, "params": [p for n, p in named.items() if n.endswith(group["name"])]}
            for group in settings
        ]
        optimizers[id(side)] = torch.optim.Adagrad(groups)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        mine = optimizers[id(side)]
        loss = side.model(side.local(batch[0])).square().mean()
        loss.backward()
        mine.step()
        mine.zero_grad()
        kept = [{k: v for k, v in g.items() if k != "params"} for g in mine.param_groups]
        assert [{k: g[k] for k in settings[0]} for g in kept] == settings
        side.note("groups", kept)
        named = dict(side.model.named_parameters())
        for name, shape in shapes.items():
            side.note(name, full_tensor(side, named[name], shape))
        return loss

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=step,
        prepare=prepare,
        make_optimizer=no_step,
        auto_wrap=nn.Linear,
    )


@stages
def test_training_and_evaluation_alternate(stage: int) -> None:
    """Mirrors test_zero.py::TestZero3SwitchModes::test: epochs of training steps alternate with
    ``eval()`` passes under ``torch.no_grad()``; evaluation losses and training match the plain
    model."""
    torch.manual_seed(0)
    model = Simple(layers=2)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        side.model.train()
        loss = _simple_loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        opt.step()
        opt.zero_grad()
        side.model.eval()
        with torch.no_grad():
            for x, y in CLASSES[:2]:
                side.note("eval loss", side.mean(side.model(side.local(x), side.local(y))))
        return loss

    assert_peer_parity(model, stage=stage, batches=CLASSES, step=step, auto_wrap=nn.Linear)


class AlbertLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        hidden = x
        for _ in range(3):  # one layer run three times: a stack of forwards, then of backwards
            hidden = hidden + self.linear(hidden)
        return F.cross_entropy(hidden, y)


@stages
def test_one_unit_run_in_a_loop(stage: int) -> None:
    """Mirrors test_zero.py::TestZero3RepeatForwardLoop::test: one unit run three times in a
    loop within a forward (ALBERT-style weight sharing), its three backwards adding up."""
    torch.manual_seed(0)
    assert_peer_parity(
        AlbertLike(),
        stage=stage,
        batches=CLASSES,
        step=plain_step(_simple_loss),
        auto_wrap=nn.Linear,
    )


@stages
def test_parameters_toggled_trainable_between_steps(stage: int) -> None:
    """Mirrors test_zero.py::TestZeroUnbalancedGradients::test: before each step every other
    parameter is frozen (the other half the next step), and all are unfrozen after it; each
    step trains exactly the parameters that required a gradient, as in plain PyTorch."""
    torch.manual_seed(0)
    model = Simple(layers=2)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        odd = (side.step_index + 1) % 2
        for i, p in enumerate(side.model.parameters()):
            p.requires_grad_(i % 2 == odd)
        loss = _simple_loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        for p in side.model.parameters():
            p.requires_grad_(True)
        return loss

    assert_peer_parity(model, stage=stage, batches=CLASSES, step=step, auto_wrap=nn.Linear)
