"""Save a checkpoint, then stall half-way through a second save so that the test can kill us.

    python tests/e2e/scripts/checkpoint_killed.py FOLDER

Writes ``FOLDER/step-1`` (complete) and ``FOLDER/expected.pt`` (its full state dict), then
starts ``FOLDER/step-2``, prints ``writing`` once the first tensor of it is on disk, and
sleeps until killed. Used by ``tests/e2e/test_checkpoint.py``.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from shardwrap import ShardedModule, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.models import GPT, Block, make_batch


def main(folder: Path) -> None:
    torch.manual_seed(4)
    model = ShardedModule(GPT(width=96, depth=4), auto_wrap=Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    idx, targets = make_batch(0, 4)
    model(idx, targets).backward()
    opt.step()
    save_checkpoint(folder / "step-1", model, opt, keep_last=1, step=1)
    torch.save(model.full_state_dict(), folder / "expected.pt")
    model(idx, targets).backward()
    opt.step()

    write = SafetensorsWriter.write

    def stall(self: SafetensorsWriter, tensor: torch.Tensor) -> None:
        write(self, tensor)
        self._file.flush()
        print("writing", flush=True)
        time.sleep(600)

    SafetensorsWriter.write = stall  # type: ignore[method-assign]
    save_checkpoint(folder / "step-2", model, opt, keep_last=1, step=2)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
