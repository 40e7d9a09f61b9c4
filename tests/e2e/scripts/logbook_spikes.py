"""Train the same small GPT twice under torchrun with a Logbook: once on clean data, once with
corrupted batches at known data positions. Launched by tests/e2e/test_logbook_torchrun.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/logbook_spikes.py OUT STEPS BAD...

Writes ``OUT/clean`` and ``OUT/bad``: each run folder's logbook, plots and checkpoints, and
``eval.json``, the final model's loss on held-out batches (the same for both runs). AdamW's
learning rate follows a cosine from 1e-2 to 1e-3, set by the loop every step as users do.
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from shardwrap import ShardedModule
from shardwrap.logbook import Logbook, Spikes
from tests.support.models import GPT, Block
from tests.support.stream import CONTEXT, VOCAB, stream


def train(base: GPT, folder: Path, steps: int, bad: frozenset[int]) -> None:
    rank = dist.get_rank()
    model = ShardedModule(copy.deepcopy(base), auto_wrap=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Logbook(folder, model, opt, save_every=40, spikes=Spikes(lr_recover=20)) as book:
        for step in book.steps(steps):
            for group in opt.param_groups:
                group["lr"] = 1e-3 + 9e-3 * 0.5 * (1 + math.cos(math.pi * step / steps))
            x, y = stream(book.position, rank, bad)
            loss = model(x, y)
            loss.backward()
            book.step(loss, tokens=x.numel())
    with torch.no_grad():  # positions far past any the runs train on
        held_out = torch.stack([model(*stream(10**6 + i, rank)) for i in range(8)]).mean()
    dist.all_reduce(held_out)
    if rank == 0:
        (folder / "eval.json").write_text(
            json.dumps({"loss": held_out.item() / dist.get_world_size()})
        )


def main(out: str, steps: str, *bad: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    base = GPT(vocab=VOCAB, context=CONTEXT)
    train(base, Path(out) / "clean", int(steps), frozenset())
    train(base, Path(out) / "bad", int(steps), frozenset(int(b) for b in bad))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
