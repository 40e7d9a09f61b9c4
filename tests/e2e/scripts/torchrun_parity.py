"""Train a small GPT under torchrun with shardwrap and with a plain copy; write both results.

Launched by tests/e2e/test_torchrun.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/torchrun_parity.py OUT.json [WRAPS]

WRAPS: a JSON list of cases, each run in turn in the same processes (a launch costs more than a
case) and each one's result written to OUT.json's list in order; a case is extra
``ShardedModule`` keyword arguments, e.g. '[{}, {"compile": true}]' (default '[{}]'). The key
``"hybrid": [R, S]`` shards over a ``DeviceMesh`` of R replicas of S ranks, dimensions
``("replicate", "shard")``; the script first checks that a mesh with its dimensions swapped is
refused, and records the error. The key ``"optimizer"``: ``"muon"`` (Muon for the matrices,
AdamW for the rest) or ``"adafactor"`` instead of SGD; the reference then accumulates its
gradient over the ranks' slices (their summation order: Muon's bf16 Newton-Schulz iteration
amplifies rounding). The key ``"torch_compile"``: a ``torch.compile`` backend the wrapped
model is compiled with after wrapping (``model = torch.compile(model, backend=...)``). The key
``"compile_step"``: a backend the whole training step, forward and ``loss.backward()``, is
compiled with (the sharding's backward hooks then run inside the compiled function's frame).
"""

from __future__ import annotations

import copy
import json
import sys
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.parity import slice_summed_grads

STEPS = 4


def main(out_path: str, wraps: list[dict]) -> None:
    dist.init_process_group("gloo")
    results = [case(dict(wrap)) for wrap in wraps]
    if dist.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def case(wrap: dict) -> dict[str, Any] | None:
    """Train one case from the same seed as a launch of its own would; rank 0's result."""
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
    optimizer = wrap.pop("optimizer", "sgd")
    backend = wrap.pop("torch_compile", None)
    step_backend = wrap.pop("compile_step", None)
    model = ShardedModule(base, auto_wrap=Block, **wrap)
    run = model if backend is None else torch.compile(model, backend=backend)

    def forward_backward(idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = run(idx, targets)
        loss.backward()
        return loss

    train = (
        forward_backward
        if step_backend is None
        else torch.compile(forward_backward, backend=step_backend)
    )
    opt, ref_opt = _optimizer(optimizer, model), _optimizer(optimizer, reference)
    losses, ref_losses = [], []
    for step in range(STEPS):
        idx, targets = make_batch(step, 2 * world)
        loss = train(idx.chunk(world)[rank], targets.chunk(world)[rank])
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        if optimizer == "sgd":
            ref_loss = reference(idx, targets)
            ref_loss.backward()
        else:
            ref_loss = slice_summed_grads(reference, _loss, idx, targets, world)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    full = model.full_state_dict(rank0_only=True)
    if rank != 0:
        return None
    ref_sd = reference.state_dict()
    return {
        "world_size": world,
        "losses": losses,
        "reference_losses": ref_losses,
        "max_param_diff": max((full[k] - ref_sd[k]).abs().max().item() for k in ref_sd),
        "keys_match": list(full) == list(ref_sd),
        "refused": refused,
    }


class _Both:
    """Two optimizers stepped as one."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()


def _optimizer(name: str, model: torch.nn.Module) -> Any:
    params = list(model.parameters())
    if name == "muon":
        return _Both(
            torch.optim.Muon([p for p in params if p.ndim == 2]),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
        )
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2)
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _loss(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return model(idx, targets)


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else [{}])
