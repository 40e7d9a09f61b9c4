"""Train a small GPT under torchrun with shardwrap and with a plain copy; write both results.

Launched by tests/e2e/test_torchrun.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/torchrun_parity.py OUT.json [WRAP]

WRAP: extra ``ShardedModule`` keyword arguments as JSON, e.g. '{"compile": true}'. The key
``"hybrid": [R, S]`` shards over a ``DeviceMesh`` of R replicas of S ranks, dimensions
``("replicate", "shard")``; the script first checks that a mesh with its dimensions swapped is
refused, and records the error.
"""

from __future__ import annotations

import copy
import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, make_batch

STEPS = 4


def main(out_path: str, wrap: dict) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = GPT()
    reference = copy.deepcopy(base)
    refused = None
    if "hybrid" in wrap:
        shape = tuple(wrap.pop("hybrid"))
        try:
            swapped = init_device_mesh("cpu", shape, mesh_dim_names=("shard", "replicate"))
            ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=swapped)
        except ValueError as e:
            refused = str(e)
        wrap["process_group"] = init_device_mesh(
            "cpu", shape, mesh_dim_names=("replicate", "shard")
        )
    model = ShardedModule(base, auto_wrap=Block, **wrap)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(STEPS):
        idx, targets = make_batch(step, 2 * world)
        loss = model(idx.chunk(world)[rank], targets.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        ref_loss = reference(idx, targets)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = model.full_state_dict(rank0_only=True)
    if rank == 0:
        ref_sd = reference.state_dict()
        diff = max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd)
        result = {
            "world_size": world,
            "losses": losses,
            "reference_losses": ref_losses,
            "max_param_diff": diff,
            "keys_match": list(full) == list(ref_sd),
            "refused": refused,
        }
        with open(out_path, "w") as f:
            json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
