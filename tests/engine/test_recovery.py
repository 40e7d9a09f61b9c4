"""A backward that raises, caught by the training loop, leaves the model able to train on; so
does a forward whose gather raises before its exchange goes out.

An exception in backward (here from a hook on the loss or on the first block's output, midway
through backward, as an injected fault or a bad loss would raise) stops autograd before
shardwrap's end of backward. The next forward must start
clean on every rank: the run then trains exactly like the plain model trained on the steps that
completed, gradients are never silently missing, and saving works. World sizes 1 and 2, every
stage; both ranks raise alike.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_recovery.py -q``
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.comm import buckets
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

STEPS, FAILING = 4, 1  # step FAILING raises in backward; the others train
GLOBAL_BATCH = 4


class InjectedError(RuntimeError):
    pass


def _raise(grad: Tensor) -> Tensor:
    raise InjectedError("injected in backward")


def _raise_at_first_block(module: nn.Module, args: object, output: Tensor) -> None:
    output.register_hook(_raise)


def _step(
    model: nn.Module, opt: torch.optim.Optimizer, x: Tensor, y: Tensor, fail: str | None
) -> None:
    opt.zero_grad()
    hook = model.blocks[0].register_forward_hook(_raise_at_first_block) if fail == "mid" else None
    loss = model(x, y)
    if hook is not None:
        hook.remove()
    if fail == "loss":
        loss.register_hook(_raise)
    try:
        loss.backward()
    except InjectedError:
        return
    opt.step()


def _reference(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> nn.Module:
    """A copy of ``model`` trained on every batch but the failing step's."""
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step, (x, y) in enumerate(batches):
        if step != FAILING:
            _step(ref, opt, x, y, fail=None)
    return ref


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("where", ["loss", "mid"])
def test_training_goes_on_after_a_backward_that_raised(
    tmp_path: Path, world_size: int, stage: int, where: str
) -> None:
    """``where``: the first gradient of backward raises (a hook on the loss), or one midway,
    at the first block's output, after the later blocks' gradients were reduced (or issued)."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(seed=s, batch=GLOBAL_BATCH) for s in range(STEPS)]
    ref = _reference(model, batches)

    def fn(rank: int, pg: ProcessGroup | None) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for step, (x, y) in enumerate(batches):
            local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            _step(m, opt, *local, fail=where if step == FAILING else None)
            if step == FAILING:
                save_checkpoint(tmp_path / "after-failure", m, opt)
            else:
                assert all(p.grad is not None for p in m.parameters()), "no gradients"
        return m.full_state_dict()

    states = [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=30.0)
    for state in states:
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)
    fresh = ShardedModule(copy.deepcopy(model), auto_wrap=Block)
    load_checkpoint(tmp_path / "after-failure", fresh)  # the save after the failure is whole


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2])
def test_training_goes_on_after_a_gather_that_raised(
    monkeypatch: pytest.MonkeyPatch, world_size: int, stage: int
) -> None:
    """A forward's first exchange of gathers raises on every rank before it goes out (as
    ``torch.func.jvp`` of a forward made it raise, from inside the transform): the units it
    was for are left sharded, not gathering, so the next forward gathers them afresh. Before,
    it waited for nothing and computed with buffers nothing had been gathered into (at stages
    1 and 2 the resident buffers' other slices; at stage 3 a pooled buffer's old values)."""
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(seed=s, batch=GLOBAL_BATCH) for s in range(STEPS)]
    ref = _reference(model, batches)
    many, armed = buckets.all_gather_many, threading.local()

    def failing(*args: Any) -> Any:
        if getattr(armed, "on", False):
            armed.on = False
            raise InjectedError("injected in a gather")
        return many(*args)

    monkeypatch.setattr(buckets, "all_gather_many", failing)

    def fn(rank: int, pg: ProcessGroup | None) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for step, (x, y) in enumerate(batches):
            local = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
            if step == FAILING:
                armed.on = True
                with pytest.raises(InjectedError):
                    m(*local)
            else:
                _step(m, opt, *local, fail=None)
        return m.full_state_dict()

    states = [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=30.0)
    for state in states:
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)
