"""A sharded model saved and loaded with ``torch.distributed.checkpoint`` (DCP), as a user of it
(Lightning's ``ModelParallelStrategy``, torchtitan, accelerate) does.

Launched by tests/e2e/test_dcp.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/dcp_round_trip.py OUT

For each case (a stage, an offload tier, an optimizer, a way to save): a tiny GPT trains 2
steps, is saved, and trains 2 more (the uninterrupted run); a fresh model and optimizer load the
save and train the same 2 steps. Each rank's batches come from a generator seeded by the step
and the rank. Rank 0 writes ``OUT/result.json``, per case: how far the loaded model and
optimizer state are from the state at the save (their full state dicts, max abs difference),
how far ``dcp_to_torch_save`` of the save is from ``full_state_dict()``, and how far the resumed
run's losses and final state are from the uninterrupted run's. And, under ``refused``, what
DCP says when given ``model.state_dict()`` instead of ``get_model_state_dict(model)``, to save
and to stage for ``async_save``.
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

import shardwrap
from shardwrap import Offload, ShardedModule
from tests.support.models import GPT, Block, make_batch

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
BASE = GPT(width=36, depth=2)  # every rank alike: the seed is the same

Optimizers = list[torch.optim.Optimizer]


def adamw(params: list[nn.Parameter]) -> Optimizers:
    return [torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)]


def muon_adamw(params: list[nn.Parameter]) -> Optimizers:
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=2e-2),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
    ]


def sgd_momentum(params: list[nn.Parameter]) -> Optimizers:
    return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]  # buffers made from the gradients


def adagrad(params: list[nn.Parameter]) -> Optimizers:
    return [torch.optim.Adagrad(params, lr=0.1)]  # sums made by its constructor


def adafactor(params: list[nn.Parameter]) -> Optimizers:
    return [torch.optim.Adafactor(params, lr=1e-2)]


def wrap(stage: int, disk: bool, tag: str) -> nn.Module:
    offload = Offload(device="disk", path=out / f"store-{tag}-{rank}") if disk else None
    return ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, stage=stage, offload=offload)


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


def full_state(model: nn.Module, optimizers: Optimizers) -> dict[str, Tensor]:
    """The model's and the optimizers' whole state, flat, by name (every rank calls it)."""
    state = {f"model.{k}": v for k, v in model.full_state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for i, optimizer in enumerate(optimizers):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        full = shardwrap.full_optimizer_state_dict(model, optimizer)
        for index, entry in full["state"].items():
            for key, value in entry.items():
                state[f"optim{i}.{names[id(params[index])]}.{key}"] = torch.as_tensor(value)
    return state


def distance(a: dict[str, Tensor], b: dict[str, Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel())


def dcp_state(model: nn.Module, optimizers: Optimizers) -> dict[str, Any]:
    return {
        "model": get_model_state_dict(model),
        "optim": get_optimizer_state_dict(model, optimizers),
    }


def by_save(state: dict[str, Any], path: Path) -> None:
    dcp.save(state, checkpoint_id=path)


def by_async_default_stager(state: dict[str, Any], path: Path) -> None:
    dcp.async_save(state, checkpoint_id=path).result()


def by_async_writer_stager(state: dict[str, Any], path: Path) -> None:
    dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path)).result()


SAVES: dict[str, Callable[[dict[str, Any], Path], None]] = {
    "save": by_save,
    "async_save": by_async_default_stager,
    "async_save_writer": by_async_writer_stager,
}
CASES = [  # stage, disk tier, optimizers, save
    (1, False, adamw, "save"),
    (2, False, adamw, "async_save_writer"),
    (3, False, adamw, "async_save"),
    (3, True, adamw, "save"),
    (3, False, muon_adamw, "async_save_writer"),
    (2, False, adafactor, "save"),
    (3, True, adafactor, "async_save"),
    (3, False, muon_adamw, "stateful"),  # dcp.save({"model": model, ...}): the model itself
    (2, False, sgd_momentum, "save"),
    (3, False, adagrad, "async_save"),
]


def run_case(stage: int, disk: bool, make: Callable, save: str) -> dict[str, float]:
    tag = f"{stage}-{disk}-{make.__name__}-{save}"
    path = out / tag
    model = wrap(stage, disk, tag)
    optimizers = make(list(model.parameters()))
    train(model, optimizers, range(2))
    at_save = full_state(model, optimizers)
    if save == "stateful":  # the model itself; a fresh optimizer's own state_dict() is empty
        dcp.save(
            {"model": model, "optim": dcp_state(model, optimizers)["optim"]}, checkpoint_id=path
        )
    else:
        SAVES[save](dcp_state(model, optimizers), path)
    expected_losses = train(model, optimizers, range(2, 4))
    expected = full_state(model, optimizers)

    fresh = wrap(stage, disk, tag + "-fresh")
    fresh_optimizers = make(list(fresh.parameters()))
    state = dcp_state(fresh, fresh_optimizers)
    if save == "stateful":
        state["model"] = fresh
    dcp.load(state, checkpoint_id=path)
    if save != "stateful":
        set_model_state_dict(fresh, state["model"])
    set_optimizer_state_dict(fresh, fresh_optimizers, state["optim"])
    result = {"loaded": distance(full_state(fresh, fresh_optimizers), at_save)}
    losses = train(fresh, fresh_optimizers, range(2, 4))
    result["losses"] = max(abs(a - b) for a, b in zip(losses, expected_losses))
    result["resumed"] = distance(full_state(fresh, fresh_optimizers), expected)
    if rank == 0:
        dcp_to_torch_save(path, out / f"{tag}.pt")
        saved = torch.load(out / f"{tag}.pt", weights_only=True)["model"]
        plain = {k[len("model.") :]: v for k, v in at_save.items() if k.startswith("model.")}
        result["dcp_to_torch_save"] = distance(saved, plain)
    return result


def converted() -> dict[str, float]:
    """docs/dcp.md's converters: a shardwrap checkpoint to DCP (``load_checkpoint``, then
    ``dcp.save``) and back (``dcp.load``, then ``save_checkpoint``); how far each is from the
    state saved, loaded into a fresh model."""
    model = wrap(3, False, "converted")
    optimizers = muon_adamw(list(model.parameters()))
    train(model, optimizers, range(2))
    at_save = full_state(model, optimizers)
    shardwrap.save_checkpoint(out / "shardwrap-ckpt", model, optimizers)

    model = wrap(3, False, "converted-to-dcp")
    optimizers = muon_adamw(list(model.parameters()))
    shardwrap.load_checkpoint(out / "shardwrap-ckpt", model, optimizers)
    dcp.save(dcp_state(model, optimizers), checkpoint_id=out / "converted-dcp")

    model = wrap(3, False, "converted-from-dcp")
    optimizers = muon_adamw(list(model.parameters()))
    state = dcp_state(model, optimizers)
    dcp.load(state, checkpoint_id=out / "converted-dcp")
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, optimizers, state["optim"])
    result = {"to_dcp": distance(full_state(model, optimizers), at_save)}
    shardwrap.save_checkpoint(out / "converted-back", model, optimizers)

    model = wrap(3, False, "converted-back")
    optimizers = muon_adamw(list(model.parameters()))
    shardwrap.load_checkpoint(out / "converted-back", model, optimizers)
    result["back"] = distance(full_state(model, optimizers), at_save)
    return result


def refusals() -> dict[str, str]:
    """What DCP meets in a sharded model's own ``state_dict()``: this rank's pieces, to save,
    to stage and to load into (the first case's checkpoint)."""
    model = wrap(3, False, "refused")
    first = out / "-".join(map(str, (CASES[0][0], CASES[0][1], CASES[0][2].__name__, CASES[0][3])))
    attempts = {
        "save": lambda: by_save({"model": model.state_dict()}, out / "refused-save"),
        "async_save_writer": lambda: by_async_writer_stager(
            {"model": model.state_dict()}, out / "refused-async"
        ),
        "load": lambda: dcp.load({"model": model.state_dict()}, checkpoint_id=first),
    }
    said = {}
    for name, attempt in attempts.items():
        try:
            attempt()
        except (CheckpointException, TypeError) as e:  # DCP gathers every rank's errors
            said[name] = str(e)
    return said


results = {"::".join(map(str, (s, d, m.__name__, v))): run_case(s, d, m, v) for s, d, m, v in CASES}
result = {"cases": results, "converted": converted(), "refused": refusals()}
if rank == 0:
    (out / "result.json").write_text(json.dumps(result, indent=1))
dist.barrier()
dist.destroy_process_group()
