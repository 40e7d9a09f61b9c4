"""Train a small GPT under torchrun with compressed communication, checking every step.

Launched by tests/e2e/test_torchrun.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/torchrun_compression.py OUT.json

Stage 3 over the default group, int8 parameter gathers and int8 gradient reductions with error
feedback; ``tests/support/compression.py``'s checks run on every rank (decoded forward weights
bit for bit, gradients within the per-block bounds, exact master weights). Rank 0 writes the
byte counts of a compressed and an uncompressed step.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist

from shardwrap import Compression, ShardedModule
from tests.support.compression import train_checked
from tests.support.models import GPT, Block, make_batch


def main(out_path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(depth=2)
    compression = Compression(params="int8", grads="int8")
    train_checked(model, rank, world, None, compression, check_grads="first", stage=3)
    nbytes = {}
    for name, option in (("int8", compression), ("exact", None)):
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, stage=3, compression=option)
        x, y = make_batch(seed=0, batch=2 * world)
        m(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        nbytes[name] = dict(m.comm_stats.bytes)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"world_size": world, "bytes": nbytes}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
