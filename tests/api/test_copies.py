"""``copy.deepcopy`` of a sharded model: an EMA kept by torch's ``AveragedModel``, a copy that
trains on its own (ties, frozen parameters, buffers and the user's tags kept), and the cases
refused; an ``AveragedModel`` inside the sharded model, updated where its pieces line up with
the module's and refused where they do not.

Each copy is checked against the same use of a deep copy of the plain model, trained on the
whole batch, at 2 ranks (stages 1-3): the EMA's weights and its evaluation outputs, the copy's
weights after training apart from the original, and the original's left as they were.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_copies.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from shardwrap import Offload, ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks
from tests.support.tp import parallelize_gpt, run_mesh_ranks, tp_gpt

WORLD = 2
STAGES = [1, 2, 3]
BATCHES = [make_batch(seed=s, batch=4) for s in range(3)]


torch.manual_seed(0)
BASE = GPT(tied=True)  # before any rank runs: ranks as threads share the default RNG


def _gpt() -> GPT:
    model = copy.deepcopy(BASE)
    model.wpe.weight.requires_grad_(False)
    model.lm_head.weight.tag = "decay"  # the user's tag on a (tied) parameter
    return model


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _state(m: Any) -> dict[str, Tensor]:
    return m.full_state_dict() if isinstance(m, ShardedModule) else dict(m.state_dict())


def _train_with_ema(m: Any, rank: int, world: int) -> tuple[dict[str, Tensor], Tensor]:
    """SGD steps, each followed by an EMA update; the EMA's weights and its evaluation."""
    ema = AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9))
    opt = _sgd(m)
    for x, y in BATCHES:
        m(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        ema.update_parameters(m)
    ema.eval()
    with torch.no_grad():
        logits = ema(BATCHES[0][0].chunk(world)[rank])
    return _state(ema.module), logits


@pytest.mark.parametrize("stage", STAGES)
def test_an_ema_kept_by_averaged_model_is_the_plain_models(stage: int) -> None:
    """``AveragedModel(model)`` deep-copies the model: a sharded copy, updated piece by piece
    after each step, whose weights and evaluation equal those of the plain model's EMA (before:
    ``copy.deepcopy`` of a sharded model was refused)."""
    want_state, want_logits = _train_with_ema(_gpt(), 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], Tensor]:
        m = ShardedModule(_gpt(), auto_wrap=Block, process_group=pg, stage=stage)
        return _train_with_ema(m, rank, WORLD)

    for rank, (state, logits) in enumerate(run_ranks(WORLD, fn, timeout=60)):
        torch.testing.assert_close(state, want_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(logits, want_logits.chunk(WORLD)[rank], atol=1e-5, rtol=0)


class Twos(nn.Module):
    """Two 2 x 2 linears and a vector of 2: at 2 ranks every piece (``(1, 2)``, ``(1,)``)
    broadcasts against its whole parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(2, 2, bias=False) for _ in range(2))
        self.scale = nn.Parameter(torch.tensor([1.0, 2.0]))

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return x * self.scale


def _lerp_state_foreach(ema: nn.Module, model: nn.Module) -> None:
    torch._foreach_lerp_(list(ema.state_dict().values()), list(model.state_dict().values()), 0.1)


def _lerp_parameters(ema: nn.Module, model: nn.Module) -> None:
    for e, p in zip(ema.parameters(), model.parameters()):
        e.lerp_(p, 0.1)


def _copy_state(ema: nn.Module, model: nn.Module) -> None:
    for e, p in zip(ema.state_dict().values(), model.state_dict().values()):
        e.copy_(p)


@pytest.mark.parametrize("update", [_lerp_state_foreach, _lerp_parameters, _copy_state])
@pytest.mark.parametrize("model", ["twos", "gpt"])
def test_an_ema_made_before_wrapping_is_refused_naming_the_fix(update: Any, model: str) -> None:
    """An EMA made before wrapping, in timm's order (its ``ModelEmaV3`` is made before the DDP
    wrapper): a whole copy, updated from the sharded model's ``state_dict()`` or
    ``parameters()`` (a foreach lerp, a lerp per tensor, its warm-up's copy). Its whole
    tensors met this rank's pieces: where their shapes broadcast it blended other elements
    without a word (``twos``); elsewhere torch's size error named no fix (``gpt``). Refused
    on every rank, naming the fix, the EMA left as it was."""
    torch.manual_seed(0)
    base = Twos() if model == "twos" else _gpt()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = copy.deepcopy(base)
        ema = copy.deepcopy(m)
        before = copy.deepcopy(ema.state_dict())
        wrap = nn.Linear if model == "twos" else Block
        m = ShardedModule(m, auto_wrap=wrap, process_group=pg)
        with torch.no_grad(), pytest.raises(ValueError, match="made before wrapping"):
            update(ema, m)
        torch.testing.assert_close(ema.state_dict(), before, atol=0, rtol=0)

    run_ranks(WORLD, fn, timeout=60)


class Tracked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(6, 9)
        self.down = nn.Linear(9, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(torch.tanh(self.up(x)))


class WithAverage(nn.Module):
    """A module and its EMA side by side in one model, as FSDP1's EMA test keeps them: train
    the module, evaluate the average."""

    def __init__(self) -> None:
        super().__init__()
        self.module = Tracked()
        self.ema = AveragedModel(self.module, multi_avg_fn=get_ema_multi_avg_fn(0.9))

    def forward(self, x: Tensor) -> Tensor:
        return self.module(x) if self.training else self.ema(x)


def _with_average() -> WithAverage:
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return WithAverage()


def _train_inside(m: nn.Module, rank: int, world: int) -> None:
    opt = torch.optim.SGD(m.module.parameters(), lr=0.1)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    for _ in range(3):
        m(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()
        m.ema.update_parameters(m.module)


@pytest.mark.parametrize("stage", STAGES)
def test_an_average_inside_the_model_updates_where_its_pieces_line_up(stage: int) -> None:
    """Mirrors FSDP1's test_fsdp_mixed_precision.py::test_train_ema_eval_flow: an
    ``AveragedModel`` beside the module it follows, inside the sharded model. As units of their
    own (laid out alike) the average equals the plain model's; in one unit their pieces cover
    other ranges, and ``update_parameters`` raises on every rank naming the fixes, changing
    nothing (before: torch's bare size mismatch, or, where two pieces' sizes agreed, elements
    of one parameter blended into others of another)."""
    base = _with_average()  # here: ranks as threads share the default generator
    plain = copy.deepcopy(base)
    _train_inside(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        apart = ShardedModule(
            copy.deepcopy(base), process_group=pg, stage=stage, auto_wrap=(AveragedModel, Tracked)
        )
        _train_inside(apart, rank, WORLD)
        together = ShardedModule(copy.deepcopy(base), process_group=pg, stage=stage)
        before = together.full_state_dict()
        with pytest.raises(ValueError, match="are not held alike") as error:
            together.ema.update_parameters(together.module)
        assert "ema = AveragedModel(sharded_model)" in str(error.value)
        torch.testing.assert_close(together.full_state_dict(), before, atol=0, rtol=0)
        return apart.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=60):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_a_copy_trains_apart_from_the_original(stage: int) -> None:
    """A copy holds the original's values, its tie, its frozen parameter and the user's tag,
    and trains on its own, as a copy of the plain model does; the original is left as it was."""
    plain = _gpt()
    before = copy.deepcopy(plain.state_dict())
    twin = copy.deepcopy(plain)
    opt = _sgd(twin)
    for x, y in BATCHES:
        twin(x, y).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        m = ShardedModule(_gpt(), auto_wrap=Block, process_group=pg, stage=stage)
        c = copy.deepcopy(m)
        assert type(c) is type(m) and isinstance(c, ShardedModule) and c is not m
        assert c.lm_head.weight is c.wte.weight and c.lm_head.weight is not m.lm_head.weight
        assert c.lm_head.weight.tag == "decay" and not c.wpe.weight.requires_grad
        torch.testing.assert_close(c.full_state_dict(), m.full_state_dict(), atol=0, rtol=0)
        opt = _sgd(c)
        for x, y in BATCHES:
            c(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank]).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict(), c.full_state_dict()

    for original, copied in run_ranks(WORLD, fn, timeout=60):
        torch.testing.assert_close(original, before, atol=0, rtol=0)
        torch.testing.assert_close(copied, dict(twin.state_dict()), atol=1e-5, rtol=0)


def test_a_copy_on_some_ranks_only_raises_on_every_rank() -> None:
    """A copy made on rank 0 alone (inside ``if rank == 0:``) while rank 1 goes on to its
    forward: both raise, naming where each is, instead of pairing their collectives."""

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(_gpt(), auto_wrap=Block, process_group=pg)
        x, y = BATCHES[0]
        with pytest.raises(RuntimeError, match="ranks are at different steps") as raised:
            if rank == 0:
                copy.deepcopy(m)
            else:
                m(x.chunk(WORLD)[rank], y.chunk(WORLD)[rank])
        return str(raised.value)

    for message in run_ranks(WORLD, fn, timeout=60):
        assert "copy.deepcopy" in message


@pytest.mark.stage3  # the disk tier is a stage-3 tier
def test_a_copy_of_a_model_on_the_disk_tier_is_refused_naming_the_fix(tmp_path: Path) -> None:
    m = ShardedModule(_gpt(), auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    with pytest.raises(TypeError) as raised:
        copy.deepcopy(m)
    message = str(raised.value)
    assert "on the disk tier" in message and "Copy the model before wrapping it" in message


def test_a_copy_over_a_tensor_parallel_mesh_is_refused_naming_the_fix() -> None:
    base = tp_gpt()

    def fn(rank: int, mesh: DeviceMesh) -> None:
        model = parallelize_gpt(copy.deepcopy(base), mesh["tp"])
        m = ShardedModule(model, process_group=mesh, auto_wrap=Block)
        with pytest.raises(TypeError, match="with tensor parallelism .* Copy the model before"):
            copy.deepcopy(m)

    run_mesh_ranks((2, 2), ("dp", "tp"), fn)


def test_a_copy_or_save_of_a_submodule_is_refused_naming_the_fix(tmp_path: Path) -> None:
    """``copy.deepcopy`` of a submodule holding pieces (a unit, a layer inside one, or
    ``fuse_conv_bn_eval`` copying a layer) gave a module of this rank's pieces that carried
    shardwrap's hooks (a layer copied silently; calling it gathered the original model's
    units, on the rank that called it), or torch's "cannot pickle ProcessGroup"; ``torch.save``
    of a unit raised "Can't pickle local object". Each is refused naming what to do, the file
    not opened; the model trains on."""
    path = tmp_path / "block.pt"
    path.write_bytes(b"kept")

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(_gpt(), process_group=pg, auto_wrap=Block)
        for part in (m.blocks[0], m.blocks[0].mlp, m.lm_head):
            with pytest.raises(TypeError, match="copy.deepcopy of a submodule.*full_state_dict"):
                copy.deepcopy(part)
        with pytest.raises(TypeError, match="pickling blocks.0.*full_state_dict"):
            torch.save(m.blocks[0], path)
        idx, targets = BATCHES[0]
        m(idx.chunk(WORLD)[rank], targets.chunk(WORLD)[rank]).backward()

    run_ranks(WORLD, fn, timeout=30)
    assert path.read_bytes() == b"kept"
