"""The largest GPT that trains a step on this GPU with its training state in host memory:
shardwrap's host tier against FSDP2's ``CPUOffloadPolicy``, by depth at width 4096.

    python benchmarks/gpu_capacity.py shardwrap-host 4 OUT.json    # one trial, a process of its own

``gpu_check.py`` runs the search (:func:`search`) for each method within its share of the
run's time. The GPT is ``examples/train_gpt.py``'s at width 4096 (32 heads, bytes; 2 sequences
of 1024 per step), built on the meta device, so that no full copy is ever made on the host:

- ``shardwrap-host``: ``ShardedModule(model, auto_wrap=Block, device="cuda",
  offload=Offload(device="cpu"), mixed_precision=MixedPrecision(bfloat16, reduce_dtype=float32))``,
  materialised one block at a time on the GPU, its shards then in pinned host memory;
- ``fsdp2-offload``: ``fully_shard`` with ``MixedPrecisionPolicy`` alike and
  ``offload_policy=CPUOffloadPolicy()`` on every block and the root over a mesh of one rank,
  then ``to_empty(device="cpu")`` and each module's ``reset_parameters()``.

A trial trains two steps of ``AdamW(lr=1e-4)`` (its state on the host) and reports the second
step's time and tokens/s, the host's resident-set peak above the trial's start and the GPU's
``max_memory_allocated``. It fails where memory runs out (torch's ``OutOfMemoryError``, or the
kernel kills it: a trial asks to be the first to go, ``oom_score_adj`` 1000) or time does.

A block holds 201M parameters: with fp32 parameters, gradients and two AdamW moments at least
3.2 GB of host memory, while the GPU holds a few blocks at a time, so the host's memory sets
the depth. The search: trials at depths 1 and 3 measure what a block costs in host memory;
the next is at the depth that would fill 92% of the memory available at the start; then one
deeper after each success, or halfway between the deepest success and the shallowest failure
after a failure, until they are one apart (the edge) or the next trial would not end within
the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.train_gpt import GPT, Block  # noqa: E402
from shardwrap import Mesh, MixedPrecision, Offload, ShardedModule  # noqa: E402

METHODS = ("shardwrap-host", "fsdp2-offload")
FILL = 0.92  # of the host memory available at the start, for the first guess


@dataclass(frozen=True)
class Config:
    """The GPT's shape and each step's batch."""

    width: int = 4096
    heads: int = 32
    context: int = 1024
    batch: int = 2
    lr: float = 1e-4


def wrap(method: str, model: nn.Module, device: torch.device) -> nn.Module:
    """``model``, on the meta device, materialised and wrapped as ``method`` trains it."""
    if method == "shardwrap-host":
        return ShardedModule(
            model,
            auto_wrap=Block,
            device=device,
            process_group=Mesh(),
            offload=Offload(device="cpu"),
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        )
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    kwargs: dict[str, Any] = {
        "mesh": init_device_mesh(device.type, (1,)),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "offload_policy": CPUOffloadPolicy(),
    }
    for block in model.blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    return model


def trial(method: str, depth: int, cfg: Config, device: torch.device) -> dict[str, Any]:
    """Train two steps of ``method`` at ``depth``; what it cost, or why it failed."""
    rss_before = _status_bytes("VmRSS")
    with torch.device("meta"):
        model = GPT(width=cfg.width, depth=depth, heads=cfg.heads, context=cfg.context)
    params = sum(p.numel() for p in model.parameters())
    result: dict[str, Any] = {"depth": depth, "params": params, "rss_before": rss_before}
    try:
        t0 = time.perf_counter()
        model = wrap(method, model, device)
        result["build_s"] = time.perf_counter() - t0
        optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        gen = torch.Generator().manual_seed(0)
        times = []
        for _ in range(2):  # the first also makes the optimizer's state
            tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen).to(device)
            _sync(device)
            t0 = time.perf_counter()
            logits = model(tokens[:, :-1])  # (B, T, 256)
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            _sync(device)
            times.append(time.perf_counter() - t0)
    except torch.OutOfMemoryError as e:
        return {**result, "ok": False, "error": f"out of GPU memory: {_first_line(e)}"}
    except Exception as e:  # reported by name: a failure that is not memory is news
        return {**result, "ok": False, "error": f"{type(e).__name__}: {_first_line(e)}"}
    result.update(
        ok=True,
        first_step_s=times[0],
        step_s=times[1],
        tokens_per_s=cfg.batch * cfg.context / times[1],
        host_peak_bytes=_status_bytes("VmHWM") - rss_before,
    )
    if device.type == "cuda":
        result["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    return result


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__


def _status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def available_bytes() -> int:
    """The host memory available for new work (/proc/meminfo's MemAvailable), in bytes."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


Trial = Callable[[int, float], dict[str, Any]]  # (depth, seconds it may take) -> its result


def search(
    run_trial: Trial,
    budget_s: float,
    available: int,
    clock: Callable[[], float] = time.monotonic,
) -> dict[str, Any]:
    """The largest depth at which ``run_trial`` trains, within ``budget_s`` seconds.

    Each result of ``run_trial`` has ``ok``; with ``ok``, :func:`trial`'s ``rss_before``,
    ``host_peak_bytes``, ``build_s``, ``first_step_s`` and ``step_s``; ``cut`` where it ran out
    of its time. Depths 1 and 3 first: what a block costs in host memory and in time, apart
    from what any trial costs; then as the module docstring says, a trial only where its
    estimated time (the fixed cost, and the deepest success's time per block, with a fifth
    more) fits in what is left of the budget.

    Returns the trials in order (each with ``depth`` and ``wall_s``), the largest depth that
    trained (``None``: neither of the first two), and why the search stopped: ``"edge"`` (the
    depth after the largest failed), ``"budget"`` or ``"first trials failed"``.
    """
    start = clock()
    trials: list[dict[str, Any]] = []

    def attempt(depth: int) -> dict[str, Any]:
        began = clock()
        result = run_trial(depth, budget_s - (began - start))
        result.update(depth=depth, wall_s=clock() - began)
        trials.append(result)
        return result

    small, large = attempt(1), attempt(3)
    if not (small["ok"] and large["ok"]):
        good = 1 if small["ok"] else None
        return {"trials": trials, "largest": good, "stopped": "first trials failed"}
    per_block = max((large["host_peak_bytes"] - small["host_peak_bytes"]) / 2, 1.0)
    fixed_bytes = small["host_peak_bytes"] - per_block
    fixed_s = small["wall_s"] - _inner_s(small)
    good, bad = 3, None
    depth = max(4, int((FILL * available - large["rss_before"] - fixed_bytes) / per_block))
    stopped = "budget"
    while True:
        deepest = max((t for t in trials if t["ok"]), key=lambda t: t["depth"])
        needed = fixed_s + 1.2 * _inner_s(deepest) * depth / deepest["depth"]
        if needed > budget_s - (clock() - start):
            break
        result = attempt(depth)
        if result["ok"]:
            good = depth
        elif result.get("cut"):  # out of time, not of memory: nothing learnt of the depth
            break
        else:
            bad = depth
        if bad is not None and bad == good + 1:
            stopped = "edge"
            break
        depth = good + 1 if bad is None else (good + bad) // 2
    return {"trials": trials, "largest": good, "stopped": stopped}


def _inner_s(result: dict[str, Any]) -> float:
    """A successful trial's own time: building and two steps (not starting its process)."""
    return result["build_s"] + result["first_step_s"] + result["step_s"]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("method", choices=METHODS)
    p.add_argument("depth", type=int)
    p.add_argument("out", type=Path, help="the JSON result")
    p.add_argument("--width", type=int, default=Config.width)
    p.add_argument("--heads", type=int, default=Config.heads)
    args = p.parse_args(argv)
    with open("/proc/self/oom_score_adj", "w") as f:  # out of host memory, this goes first
        f.write("1000")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may resolve nowhere
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = Config(width=args.width, heads=args.heads)
    args.out.write_text(json.dumps({**trial(args.method, args.depth, cfg, device), **asdict(cfg)}))
    if dist.is_initialized():  # FSDP2's trial: an NCCL group left alive may hold up the exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
