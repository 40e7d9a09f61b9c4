"""Modules that are unusual in what they hold, take or return: units whose parameters are all
empty, an embedding with sparse gradients, a frozen float8 parameter, a dataclass of tensors as
input under mixed precision (and moved to the compute device), a unit that returns its own
parameter (in a tuple or a plain object), a parameter read outside its unit's forward, and
complex parameters (clipped, compressed, checkpointed).

Each trains or runs a sharded model (2 ranks as threads) beside a deep-copied plain model on the
whole batch and compares them; the case of a parameter read outside its unit checks the error
names the parameter and the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_unusual_modules.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import Compression, MixedPrecision, ShardedModule
from shardwrap.engine.step.trees import to_device
from tests.support.hybrid import hybrid_mesh
from tests.support.models import ComplexLayer, WithComplex
from tests.support.parity import CLIP_NORM, train_clipped, train_reference, train_sharded
from tests.support.ranks import run_ranks

WORLD = 2
STAGES = [1, 2, 3]


def _batches(steps: int = 3, width: int = 8) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * WORLD, width, generator=g) for _ in range(steps)]


def _parity(
    model: nn.Module,
    loss: Callable[[nn.Module, Tensor], Tensor],
    stage: int,
    width: int = 8,
    **wrap: object,
) -> None:
    """AdamW over 3 steps: every rank's full state equals the plain model's within 1e-5."""

    def train(m: nn.Module, rank: int, world: int) -> None:
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)
        for x in _batches(width=width):
            loss(m, x.chunk(world)[rank]).backward()
            opt.step()
            opt.zero_grad()

    plain = copy.deepcopy(model)
    train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, stage=stage, **wrap)
        train(m, rank, WORLD)
        return m.full_state_dict()

    want = {k: v.float() for k, v in plain.state_dict().items()}
    for rank, state in enumerate(run_ranks(WORLD, fn, timeout=30)):
        got = {k: v.float() for k, v in state.items()}
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda m, r=rank: f"{r}: {m}")


class Empty(nn.Module):
    """A layer of no outputs: both its parameters have no elements."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 0)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x)


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.e1 = Empty()
        self.e2 = Empty()
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(x) + self.e1(x).sum() + self.e2(x).sum()


@pytest.mark.parametrize("stage", STAGES)
def test_units_whose_parameters_are_all_empty(stage: int) -> None:
    """Two units of ``nn.Linear(8, 0)`` beside a real layer wrap, train and save as the plain
    model (before: a stride error, or a ``KeyError`` in the buffer pool with several)."""
    torch.manual_seed(0)
    _parity(WithEmpty(), lambda m, x: m(x).square().mean(), stage, auto_wrap=Empty)


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8, sparse=True)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.emb(ids)).square().mean()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad])
def test_a_sparse_embedding_trains_as_the_plain_model(stage: int, optimizer: type) -> None:
    """``nn.Embedding(sparse=True)``, with optimizers that take its sparse gradient on the plain
    model: its gradient is laid out dense in the unit's flat gradient, and training matches
    (before: "reshape is not implemented for sparse tensors" in backward)."""
    torch.manual_seed(0)
    model = SparseEmbedding()
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, 16, (4 * WORLD, 3), generator=g) for _ in range(3)]
    batches = [(i, i) for i in ids]  # (inputs, targets): the loss reads the inputs alone

    def make_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return optimizer(params, lr=0.1)

    def loss(m: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        return m(inputs)

    ref = train_reference(model, make_optimizer, batches, loss)
    for run in train_sharded(model, WORLD, make_optimizer, batches, loss, stage=stage):
        torch.testing.assert_close(run.state, ref.state, atol=1e-6, rtol=0)


class WithFloat8(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        scale = torch.randn(8).to(torch.float8_e4m3fn)
        self.scale = nn.Parameter(scale, requires_grad=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.lin(x) * self.scale.float()


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("sync", ["check", "copy from rank 0"])
def test_a_frozen_float8_parameter_beside_float32_ones(stage: int, sync: str) -> None:
    """The check that every rank starts alike, and the copy from rank 0, take float8 (before:
    "Promotion for Float8 Types is not supported"); training matches the plain model."""
    torch.manual_seed(0)
    sync_module_states = None if sync == "check" else True
    _parity(
        WithFloat8(),
        lambda m, x: m(x).square().mean(),
        stage,
        sync_module_states=sync_module_states,
    )


@dataclass
class Batch:
    features: Tensor
    mask: Tensor  # bool: never cast
    weight: float = 1.0


class TakesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, batch: Batch) -> Tensor:
        assert batch.features.dtype == self.lin.weight.dtype, "input not cast"
        return self.lin(batch.features) * batch.mask * batch.weight


@pytest.mark.parametrize("stage", STAGES)
def test_mixed_precision_casts_tensors_inside_a_dataclass_input(stage: int) -> None:
    """A dataclass input's floating tensors are cast to the compute dtype as a tuple's are;
    the caller's object is left as it was; the output equals the plain model run in bf16."""
    torch.manual_seed(0)
    model = TakesDataclass()
    x = _batches(1)[0]
    mask = x > 0
    plain = copy.deepcopy(model).to(torch.bfloat16)
    want = plain(Batch(x.to(torch.bfloat16), mask, 2.0)).float()

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        precision = MixedPrecision(param_dtype=torch.bfloat16)
        m = ShardedModule(
            copy.deepcopy(model), process_group=pg, stage=stage, mixed_precision=precision
        )
        batch = Batch(x.chunk(WORLD)[rank], mask.chunk(WORLD)[rank], 2.0)
        out = m(batch)
        assert batch.features.dtype == torch.float32, "the caller's batch was changed"
        return out.detach().float()

    got = torch.cat(run_ranks(WORLD, fn, timeout=30))
    torch.testing.assert_close(got, want, atol=0, rtol=0)


META = torch.device("meta")


def test_inputs_moved_to_the_compute_device_reach_nested_tensors_and_spare_the_callers() -> None:
    """What the root does to a model's inputs on a GPU (there on every forward; here with the
    ``meta`` device, the CPU being the compute device of this suite): every CPU tensor, in a
    tuple, a dict or a dataclass, is moved; the caller's dataclass is left as it was; what is
    not a CPU tensor is left alone."""
    features, mask = torch.randn(2, 8), torch.ones(2, 8, dtype=torch.bool)
    batch = Batch(features, mask, 2.0)
    already = torch.empty(3, device="meta")
    args, kwargs = to_device(((features, batch, already), {"ids": [mask], "n": 4}), META)
    moved, got_batch, kept = args
    assert moved.device == META and kept is already and kwargs["n"] == 4
    assert got_batch.features.device == got_batch.mask.device == kwargs["ids"][0].device == META
    assert got_batch.weight == 2.0 and got_batch is not batch
    assert batch.features is features and batch.mask is mask


class Box:
    """A plain object (no pytree) holding a tensor."""

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class ReturnsWeight(nn.Module):
    def __init__(self, boxed: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.boxed = boxed

    def forward(self, x: Tensor) -> tuple[Tensor, Box | Tensor]:
        weight = self.lin.weight
        return self.lin(x), Box(weight) if self.boxed else weight


class UsesReturnedWeights(nn.Module):
    def __init__(self, boxed: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ReturnsWeight(boxed) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        weights = []
        for layer in self.layers:
            x, w = layer(x)
            weights.append(w.tensor if isinstance(w, Box) else w)
        return x.square().mean() + sum(w.square().sum() for w in weights) * 1e-2


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("boxed", [False, True], ids=["tuple", "plain object"])
def test_a_unit_returning_its_own_parameter(stage: int, boxed: bool) -> None:
    """Each unit returns its weight (in a tuple, or inside a plain object), and the caller uses
    it after the unit was released and its buffer reused by the next unit (no buckets): the
    returned weight keeps its values and its gradient reaches the parameter."""
    torch.manual_seed(0)
    _parity(
        UsesReturnedWeights(boxed),
        lambda m, x: m(x),
        stage,
        auto_wrap=ReturnsWeight,
        bucket_mb=0,
    )


class ReadsBlockWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(16, 16)
        self.head = nn.Linear(16, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(F.linear(self.block(x), self.block.weight))


@pytest.mark.stage3  # at stages 1 and 2 the unit may still be gathered from its forward
def test_a_parameter_read_outside_its_unit_raises_naming_it() -> None:
    """At stage 3 ``self.block.weight`` read in the root's forward is this rank's piece: the
    forward fails, and the error names the parameter, its piece and the fixes."""

    torch.manual_seed(0)
    model = ReadsBlockWeight()  # each rank a copy: ranks as threads share the random generator

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=nn.Linear)
        with pytest.raises(RuntimeError, match="piece of block.weight") as info:
            m(torch.ones(2, 16))
        return str(info.value)

    for message in run_ranks(WORLD, fn, timeout=30):
        assert "inside that unit's forward" in message and "auto_wrap" in message


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("bucket_mb", [4, 0], ids=["buckets", "each-alone"])
def test_complex_parameters_train_and_clip_as_the_plain_model(stage: int, bucket_mb: int) -> None:
    """Complex parameters (in units, and one in a piece of one rank only) train as on the
    plain model, as under DDP, with the global gradient norm clipped each step: norms and
    final state equal (before: the weight check at wrapping raised on ``vector_norm``; past
    it, the first backward raised a ``KeyError``: complex groups had no reduction; and the
    empty piece's norm was complex, so the ranks' norm exchanges differed in size and gloo
    aborted the process)."""
    torch.manual_seed(0)
    model = WithComplex()
    plain = copy.deepcopy(model)
    want_norms, _ = train_clipped(plain, 0, 1)
    assert min(want_norms) > CLIP_NORM, "no step clipped: the norm would prove nothing"

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor]]:
        m = ShardedModule(
            copy.deepcopy(model),
            process_group=pg,
            stage=stage,
            auto_wrap=ComplexLayer,
            bucket_mb=bucket_mb,
        )
        norms, _ = train_clipped(m, rank, WORLD)
        return norms, m.full_state_dict()

    for rank, (norms, state) in enumerate(run_ranks(WORLD, fn, timeout=30)):
        assert norms == pytest.approx(want_norms, rel=1e-5), rank
        assert state["layers.0.w"].dtype == torch.complex64
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-5, rtol=0)


def test_complex_gradients_go_exact_where_reductions_are_quantized() -> None:
    """With int8 gradient reductions, over shard and replica groups (2 x 2 ranks), a complex
    gradient is reduced exactly, as a complex parameter is gathered: a model whose only
    trainable parameters are complex trains as the plain model within float32 rounding
    (before: the codec cast each complex gradient to real, dropping its imaginary part)."""
    torch.manual_seed(0)
    model = WithComplex()
    for p in model.parameters():
        p.requires_grad_(p.is_complex())
    plain = copy.deepcopy(model)
    train_clipped(plain, 0, 1)
    compression = Compression(grads="int8")

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(
            copy.deepcopy(model),
            process_group=hybrid_mesh(pg),
            auto_wrap=ComplexLayer,
            compression=compression,
        )
        train_clipped(m, rank, 4)
        return m.full_state_dict()

    for state in run_ranks(4, fn, timeout=30):
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-5, rtol=0)


def test_complex_parameters_and_their_optimizer_state_save_and_load_at_another_world_size(
    tmp_path: Path,
) -> None:
    """A checkpoint of complex parameters and their AdamW state, saved on 2 ranks, loads at
    world size 1 to the plain model's values; the export loads into the plain model (before:
    "dtype torch.complex64 has no safetensors equivalent")."""
    torch.manual_seed(0)
    model = WithComplex()
    plain = copy.deepcopy(model)
    _, plain_opt = train_clipped(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=ComplexLayer)
        _, opt = train_clipped(m, rank, WORLD)
        shardwrap.save_checkpoint(tmp_path / "ckpt", m, opt)
        shardwrap.export(tmp_path / "export", m)

    run_ranks(WORLD, fn, timeout=30)
    m = ShardedModule(copy.deepcopy(model), auto_wrap=ComplexLayer)
    opt = torch.optim.AdamW(m.parameters(), lr=0.01)
    shardwrap.load_checkpoint(tmp_path / "ckpt", m, opt)
    torch.testing.assert_close(m.full_state_dict(), plain.state_dict(), atol=1e-5, rtol=0)
    got = shardwrap.full_optimizer_state_dict(m, opt)["state"]
    want = plain_opt.state_dict()["state"]
    assert want[1]["exp_avg"].dtype == torch.complex64  # layers.0.w's
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    exported = load_file(tmp_path / "export" / "model.safetensors")
    torch.testing.assert_close(exported, plain.state_dict(), atol=1e-5, rtol=0)
