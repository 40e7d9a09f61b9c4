"""End the program while a non-blocking save is still being written; report how this rank ended.

Launched by tests/e2e/test_save_at_exit.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/save_at_exit.py CASE WORKDIR

``init_process_group("gloo", timeout=5 s)``; a small GPT with a persistent buffer (``scale``),
SGD with momentum. Every rank saves ``WORKDIR/ckpt/step-1`` (blocking, ``keep_last=1``), trains a
step, then starts ``WORKDIR/ckpt/step-2`` with ``blocking=False, keep_last=1`` and ``extra``
``step=2, rank=RANK``, its writers slowed down (50 ms a tensor) so that the program ends first;
rank 0 leaves each checkpoint's full state dict in ``WORKDIR/expected-N.pt``. Then, by CASE:

- ``exit``: the main thread ends, with no ``wait()``;
- ``raise``: instead of the above, a :class:`~shardwrap.Logbook` run in ``WORKDIR/run`` that
  saves every 2 steps in the background (``keep_last=1``, each rank's own ``stateful`` state):
  every rank raises inside it while its save of step 2 is still being written;
- ``oom``: rank 1 runs out of memory (raises ``torch.OutOfMemoryError``) and ends; rank 0
  trains on until its next collective fails;
- ``full``: as ``exit``, but rank 1's writer meets a full disk (``ENOSPC``) in its rank file.

Each rank that ends with an exception prints ``ENDED <rank> <class>: <message>``.
"""

from __future__ import annotations

import datetime
import errno
import os
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from shardwrap import Logbook, ShardedModule, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.launch import say
from tests.support.models import GPT, Block, make_batch

WRITE_DELAY_S = 0.05  # per tensor: the writers are still writing when the program ends


def build() -> ShardedModule:
    """The model every rank trains and the test loads: a GPT with a persistent buffer."""
    torch.manual_seed(0)
    model = GPT(width=48, depth=2)
    model.register_buffer("scale", torch.arange(16.0))
    return ShardedModule(model, auto_wrap=Block)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    idx, targets = make_batch(step, 4)
    model(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
    opt.step()
    opt.zero_grad()


def _slow_writers(rank: int, full: bool) -> None:
    write = SafetensorsWriter.write

    def slow(self: SafetensorsWriter, tensor: torch.Tensor) -> None:
        time.sleep(WRITE_DELAY_S)
        if full and rank == 1 and self.path.name.startswith("rank-"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, tensor)

    SafetensorsWriter.write = slow  # type: ignore[method-assign]


def _expect(model: ShardedModule, work: Path, step: int, rank: int) -> None:
    full = model.full_state_dict(rank0_only=True)
    if rank == 0:
        torch.save(full, work / f"expected-{step}.pt")


def run(case: str, work: Path, rank: int) -> None:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if case == "raise":
        _raise_in_a_logbook(model, opt, work, rank)
    ckpt = work / "ckpt"
    _step(model, opt, 0, rank)
    save_checkpoint(ckpt / "step-1", model, opt, keep_last=1, step=1, rank=rank)
    _expect(model, work, 1, rank)
    _step(model, opt, 1, rank)
    _expect(model, work, 2, rank)
    _slow_writers(rank, full=case == "full")
    save_checkpoint(ckpt / "step-2", model, opt, keep_last=1, blocking=False, step=2, rank=rank)
    if case == "oom":
        if rank == 1:
            raise torch.OutOfMemoryError("simulated: out of memory")
        for step in range(2, 100):  # until the collective with the rank that ended fails
            _step(model, opt, step, rank)


class _Rank:
    """What a Logbook saves of this rank in every checkpoint's ``extra`` (``stateful``)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def state_dict(self) -> dict[str, int]:
        return {"rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.rank = state["rank"]


def _raise_in_a_logbook(
    model: ShardedModule, opt: torch.optim.Optimizer, work: Path, rank: int
) -> None:
    """A Logbook run in ``WORKDIR/run`` saving every 2 steps in the background: raise on every
    rank while its save of step 2 is still being written."""
    stateful = {"who": _Rank(rank)}
    with Logbook(
        work / "run", model, opt, save_every=2, keep_last=1, plot_every=None, stateful=stateful
    ) as book:
        for step in book.steps(6):
            if step == 1:  # the save of step 0 is complete: slow the next one down
                _slow_writers(rank, full=False)
            idx, targets = make_batch(step, 4)
            loss = model(idx.chunk(2)[rank], targets.chunk(2)[rank])
            loss.backward()
            book.step(loss)
            if book.done == 2:  # its save has just started
                _expect(model, work, 2, rank)
                raise RuntimeError("simulated: an error on every rank")


def main(case: str, work: str) -> None:
    rank = int(os.environ["RANK"])
    try:
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
        run(case, Path(work), rank)
    except Exception as e:
        traceback.print_exc()
        say(f"ENDED {rank} {type(e).__name__}: {e}")
        sys.exit(1)
    say(f"ENDED {rank} normally")


if __name__ == "__main__":
    main(*sys.argv[1:3])
