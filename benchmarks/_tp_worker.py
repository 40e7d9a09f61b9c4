"""One run of ``benchmarks/tensor_parallel.py``: build the GPT, parallelize and wrap it with one
method, train, measure. Runs under torchrun (one process per rank); rank 0 prints one JSON line.

    torchrun --standalone --nproc_per_node=4 benchmarks/_tp_worker.py shardwrap-tp '{"depth": 2}'

Methods, every one on the same global batch of each step, each dp rank on its slice:

- ``shardwrap-tp``: ``parallelize_module`` on ``mesh["tp"]`` of a ``("dp", "tp")`` mesh with
  ``examples/train_gpt_tp.py``'s plan, then ``ShardedModule(model, process_group=mesh,
  auto_wrap=Block)``;
- ``fsdp2-tp``: the same tensor parallelism, then ``fully_shard(block, mesh=mesh["dp"])`` on every
  block and on the root (FSDP2's 2-D recipe);
- ``shardwrap-dp``: ``ShardedModule(model, auto_wrap=Block)`` over every rank, no tensor
  parallelism.

Bytes per step are the buffers handed to collectives, by axis: over dp, shardwrap's own count
(``comm_stats``, its handshakes over every rank apart) or FSDP2's all-gathers and
reduce-scatters (``torch.distributed``'s); over tp, DTensor's functional collectives
(all-reduce: the tensor, all-gather: its output, reduce-scatter: its input). Memory and step
times as ``benchmarks/_worker.py`` takes them.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _launch import end_ranks  # noqa: E402  (this folder, as the script's)
from _worker import ByteCounter, peak_mb, rss_mb  # noqa: E402

from examples.train_gpt import GPT, Block  # noqa: E402
from examples.train_gpt_tp import tp_plan  # noqa: E402
from shardwrap import ShardedModule  # noqa: E402

METHODS = ("shardwrap-tp", "fsdp2-tp", "shardwrap-dp")


@dataclass(frozen=True)
class Config:
    """The 101M GPT of ``benchmarks/compare.py`` at a global batch of 8 (2 per rank at dp=4)."""

    depth: int = 8
    width: int = 1024
    heads: int = 16
    context: int = 64
    global_batch: int = 8
    tp: int = 2
    warmup: int = 2
    steps: int = 4
    lr: float = 1e-4
    seed: int = 0


class TPBytes:
    """Counts the bytes DTensor hands to its functional collectives while installed."""

    def __init__(self) -> None:
        self.bytes = 0

    def install(self) -> None:
        def wrap(name: str, output: bool) -> None:
            original = getattr(funcol, name)

            def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                out = original(tensor, *args, **kwargs)
                counted_as = out if output else tensor  # an all-gather counts its output
                self.bytes += counted_as.numel() * counted_as.element_size()
                return out

            setattr(funcol, name, counted)

        wrap("all_reduce", output=False)
        wrap("reduce_scatter_tensor", output=False)
        wrap("all_to_all_single", output=False)
        wrap("all_gather_tensor", output=True)


def build(method: str, cfg: Config) -> tuple[nn.Module, Any]:
    """The wrapped model and this rank's dp coordinate ``(index, count)``."""
    torch.manual_seed(cfg.seed)
    model = GPT(vocab=256, width=cfg.width, heads=cfg.heads, depth=cfg.depth, context=cfg.context)
    world = dist.get_world_size()
    if method == "shardwrap-dp":
        return ShardedModule(model, auto_wrap=Block), (dist.get_rank(), world)
    mesh = init_device_mesh("cpu", (world // cfg.tp, cfg.tp), mesh_dim_names=("dp", "tp"))
    model = parallelize_module(model, mesh["tp"], tp_plan())
    where = (mesh.get_local_rank("dp"), world // cfg.tp)
    if method == "shardwrap-tp":
        return ShardedModule(model, process_group=mesh, auto_wrap=Block), where
    from torch.distributed.fsdp import fully_shard

    for module in model.modules():
        if isinstance(module, Block):
            fully_shard(module, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"]), where


def run(method: str, cfg: Config) -> dict[str, Any]:
    counter, tp_bytes = ByteCounter(), TPBytes()
    counter.install()
    tp_bytes.install()
    import torch._dynamo  # noqa: F401  (library code the optimizer imports: no method's memory)

    dist.barrier()
    rss_before = rss_mb("VmRSS")
    model, (index, count) = build(method, cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    times, losses = [], []
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            counter.bytes = tp_bytes.bytes = 0
            if method.startswith("shardwrap"):
                model.comm_stats.reset()
        gen = torch.Generator().manual_seed(cfg.seed + step)  # the same global batch everywhere
        tokens = torch.randint(256, (cfg.global_batch, cfg.context + 1), generator=gen)
        tokens = tokens.chunk(count)[index]
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        elapsed = torch.tensor([time.perf_counter() - t0])
        counter.paused = True  # the benchmark's own reductions are not the method's traffic
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        counter.paused = False
        losses.append(mean.item() / dist.get_world_size())
        if step >= cfg.warmup:
            times.append(elapsed.item())
    dp, control = counter.bytes, 0
    if method.startswith("shardwrap"):
        by_kind = model.comm_stats.bytes
        control = by_kind.get("handshake", 0)
        dp = sum(by_kind.values()) - control
    counter.paused = True
    peak = torch.tensor([peak_mb(torch.device("cpu"), rss_before)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "method": method,
        "world_size": dist.get_world_size(),
        "step_s": statistics.median(times),
        "step_times": times,
        "peak_mb_per_rank": peak.item(),
        "dp_bytes_per_step": dp / cfg.steps,
        "tp_bytes_per_step": tp_bytes.bytes / cfg.steps,
        "control_bytes_per_step": control / cfg.steps,
        "losses": losses,
        "config": asdict(cfg),
    }


def main() -> None:
    method = sys.argv[1]
    if method not in METHODS:
        raise SystemExit(f"unknown method {method!r}; choose from {METHODS}")
    cfg = Config(**json.loads(sys.argv[2])) if len(sys.argv) > 2 else Config()
    dist.init_process_group("gloo")
    result = run(method, cfg)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    end_ranks()


if __name__ == "__main__":
    main()
