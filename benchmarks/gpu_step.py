"""The 101M GPT's training step on one GPU at world size 1: shardwrap against the plain model and
FSDP2, with and without their host-memory offload.

    python benchmarks/gpu_step.py OUT.json                      # what make gpu-check runs
    python benchmarks/gpu_step.py OUT.json --precisions bf16 --rounds 3 --steps 10

The model is ``examples/train_gpt.py``'s 101M GPT of the CPU comparisons (8 blocks of width
1024, 16 heads, bytes), fed a GPU's batch (8 sequences of 1024 bytes) rather than their 2 x 64.
Every method trains it from the same weights with torch's ``AdamW(lr=1e-4)`` as a user builds
it (its defaults: foreach on the GPU, shardwrap's fused kernel on the host tier's CPU shards,
a loop over FSDP2's CPU shards), all in one process:

- ``plain``: the model on the GPU, unwrapped;
- ``shardwrap``: ``ShardedModule(model, auto_wrap=Block, process_group=Mesh())``, world size 1
  with no process group, the path of ``python train.py`` (the goal: within 3% of ``plain``);
- ``shardwrap-nccl``: the same over a default NCCL group of one rank, the path of ``torchrun
  --nproc_per_node=1``;
- ``shardwrap-host``: the host tier, ``Offload(device="cpu")``;
- ``fsdp2``: ``fully_shard`` on every block and the root over a mesh of one rank;
- ``fsdp2-offload``: the same with ``offload_policy=CPUOffloadPolicy()``.

bf16 is mixed precision on fp32 master weights: shardwrap's ``MixedPrecision(bfloat16,
reduce_dtype=float32)``, FSDP2's ``MixedPrecisionPolicy`` alike, ``plain`` under
``torch.autocast``; the loss in fp32. fp32 matrix products keep torch's default precision (no
TF32).

A step is forward, backward and the optimizer step, timed between two
``torch.cuda.synchronize()``; its time is the median over the rounds' timed steps (methods
alternate within each round). Peak is ``torch.cuda.max_memory_allocated`` from just before the
method's model is moved or wrapped to its last step, above what was allocated then. Every
method's first loss is recorded: they start from the same weights and batch, so equal first
losses say they train the same model. On a machine without a GPU it writes a result saying so.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
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

METHODS = ("plain", "shardwrap", "shardwrap-nccl", "shardwrap-host", "fsdp2", "fsdp2-offload")
PRECISIONS = ("fp32", "bf16")
GOAL = 1.03  # shardwrap's step against the plain model's, at most


@dataclass(frozen=True)
class Config:
    """What every method trains."""

    width: int = 1024
    depth: int = 8
    heads: int = 16
    context: int = 1024
    batch: int = 8
    warmup: int = 3
    steps: int = 8
    rounds: int = 2
    lr: float = 1e-4


@dataclass
class Trainer:
    """A method's model, its optimizer, and the autocast its forward runs under."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]


def build(
    method: str, model: nn.Module, precision: str, cfg: Config, device: torch.device
) -> Trainer:
    """``model`` (on the CPU) set up as ``method`` trains it on ``device``."""
    bf16 = precision == "bf16"
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if method == "plain":
        model = model.to(device)
        if bf16:
            autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731
    elif method.startswith("shardwrap"):
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = ShardedModule(
            model,
            auto_wrap=Block,
            device=device,
            process_group=None if method == "shardwrap-nccl" else Mesh(),
            offload=Offload(device="cpu") if method == "shardwrap-host" else None,
            mixed_precision=mixed if bf16 else None,
        )
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (1,))
        kwargs: dict[str, Any] = {
            "mesh": mesh,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=torch.bfloat16 if bf16 else None,
                reduce_dtype=torch.float32 if bf16 else None,
            ),
        }
        if method == "fsdp2-offload":
            kwargs["offload_policy"] = CPUOffloadPolicy()
        else:
            model = model.to(device)
        for block in model.blocks:
            fully_shard(block, **kwargs)
        fully_shard(model, **kwargs)
    return Trainer(model, torch.optim.AdamW(model.parameters(), lr=cfg.lr), autocast)


def measure(
    method: str, source: nn.Module, precision: str, cfg: Config, device: torch.device
) -> dict[str, Any]:
    """Train a copy of ``source`` with ``method``: its timed steps' seconds, its peak bytes
    above the start (on a GPU), its first and last loss."""
    gc.collect()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    trainer = build(method, copy.deepcopy(source), precision, cfg, device)
    gen = torch.Generator().manual_seed(0)
    times, losses = [], []
    for step in range(cfg.warmup + cfg.steps):
        tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen).to(device)
        _sync(device)
        t0 = time.perf_counter()
        with trainer.autocast():
            logits = trainer.model(tokens[:, :-1])  # (B, T, 256)
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        trainer.optimizer.step()
        trainer.optimizer.zero_grad()
        _sync(device)
        if step >= cfg.warmup:
            times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() - before if cuda else None
    del trainer
    return {"step_times": times, "peak_bytes": peak, "losses": [losses[0], losses[-1]]}


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that wall time covers it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(
    cfg: Config,
    precisions: list[str],
    methods: list[str],
    limit_s: float,
    device: torch.device,
) -> dict[str, Any]:
    """Every method at every precision on ``device``, alternating within rounds; a round not
    started within ``limit_s`` seconds is left out (the result says how many ran). The default
    group of one rank is NCCL's on a GPU, gloo's on the CPU."""
    torch.manual_seed(0)
    source = GPT(width=cfg.width, depth=cfg.depth, heads=cfg.heads, context=cfg.context)
    params = sum(p.numel() for p in source.parameters())
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may resolve nowhere
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        results, rounds = _rounds(cfg, precisions, methods, limit_s, device, source)
    finally:
        dist.destroy_process_group()
    for by_method in results.values():
        for entry in by_method.values():
            if entry["step_times"]:
                entry["step_s"] = statistics.median(entry["step_times"])
                entry["tokens_per_s"] = cfg.batch * cfg.context / entry["step_s"]
    return {
        "params": params,
        "config": asdict(cfg),
        "rounds": rounds,
        "results": results,
    }


def _rounds(
    cfg: Config,
    precisions: list[str],
    methods: list[str],
    limit_s: float,
    device: torch.device,
    source: nn.Module,
) -> tuple[dict[str, dict[str, dict[str, Any]]], int]:
    """Each precision's results by method, and how many rounds ran."""
    start = time.monotonic()
    results: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in precisions}
    rounds = 0
    for _ in range(cfg.rounds):
        if rounds and time.monotonic() - start > limit_s:
            break
        rounds += 1
        for precision in precisions:
            for method in methods:
                entry = results[precision].setdefault(method, {"step_times": []})
                if "error" in entry:
                    continue
                try:
                    got = measure(method, source, precision, cfg, device)
                except Exception as e:  # reported by name; the other methods go on
                    entry["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"
                    continue
                entry["step_times"] += got["step_times"]
                entry["peak_bytes"] = max(entry.get("peak_bytes") or 0, got["peak_bytes"] or 0)
                entry["losses"] = got["losses"]
    return results, rounds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the JSON result")
    p.add_argument("--precisions", nargs="+", choices=PRECISIONS, default=list(PRECISIONS))
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--rounds", type=int, default=Config.rounds)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--limit-s", type=float, default=120.0, help="start no round after this")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        result: dict[str, Any] = {"skipped": "needs a CUDA GPU (torch.cuda.is_available() false)"}
    else:
        cfg = Config(rounds=args.rounds, steps=args.steps)
        device = torch.device("cuda", torch.cuda.current_device())
        result = run(cfg, args.precisions, args.methods, args.limit_s, device)
    args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
