"""Start a non-blocking save whose writer is slowed down, then let the interpreter exit at once.

Launched by tests/e2e/test_checkpoint.py: ``python tests/e2e/scripts/checkpoint_at_exit.py DIR``.
World size 1 (no process group). Prints ``pending`` when the main thread ends with the write
still running; the exit must then wait for it, leaving ``DIR/step-1`` complete and ``latest`` on it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from shardwrap import ShardedModule, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.models import GPT, Block

write = SafetensorsWriter.write


def slow_write(self: SafetensorsWriter, tensor: torch.Tensor) -> None:
    time.sleep(0.05)
    write(self, tensor)


SafetensorsWriter.write = slow_write  # type: ignore[method-assign]
torch.manual_seed(5)
model = ShardedModule(GPT(width=48, depth=2), auto_wrap=Block)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
torch.save(model.full_state_dict(), Path(sys.argv[1]) / "expected.pt")
pending = save_checkpoint(Path(sys.argv[1]) / "step-1", model, opt, blocking=False, step=1)
print("pending" if not pending.done() else "done", flush=True)
