"""Mixed-precision and loss-scaling behaviours that PyTorch FSDP2's own suite asserts, ported
to shardwrap.

Upstream: ``test/distributed/_composable/fsdp/test_fully_shard_mixed_precision.py`` (compute
and reduce dtypes, accumulation in the reduce dtype, structured activations, casts of a unit's
inputs, recomputation, norms, non-floating parameters), ``test_fully_shard_grad_scaler.py`` and
``test_fully_shard_compose.py`` (composable ``checkpoint`` inside a unit).
Each test names the upstream test it mirrors. The reference is the plain model in the textbook
mixed-precision recipe, on the whole global batch: float32 master weights, a working copy in
the compute dtype that runs forward and backward on each rank's slice of the batch (its inputs
cast as the wrapper casts them), gradients summed in the reduce dtype, averaged and stepped in
float32; a ``ShardedModule`` copy on each rank (its slice) must follow it at stages 1, 2 and 3
over several steps (SGD with momentum: parameters within 1e-5; plus each behaviour's own reads
and the dtypes it sees). 2 ranks.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp_precision.py
-q -n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed._composable import checkpoint as composable_checkpoint
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from shardwrap import MixedPrecision, ShardedGradScaler
from tests.support.parity import fp32_grads
from tests.support.peer_models import MLP
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    Step,
    assert_peer_parity,
    make_batches,
    note_grads,
    piece_range,
    shapes_of,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
WORLD = 2
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
BATCHES = make_batches(4, (8, 12), (8, 12))
DIM = 12

# Forward and loss of one side: (model, inputs, targets, cast) -> loss. ``cast`` is the dtype
# the reference's working copy computes in (the wrapper casts the sharded side's inputs), or
# None on the sharded side.
Forward = Callable[[nn.Module, Tensor, Tensor, "torch.dtype | None"], Tensor]


def _cast_inputs(tree: Any, dtype: torch.dtype | None) -> Any:
    """What the wrapper does to a unit's inputs: floating tensors to ``dtype``, dataclass
    fields included."""
    if dtype is None:
        return tree
    if dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        fields = {
            f.name: _cast_inputs(getattr(tree, f.name), dtype) for f in dataclasses.fields(tree)
        }
        return type(tree)(**fields)
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return type(tree)(_cast_inputs(t, dtype) for t in tree)
    if isinstance(tree, dict):
        return {k: _cast_inputs(v, dtype) for k, v in tree.items()}
    return tree_map_only(Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, tree)


def recipe_step(
    forward: Forward,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    check: Callable[[Side], None] | None = None,
) -> Step:
    """One step: the wrapped model as it is on a rank; the reference by the recipe (a working
    copy in ``param_dtype`` per rank slice, gradients summed in ``reduce_dtype`` over the
    slices, averaged, stepped on the float32 masters). ``check(side)`` runs after backward."""
    working: dict[int, nn.Module] = {}

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = batch
        if side.sharded:
            loss = forward(side.model, side.local(x), side.local(y), None).float()
            loss.backward()
        else:
            work = working.setdefault(id(side), copy.deepcopy(side.model).to(param_dtype))
            masters = list(side.model.parameters())
            sums: list[Tensor | None] = [None] * len(masters)
            loss = torch.zeros(())
            for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD)):
                with torch.no_grad():
                    for w, m in zip(work.parameters(), masters):
                        w.copy_(m)
                part = forward(work, xs, ys, param_dtype).float()
                part.backward()
                loss = loss + part.detach() / WORLD
                for i, w in enumerate(work.parameters()):
                    if w.grad is not None:
                        g = w.grad.to(reduce_dtype)
                        sums[i] = g if sums[i] is None else sums[i] + g
                        w.grad = None
            for m, s in zip(masters, sums):
                m.grad = None if s is None else (s / WORLD).to(m.dtype)
        if check is not None:
            check(side)
        opt.step()
        opt.zero_grad()
        return loss

    return step


class Casting(nn.Module):
    """Runs ``inner`` on its input cast to the dtype its first parameter computes in (the plain
    recipe's working copy needs it; on the wrapped model the wrapper has cast it already)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x.to(next(self.inner.parameters()).dtype))


def _mse(model: nn.Module, x: Tensor, y: Tensor, cast: torch.dtype | None) -> Tensor:
    return F.mse_loss(model(x).float(), y)


def _mlps() -> nn.Module:
    torch.manual_seed(0)
    return Casting(nn.Sequential(MLP(DIM, 2), MLP(DIM, 2), MLP(DIM, 2)))


# compute and reduce dtypes ----------------------------------------------------------------------

DTYPES = {
    "bf16-compute-fp32-reduce": (torch.bfloat16, torch.float32),
    "bf16-compute-bf16-reduce": (torch.bfloat16, None),
    "fp16-compute-fp16-reduce": (torch.float16, None),
    "fp32-compute-bf16-reduce": (None, torch.bfloat16),
}


@stages
@pytest.mark.parametrize("dtypes", list(DTYPES))
def test_compute_and_reduce_dtypes_follow_the_recipe(stage: int, dtypes: str) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_compute_dtype and
    ::test_reduce_dtype: forward and backward in the compute dtype (bf16 or fp16), gradients
    reduced in the reduce dtype (``None``: the compute dtype), float32 shards and optimizer; the
    parameters follow the plain recipe step for step."""
    param_dtype, reduce_dtype = DTYPES[dtypes]
    precision = MixedPrecision(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    compute = param_dtype or torch.float32

    def check(side: Side) -> None:
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in side.model.parameters())

    step = recipe_step(_mse, compute, reduce_dtype or compute, check)
    assert_peer_parity(
        _mlps(), stage=stage, batches=BATCHES, step=step, auto_wrap=MLP, mixed_precision=precision
    )


@stages
def test_no_sync_accumulates_in_the_reduce_dtype(stage: int) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_grad_acc_with_reduce_dtype: bf16
    compute with float32 reduction, micro-batches under ``no_sync()`` then a synced one; the
    unreduced gradients accumulate in float32, as the recipe adding each micro-batch's bf16
    gradient into float32 sums."""
    micro = 2
    working: dict[int, nn.Module] = {}

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        parts = list(zip(side.micro(batch[0], micro), side.micro(batch[1], micro)))
        total = torch.zeros(())
        if side.sharded:
            for i, (x, y) in enumerate(parts):
                loss = F.mse_loss(side.model(x).float(), y) / micro
                if i < micro - 1:
                    with side.model.no_sync():
                        loss.backward()
                else:
                    loss.backward()
                total = total + loss.detach()
        else:
            work = working.setdefault(id(side), copy.deepcopy(side.model).to(torch.bfloat16))
            masters = list(side.model.parameters())
            with torch.no_grad():
                for w, m in zip(work.parameters(), masters):
                    w.copy_(m)
            sums = [torch.zeros_like(m) for m in masters]
            for x, y in parts:  # each micro-batch, each rank's slice of it
                for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD)):
                    loss = F.mse_loss(work(xs).float(), ys) / micro
                    loss.backward()
                    total = total + loss.detach() / WORLD
                    for acc, w in zip(sums, work.parameters()):
                        acc.add_(w.grad.float())
                        w.grad = None
            for m, acc in zip(masters, sums):
                m.grad = acc / WORLD
        opt.step()
        opt.zero_grad()
        return total

    batches = make_batches(3, (8, DIM), (8, DIM))
    assert_peer_parity(
        _mlps(), stage=stage, batches=batches, step=step, auto_wrap=MLP, mixed_precision=BF16
    )


# structured activations and inputs --------------------------------------------------------------


@dataclasses.dataclass
class DC:
    x: Tensor
    y: Tensor


@dataclasses.dataclass
class Inner:
    x: Tensor
    y: Tensor


@dataclasses.dataclass
class Outer:
    inner: Inner
    z: Tensor


class TensorPair(NamedTuple):
    x: Tensor
    y: Tensor


def _map(kind: str, fn: Callable[[Tensor], Tensor], inp: Any) -> Any:
    if kind == "dataclass":
        return DC(fn(inp.x), fn(inp.y))
    if kind == "nested_dataclass":
        return Outer(Inner(fn(inp.inner.x), fn(inp.inner.y)), fn(inp.z))
    return TensorPair(fn(inp.x), fn(inp.y))


class ContainerLayer(nn.Module):
    """Applies one linear layer to every tensor of a structured activation."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.layer = nn.Linear(DIM, DIM)

    def forward(self, inp: Any) -> Any:
        return _map(self.kind, lambda t: torch.tanh(self.layer(t)), inp)


class Structured(nn.Module):
    """Packs its input into a structure, runs two units on it, sums the structure back."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.first = nn.Linear(DIM, DIM)
        self.units = nn.ModuleList(ContainerLayer(kind) for _ in range(2))

    def forward(self, x: Tensor) -> Tensor:
        x = self.first(x.to(self.first.weight.dtype))
        if self.kind == "dataclass":
            packed: Any = DC(x, x * 2)
        elif self.kind == "nested_dataclass":
            packed = Outer(Inner(x, x * 2), x.neg())
        else:
            packed = TensorPair(x, x * 2)
        for unit in self.units:
            packed = unit(packed)
        if self.kind == "nested_dataclass":
            return packed.inner.x + packed.inner.y + packed.z
        return packed.x + packed.y


PRECISIONS = {"fp32": None, "bf16": BF16}


@stages
@pytest.mark.parametrize("precision", list(PRECISIONS))
@pytest.mark.parametrize("kind", ["dataclass", "nested_dataclass", "namedtuple"])
def test_structured_activations_between_units(stage: int, kind: str, precision: str) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_structured_input_output: units that
    take and return a dataclass, a nested dataclass or a NamedTuple of activations, in float32
    and in bf16 compute; gradients reach every unit through the structures."""
    torch.manual_seed(0)
    model = Structured(kind)
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, compute, torch.float32),
        auto_wrap=ContainerLayer,
        mixed_precision=PRECISIONS[precision],
    )


@dataclasses.dataclass
class Features:
    x: Tensor
    ids: Tensor


def _pack(kind: str, x: Tensor, ids: Tensor) -> Any:
    if kind == "tuple":
        return (x, ids)
    if kind == "list":
        return [x, ids]
    if kind == "dict":
        return {"x": x, "ids": ids}
    return Features(x, ids)


def _unpack(kind: str, inp: Any) -> tuple[Tensor, Tensor]:
    if kind in ("tuple", "list"):
        return inp[0], inp[1]
    if kind == "dict":
        return inp["x"], inp["ids"]
    return inp.x, inp.ids


class TakesContainer(nn.Module):
    """The whole model, one unit: its input is a container of float features and token ids;
    it records the dtypes it receives."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.embed = nn.Embedding(7, DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.seen: list[tuple[torch.dtype, torch.dtype]] = []

    def forward(self, inp: Any) -> Tensor:
        x, ids = _unpack(self.kind, inp)
        self.seen.append((x.dtype, ids.dtype))
        return self.proj(x) + self.embed(ids)


@stages
@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass"])
def test_floating_inputs_inside_containers_are_cast(stage: int, kind: str) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_structured_input_output (structured
    inputs under mixed precision): the model's input is a tuple, a list, a dict or a dataclass
    holding float features and integer token ids; under bf16 compute the features arrive in
    bf16 and the ids unchanged, and training follows the recipe (which casts its inputs
    alike)."""
    torch.manual_seed(0)
    model = TakesContainer(kind)
    ids = [torch.randint(7, (8,), generator=torch.Generator().manual_seed(s)) for s in range(4)]
    batches = [(torch.cat([x, i[:, None].float()], 1), y) for (x, y), i in zip(BATCHES, ids)]

    def forward(model: nn.Module, xi: Tensor, y: Tensor, cast: torch.dtype | None) -> Tensor:
        inp = _cast_inputs(_pack(kind, xi[:, :DIM], xi[:, DIM].long()), cast)
        return F.mse_loss(model(inp).float(), y)

    def check(side: Side) -> None:
        if side.sharded:
            assert side.model.seen[-1] == (torch.bfloat16, torch.int64), side.model.seen[-1]

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=recipe_step(forward, torch.bfloat16, torch.float32, check),
        mixed_precision=BF16,
    )


class External(nn.Module):
    """A unit given a tensor its parent makes in float32 during forward."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.seen: list[torch.dtype] = []

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        self.seen.append(y.dtype)
        return self.lin(x) * y.mean().to(x.dtype)


class MakesExternal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(DIM, DIM)
        self.l2 = External()
        self.seen: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.dtype)
        y = torch.ones(x.shape[0], DIM, dtype=torch.float32)  # made here, in float32
        return self.l2(self.l1(x.to(self.l1.weight.dtype)), y)


@stages
def test_tensor_made_in_forward_is_cast_at_the_unit_it_enters(stage: int) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_submodules_with_external_inputs: the
    model's input arrives in bf16, and a float32 tensor the root makes during forward arrives in
    bf16 at the unit it is passed to."""
    torch.manual_seed(0)

    def check(side: Side) -> None:
        if side.sharded:
            assert side.model.seen[-1] == torch.bfloat16
            assert side.model.l2.seen[-1] == torch.bfloat16

    assert_peer_parity(
        MakesExternal(),
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, torch.bfloat16, torch.float32, check),
        auto_wrap=External,
        mixed_precision=BF16,
    )


@stages
def test_output_dtype_casts_the_models_outputs(stage: int) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_float16_on_one_submodule (the subtest
    with ``output_dtype``): bf16 compute with ``output_dtype=torch.float32`` hands the loss
    float32 outputs; the training follows the recipe."""
    precision = MixedPrecision(param_dtype=torch.bfloat16, output_dtype=torch.float32)

    def check(side: Side) -> None:
        if side.sharded:
            with torch.no_grad():
                assert side.model(torch.zeros(2, DIM)).dtype == torch.float32

    assert_peer_parity(
        _mlps(),
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, torch.bfloat16, torch.float32, check),
        auto_wrap=MLP,
        mixed_precision=precision,
    )


class Recording(nn.Module):
    """A unit recording the dtype of every input it runs on (recomputations included)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.seen: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        self.seen.append(x.dtype)
        return torch.tanh(self.lin(x.to(self.lin.weight.dtype)))


class UpcastsFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.unit = Recording()
        self.head = nn.Linear(DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        h = self.unit(x.to(torch.float32))  # the parent hands the unit float32
        return self.head(h.to(self.head.weight.dtype))


@stages
def test_recomputed_unit_sees_cast_inputs(stage: int) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_checkpoint_recompute_casts_forward_inputs:
    a recomputed unit handed float32 by its parent sees bf16 both in forward and when backward
    recomputes it."""
    torch.manual_seed(0)

    def check(side: Side) -> None:
        if side.sharded:
            seen = side.model.unit.seen
            assert seen[-2:] == [torch.bfloat16, torch.bfloat16], seen
            assert len(seen) == 2 * (side.step_index + 1)

    assert_peer_parity(
        UpcastsFirst(),
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, torch.bfloat16, torch.float32, check),
        auto_wrap=Recording,
        checkpoint_activations=True,
        mixed_precision=BF16,
    )


@stages
@pytest.mark.parametrize("where", ["unit", "strict-submodule"])
def test_composable_checkpoint_of_a_unit_or_a_part_of_it(stage: int, where: str) -> None:
    """Mirrors test_fully_shard_compose.py::test_checkpoint_and_fully_shard: torch's composable
    ``checkpoint`` on a unit, or on a strict submodule of it (its Linear, recomputed in backward
    outside the unit's forward), under bf16: the unit sees bf16 inputs at every run, and trains
    as the recipe does."""
    torch.manual_seed(0)
    model = UpcastsFirst()
    composable_checkpoint(model.unit if where == "unit" else model.unit.lin)
    runs_per_step = 2 if where == "unit" else 1  # forward, and recomputation of the unit

    def check(side: Side) -> None:
        if side.sharded:
            seen = side.model.unit.seen
            assert set(seen) == {torch.bfloat16}, seen
            assert len(seen) == runs_per_step * (side.step_index + 1)

    assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, torch.bfloat16, torch.float32, check),
        auto_wrap=Recording,
        mixed_precision=BF16,
    )


NORMS = {
    "layernorm": (lambda: nn.LayerNorm(DIM), BF16),
    "batchnorm-bf16-buffers": (
        lambda: nn.BatchNorm1d(DIM),
        MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
    ),
}


@stages
@pytest.mark.parametrize("norm", list(NORMS))
def test_norm_modules_in_bf16(stage: int, norm: str) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_norm_modules_bf16: a LayerNorm or a
    BatchNorm1d unit between linear units runs forward and backward in bf16, BatchNorm with its
    statistics in bf16 (``buffer_dtype``: torch's ``batch_norm`` on CPU refuses bf16 weights
    with float32 statistics, the error FSDP2's test expects on CUDA); the gradients follow the
    recipe (the running statistics are each rank's own, so parameters are compared by
    gradient)."""
    make, precision = NORMS[norm]
    torch.manual_seed(0)
    model = Casting(nn.Sequential(nn.Linear(DIM, DIM), make(), nn.Linear(DIM, DIM)))
    shapes = shapes_of(model)

    def check(side: Side) -> None:
        note_grads(side, shapes)
        if side.sharded:
            with torch.no_grad():
                assert side.model(torch.randn(4, DIM)).dtype == torch.bfloat16

    def is_layer(module: nn.Module) -> bool:
        return isinstance(module, (nn.Linear, nn.LayerNorm, nn.BatchNorm1d))

    assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=recipe_step(_mse, torch.bfloat16, torch.float32, check),
        compare_parameters=False,
        auto_wrap=is_layer,
        mixed_precision=precision,
    )


class WithInteger(nn.Module):
    """Two linear layers and a frozen int64 parameter beside them."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(DIM, DIM), nn.Linear(DIM, DIM))
        self.non_float = nn.Parameter(torch.arange(DIM, dtype=torch.int64), requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        x = x.to(self.layers[0].weight.dtype)
        return self.layers(x) + self.non_float.to(x.dtype) * 1e-2


@stages
def test_integer_parameter_is_never_cast_and_grads_stay_fp32(stage: int) -> None:
    """Mirrors test_fully_shard_mixed_precision.py::test_reduce_dtype_after_frozen_first_forward:
    a model with a frozen int64 parameter, frozen whole after wrapping for a first forward
    under ``torch.no_grad()``, then its layers made trainable again: the integer parameter keeps
    its dtype and values, the layers' gradients are float32 and follow the recipe."""
    torch.manual_seed(0)
    model = WithInteger()

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if side.step_index == 0:
            side.model.requires_grad_(False)
            with torch.no_grad():
                side.model(side.local(batch[0]))
            side.model.layers.requires_grad_(True)
        return inner(side, opt, batch)

    def check(side: Side) -> None:
        assert side.model.non_float.dtype == torch.int64
        for p in side.model.layers.parameters():
            assert p.grad is not None and p.grad.dtype == torch.float32

    inner = recipe_step(_mse, torch.bfloat16, torch.float32, check)
    ref, runs = assert_peer_parity(
        model, stage=stage, batches=BATCHES, step=step, mixed_precision=BF16
    )
    for run in runs:
        assert torch.equal(run.state["non_float"], model.non_float)


# gradients kept in another dtype than the parameters ---------------------------------------------

# How float32 becomes the grad_dtype: (set before wrapping, MixedPrecision, reduced in)
GRAD_DTYPES = {
    "float32-reduction": (True, None, torch.float32),
    "bfloat16-reduction": (
        True,
        MixedPrecision(param_dtype=None, reduce_dtype=torch.bfloat16),
        torch.bfloat16,
    ),
    "set-after-wrapping": (False, None, torch.bfloat16),
}


@stages
@pytest.mark.parametrize("schedule", ["sync", "no_sync", "checkpoint"])
@pytest.mark.parametrize("setting", list(GRAD_DTYPES))
def test_bf16_parameters_keep_fp32_gradients(stage: int, schedule: str, setting: str) -> None:
    """Mirrors test_fully_shard_grad_dtype.py::test_fp32_gradient and
    ::test_explicit_reduction_dtype_and_unused_parameter: bfloat16 parameters whose
    ``grad_dtype`` (torch's ``Tensor.grad_dtype``) is float32, set before wrapping. Plain
    PyTorch computes each gradient in bfloat16 and adds it into a float32 ``.grad``; on the
    wrapped model ``.grad`` is float32 too, each rank's micro-batches accumulate in float32 and
    the ranks' gradients are averaged in float32 (no ``reduce_dtype`` given), or in bfloat16
    where ``MixedPrecision(reduce_dtype=torch.bfloat16)`` says so. Set on the shard params
    after wrapping, ``.grad`` is float32 and the reduction stays in the dtype wrapping chose
    (here the parameters' bfloat16, accumulation included). Steps plain, with
    ``no_sync()`` micro-batches, and recomputed (``torch.utils.checkpoint`` around the model).
    The reference runs each rank's slice of each micro-batch on the plain model and sums in
    that order and dtype, so the gradients agree to the last bit: a bfloat16 reduction where
    float32 was due would differ in the third digit. A parameter forward never uses keeps
    ``grad = None``, as in plain PyTorch (FSDP2 reduces zeros for it)."""
    before, precision, reduce_dtype = GRAD_DTYPES[setting]
    micro = 2 if schedule == "no_sync" else 1
    torch.manual_seed(0)
    model = _mlps().to(torch.bfloat16)
    model.inner[0].register_parameter("unused", nn.Parameter(torch.ones(DIM, dtype=torch.bfloat16)))
    shapes = shapes_of(model)

    def loss_of(module: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        out = checkpoint(module, x, use_reentrant=False) if schedule == "checkpoint" else module(x)
        return F.mse_loss(out.float(), y) / micro

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        parts = list(zip(side.micro(batch[0], micro), side.micro(batch[1], micro)))
        total = torch.zeros(())
        if side.sharded:
            for i, (x, y) in enumerate(parts):
                loss = loss_of(side.model, x, y)
                with side.model.no_sync() if i < micro - 1 else contextlib.nullcontext():
                    loss.backward()
                total = total + loss.detach()
            for p in side.model.parameters():
                assert p.dtype == torch.bfloat16 and p.grad_dtype == torch.float32
                assert p.grad is None or p.grad.dtype == torch.float32
        else:
            params = list(side.model.parameters())
            sums: list[Tensor | None] = [None] * len(params)
            for rank in range(WORLD):  # each rank's slice of each micro-batch, in order
                partial: list[Tensor | None] = [None] * len(params)
                for x, y in parts:
                    loss = loss_of(side.model, x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
                    loss.backward()
                    total = total + loss.detach() / WORLD
                    for i, p in enumerate(params):
                        if p.grad is not None:
                            g = p.grad.to(reduce_dtype)
                            partial[i] = g if partial[i] is None else partial[i] + g
                            p.grad = None
                for i, g in enumerate(partial):
                    if g is not None:
                        sums[i] = g if sums[i] is None else sums[i] + g
            for p, g in zip(params, sums):
                p.grad = None if g is None else (g / WORLD).to(torch.float32)
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=step,
        prepare=lambda side: None if side.sharded and before else fp32_grads(side.model),
        build=(lambda rank: fp32_grads(copy.deepcopy(model))) if before else None,
        auto_wrap=MLP,
        mixed_precision=precision,
    )


# loss scaling -------------------------------------------------------------------------------


@stages
@pytest.mark.parametrize("has_inf", [False, True], ids=["finite", "inf-on-one-rank"])
@pytest.mark.parametrize("scaler_class", [torch.amp.GradScaler, ShardedGradScaler])
def test_gradient_scaler_skips_the_step_on_every_rank(
    stage: int, has_inf: bool, scaler_class: type[torch.amp.GradScaler]
) -> None:
    """Mirrors test_fully_shard_grad_scaler.py::test_gradient_scaler: torch's ``GradScaler``
    (as there) or ``ShardedGradScaler`` unscales the pieces; an inf in one rank's piece (the
    plain model: in the same element) is found on every rank, the step is skipped on every rank
    and the scale backs off; without one the step runs and the scale stays, as
    ``torch.amp.GradScaler`` on the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4, bias=False) for _ in range(2)])
    batches = make_batches(3, (4, 4), (4, 4))
    # by side, not id(side): a rank's side can take the finished reference's address, and so
    # its scaler, whose scale differs from the other rank's (the reduction then mixes scales)
    scalers: dict[tuple[bool, int], torch.amp.GradScaler] = {}

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        key = (side.sharded, side.rank)
        if key not in scalers:
            if side.sharded:
                scalers[key] = scaler_class("cpu", init_scale=2.0)
            else:
                scalers[key] = torch.amp.GradScaler("cpu", init_scale=2.0)
        scaler = scalers[key]
        loss = F.mse_loss(side.model(side.local(batch[0])), side.local(batch[1]))
        scaler.scale(loss).backward()
        grad = side.model[0].weight.grad
        start, _ = piece_range(side, grad)
        if has_inf and side.step_index == 1 and (not side.sharded or side.rank == 1):
            assert not side.sharded or start == 8  # rank 1 holds elements 8-15 of 16
            grad.view(-1)[8 - start] = float("inf")
        before = scaler.get_scale()
        scaler.unscale_(opt)
        found = scaler._per_optimizer_states[id(opt)]["found_inf_per_device"]
        side.note("found inf", float(sum(v.item() for v in found.values())))
        scaler.step(opt)
        scaler.update()
        side.note("scale after the step", scaler.get_scale() / before)
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=nn.Linear)
