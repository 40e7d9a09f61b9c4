"""Train two steps and save, then inject one fault in step 3; report how this rank ended.

Launched by tests/e2e/test_faults.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/faults.py CASE WORKDIR TIMEOUT_S

``init_process_group("gloo", timeout=TIMEOUT_S)``; a small GPT, SGD with momentum; after step 2
a checkpoint ``WORKDIR/ckpt/step-2`` and, from rank 0, its full state dict in
``WORKDIR/expected.pt``. Then, by CASE, on rank 1 unless said otherwise:

- ``kill-forward`` / ``kill-backward``: SIGKILL itself inside a block's forward / backward;
- ``kill-save``: SIGKILL itself half-way through re-saving ``ckpt/step-2`` (the same path);
- ``kill-background-write``: every rank starts a non-blocking save of ``ckpt/step-3`` and trains
  on (``BACKGROUND_STEPS``); rank 1 SIGKILLs itself in its writer thread, half-way through its
  rank file;
- ``kill-background-commit``: the same, but rank 0 SIGKILLs itself in its writer thread once
  every file and the metadata are written, just before the folder is committed;
- ``stall``: sleep far past the timeout before step 3, while rank 0 waits for it;
- ``freeze``: stop itself (``SIGSTOP``, a hung node: no thread of it runs) before step 3's
  backward; a shell it started first resumes it three timeouts later, so that it then takes
  the ``SIGTERM`` torchrun sent it once rank 0 had failed;
- ``desync-save``: save again after step 2 while rank 0 goes on to step 3;
- ``desync-clip``: one more forward and backward before ``clip_grad_norm_`` than rank 0;
- ``skip-batch``: rank 0 runs out of memory in step 3's forward, catches it and goes on;
- ``no-group``: no ``init_process_group`` at all; every rank wraps the model (nothing else).

Each rank that ends with an exception prints ``ENDED <rank> <class>: <message>`` and exits 1.
"""

from __future__ import annotations

import datetime
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

import shardwrap.checkpoint.save
from shardwrap import ShardedModule, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.launch import say
from tests.support.models import GPT, Block, make_batch

BACKGROUND_STEPS = 200  # steps every rank trains while a non-blocking save writes


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, step: int, rank: int, clip: bool = False
) -> None:
    idx, targets = make_batch(step, 4)
    model(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
    if clip:
        model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def run(case: str, work: Path, rank: int, timeout: datetime.timedelta) -> None:
    torch.manual_seed(0)
    model = ShardedModule(GPT(), auto_wrap=Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(2):
        _step(model, opt, step, rank)
    save_checkpoint(work / "ckpt" / "step-2", model, opt, step=2)
    full = model.full_state_dict(rank0_only=True)
    if rank == 0:
        torch.save(full, work / "expected.pt")
    block = model.blocks[1]
    faulty = rank == (0 if case in ("skip-batch", "kill-background-commit") else 1)
    if faulty and case == "kill-forward":
        block.register_forward_pre_hook(lambda m, a: _die())
    elif faulty and case == "kill-backward":

        def die_in_backward(m: torch.nn.Module, a: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: _die())

        block.register_forward_hook(die_in_backward)
    elif faulty and case == "kill-save":
        write = SafetensorsWriter.write

        def write_then_die(self: SafetensorsWriter, tensor: torch.Tensor) -> None:
            write(self, tensor)
            self._file.flush()
            _die()

        SafetensorsWriter.write = write_then_die  # type: ignore[method-assign]
        save_checkpoint(work / "ckpt" / "step-2", model, opt, step=2)
    elif faulty and case == "kill-background-write":
        write = SafetensorsWriter.write

        def write_in_background_then_die(self: SafetensorsWriter, tensor: torch.Tensor) -> None:
            write(self, tensor)
            if self.path.name.startswith("rank-"):
                self._file.flush()
                _die()

        SafetensorsWriter.write = write_in_background_then_die  # type: ignore[method-assign]
    elif faulty and case == "kill-background-commit":
        shardwrap.checkpoint.save.commit_folder = lambda tmp, target: _die()
    elif faulty and case == "stall":
        time.sleep(600)
    elif faulty and case == "freeze":
        resume = f"sleep {int(3 * timeout.total_seconds())}; kill -CONT {os.getpid()}"
        subprocess.Popen(["sh", "-c", resume], start_new_session=True)

        def freeze_in_backward(m: torch.nn.Module, a: object, out: torch.Tensor) -> None:
            out.register_hook(lambda g: os.kill(os.getpid(), signal.SIGSTOP))

        block.register_forward_hook(freeze_in_backward)
    elif faulty and case == "desync-save":
        save_checkpoint(work / "ckpt" / "again", model, opt, step=2)
    elif faulty and case == "desync-clip":
        idx, targets = make_batch(7, 2)
        model(idx, targets).backward()
    elif faulty and case == "skip-batch":

        def out_of_memory(m: torch.nn.Module, a: object) -> None:
            raise torch.OutOfMemoryError("simulated: out of memory")

        handle = block.register_forward_pre_hook(out_of_memory)
        try:
            _step(model, opt, 2, rank)
        except torch.OutOfMemoryError:
            opt.zero_grad()
        handle.remove()
    if case == "kill-save":
        save_checkpoint(work / "ckpt" / "step-2", model, opt, step=2)
    steps = 3
    if case.startswith("kill-background"):
        save_checkpoint(work / "ckpt" / "step-3", model, opt, blocking=False, step=3)
        # Train on well past the time the writer thread (at a lower priority) needs to reach
        # its fault, so that the rank dies while training goes on, not in its exit's wait.
        steps = BACKGROUND_STEPS
    for step in range(2, 2 + steps):
        _step(model, opt, step, rank, clip=case == "desync-clip")


def _wait_for_every_rank(work: Path, rank: int, limit_s: float = 60.0) -> None:
    """Stay alive until every rank has ended (marker files; there is no group to wait on):
    torchrun stops the other ranks as soon as one exits, before a slower one could raise."""
    (work / f"ended-{rank}").touch()
    world = int(os.environ["WORLD_SIZE"])
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if all((work / f"ended-{r}").exists() for r in range(world)):
            return
        time.sleep(0.05)


def main(case: str, work: str, timeout_s: str) -> None:
    rank = int(os.environ["RANK"])
    try:
        if case == "no-group":
            ShardedModule(GPT(), auto_wrap=Block)
        else:
            timeout = datetime.timedelta(seconds=float(timeout_s))
            dist.init_process_group("gloo", timeout=timeout)
            run(case, Path(work), rank, timeout)
    except Exception as e:
        traceback.print_exc()
        say(f"ENDED {rank} {type(e).__name__}: {e}")
        if case == "no-group":
            _wait_for_every_rank(Path(work), rank)
        sys.exit(1)
    say(f"ENDED {rank} normally")


if __name__ == "__main__":
    main(*sys.argv[1:4])
