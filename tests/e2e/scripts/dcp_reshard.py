"""Checkpoints of ``torch.distributed.checkpoint`` (DCP) saved on 2 ranks and loaded on 3: between
FSDP2 and shardwrap both ways (AdamW), and shardwrap's own with the shape-aware optimizers.

Launched by tests/e2e/test_dcp.py, first on 2 ranks, then on 3:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/dcp_reshard.py save OUT
    torchrun --standalone --nproc_per_node=3 tests/e2e/scripts/dcp_reshard.py load OUT

``save``: each saver (FSDP2, ``fully_shard`` on every block then the root, with AdamW; shardwrap,
``auto_wrap`` the blocks, with AdamW, with Muon over the matrices and AdamW over the rest, and
with Adafactor) trains a tiny GPT 2 steps from the same weights and saves model and optimizers
with ``dcp.save`` (``OUT/<saver>``), and their whole state as DCP's ``full_state_dict=True``
gives it (``OUT/<saver>-full.pt``, written by rank 0).

``load``: shardwrap loads FSDP2's checkpoint, FSDP2 shardwrap's, and shardwrap its own of Muon
and of Adafactor, with ``dcp.load`` and ``set_model_state_dict`` / ``set_optimizer_state_dict``,
and trains 2 more steps; beside it, the same framework at the same 3 ranks loads the saver's
whole state with ``full_state_dict=True`` and trains the same steps. Rank 0 writes
``OUT/result.json``, per pair: how far the loaded state is from the saver's whole state, and how
far the losses and the final state are from those of the run loaded from the whole state (max
abs difference). Each rank's batches come from a generator seeded by the step and the rank.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, make_batch

mode, out = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
BASE = GPT(width=36, depth=2)  # every rank alike: the seed is the same
WHOLE = StateDictOptions(full_state_dict=True)
Optimizers = list[torch.optim.Optimizer]
# saver -> (framework, optimizers); the loader of each pair is the framework named after "->"
SAVERS = {
    "fsdp2": ("fsdp2", "adamw"),
    "shardwrap": ("shardwrap", "adamw"),
    "shardwrap-muon": ("shardwrap", "muon"),
    "shardwrap-adafactor": ("shardwrap", "adafactor"),
}
PAIRS = [
    ("fsdp2", "shardwrap"),
    ("shardwrap", "fsdp2"),
    ("shardwrap-muon", "shardwrap"),
    ("shardwrap-adafactor", "shardwrap"),
]


def build(framework: str, kind: str) -> tuple[nn.Module, Optimizers]:
    model = copy.deepcopy(BASE)
    if framework == "fsdp2":
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    else:
        model = ShardedModule(model, auto_wrap=Block)
    params = list(model.parameters())
    if kind == "muon":
        return model, [
            torch.optim.Muon([p for p in params if p.ndim == 2], lr=2e-2),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
        ]
    if kind == "adafactor":
        return model, [torch.optim.Adafactor(params, lr=1e-2)]
    return model, [torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)]


def train(model: nn.Module, optimizers: Optimizers, steps: range) -> list[float]:
    losses = []
    for step in steps:
        idx, targets = make_batch(seed=100 * step + rank, batch=2)
        loss = model(idx, targets)
        loss.backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def state_dicts(model: nn.Module, optimizers: Optimizers, **options: Any) -> dict[str, Any]:
    """DCP's view of model and optimizers (every rank calls it)."""
    options = {"options": StateDictOptions(**options)} if options else {}
    return {
        "model": get_model_state_dict(model, **options),
        "optim": get_optimizer_state_dict(model, optimizers, **options),
    }


def flat(state: Any, prefix: str = "") -> dict[str, Tensor]:
    """Every tensor of a nested state dict, by its path."""
    if isinstance(state, Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        return {k: v for key, val in state.items() for k, v in flat(val, f"{prefix}.{key}").items()}
    return {}


def distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def from_dcp(framework: str, kind: str, path: Path) -> tuple[nn.Module, Optimizers]:
    model, optimizers = build(framework, kind)
    state = state_dicts(model, optimizers)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizers, state["optim"])
    return model, optimizers


def from_whole(framework: str, kind: str, saved: dict[str, Any]) -> tuple[nn.Module, Optimizers]:
    model, optimizers = build(framework, kind)
    set_model_state_dict(model, saved["model"], options=WHOLE)
    set_optimizer_state_dict(model, optimizers, saved["optim"], options=WHOLE)
    return model, optimizers


if mode == "save":
    for saver, (framework, kind) in SAVERS.items():
        model, optimizers = build(framework, kind)
        train(model, optimizers, range(2))
        dcp.save(state_dicts(model, optimizers), checkpoint_id=out / saver)
        saved = state_dicts(model, optimizers, full_state_dict=True, cpu_offload=True)
        if rank == 0:
            torch.save(saved, out / f"{saver}-full.pt")
else:
    result = {}
    for saver, loader in PAIRS:
        kind = SAVERS[saver][1]
        saved = torch.load(out / f"{saver}-full.pt", weights_only=True)
        model, optimizers = from_dcp(loader, kind, out / saver)
        loaded = distance(flat(state_dicts(model, optimizers, full_state_dict=True)), flat(saved))
        losses = train(model, optimizers, range(2, 4))
        reference, reference_optimizers = from_whole(loader, kind, saved)
        expected = train(reference, reference_optimizers, range(2, 4))
        result[f"{saver} -> {loader}"] = {
            "loaded": loaded,
            "losses": max(abs(a - b) for a, b in zip(losses, expected)),
            "trained": distance(
                flat(state_dicts(model, optimizers, full_state_dict=True)),
                flat(state_dicts(reference, reference_optimizers, full_state_dict=True)),
            ),
        }
    if rank == 0:
        (out / "result.json").write_text(json.dumps(result, indent=1))
dist.barrier()
dist.destroy_process_group()
