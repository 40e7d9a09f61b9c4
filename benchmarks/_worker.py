"""One benchmark run: build the GPT, wrap it with one method, train, measure.

Runs under torchrun (one process per rank); rank 0 prints one JSON line with the result.

    torchrun --standalone --nproc_per_node=2 benchmarks/_worker.py shardwrap '{"width": 1024}'

Methods:

- ``shardwrap``: ``ShardedModule(model, auto_wrap=Block)``.
- ``fsdp2``: PyTorch's ``fully_shard`` on every block, then on the root.
- ``ddp``: ``DistributedDataParallel``.
- ``single``: an unsharded copy per rank with no communication at all (the compute floor).

Precisions (``"precision"`` in the config); every method keeps fp32 master weights and AdamW
state, and the loss is computed in fp32 from the logits:

- ``fp32``: everything in fp32.
- ``bf16``: shardwrap with ``MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)``,
  FSDP2 with ``MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`` on every
  ``fully_shard`` call, DDP and ``single`` under ``torch.autocast(dtype=bfloat16)`` around
  forward and loss.

Memory on CPU is the resident-set high-water mark above the resident set just before the
model was built; on GPU, ``max_memory_allocated`` and ``max_memory_reserved``. Bytes per
step count the buffers handed to collectives (all-gather output, reduce-scatter input,
all-reduce tensor), the same convention for every method.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples.train_gpt import GPT, Block  # noqa: E402
from shardwrap import MixedPrecision, ShardedModule  # noqa: E402

METHODS = ("shardwrap", "fsdp2", "ddp", "single")
PRECISIONS = ("fp32", "bf16")


@dataclass(frozen=True)
class Config:
    """What every method trains; defaults are the issue's reference configuration."""

    depth: int = 8
    width: int = 1024
    heads: int = 16
    context: int = 64
    batch: int = 2
    warmup: int = 2
    steps: int = 6
    lr: float = 1e-4
    seed: int = 0
    precision: str = "fp32"
    """``fp32``, or ``bf16``: bf16 compute on fp32 master weights, gradients reduced in fp32."""

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.precision!r}")


def rss_mb(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM), in MB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


class ByteCounter:
    """Counts bytes handed to torch.distributed's collectives while installed."""

    def __init__(self) -> None:
        self.bytes = 0
        self.calls = 0
        self.params = 0
        self.paused = False
        self._saved: dict[str, Callable[..., Any]] = {}

    def install(self) -> None:
        def wrap(name: str, size: Callable[..., int]) -> None:
            original = getattr(dist, name)
            self._saved[name] = original

            def counted(*args: Any, **kwargs: Any) -> Any:
                if not self.paused:
                    self.bytes += size(*args, *kwargs.values())
                    self.calls += 1
                return original(*args, **kwargs)

            setattr(dist, name, counted)

        nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
        wrap("all_gather_single", lambda out, *a: nbytes(out))
        wrap("all_gather_into_tensor", lambda out, *a: nbytes(out))
        wrap("reduce_scatter_single", lambda out, inp, *a: nbytes(inp))
        wrap("reduce_scatter_tensor", lambda out, inp, *a: nbytes(inp))
        wrap("all_reduce", lambda t, *a: nbytes(t))


def build(method: str, cfg: Config, device: torch.device, counter: ByteCounter) -> nn.Module:
    torch.manual_seed(cfg.seed)
    model = GPT(vocab=256, width=cfg.width, heads=cfg.heads, depth=cfg.depth, context=cfg.context)
    counter.params = sum(p.numel() for p in model.parameters())
    bf16 = cfg.precision == "bf16"
    if method == "shardwrap":
        mixed = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        return ShardedModule(
            model.to(device), auto_wrap=Block, mixed_precision=mixed if bf16 else None
        )
    if method == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        policy = MixedPrecisionPolicy(
            param_dtype=torch.bfloat16 if bf16 else None,
            reduce_dtype=torch.float32 if bf16 else None,
        )
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model.to(device), mesh=mesh, mp_policy=policy)
        return model
    if method == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(
            model.to(device), device_ids=[device] if device.type == "cuda" else None
        )

        def hook(state, bucket):  # noqa: ANN001, ANN202 (DDP inspects the real annotation)
            buf = bucket.buffer()  # counted by the ByteCounter's all_reduce
            buf.div_(dist.get_world_size())
            return dist.all_reduce(buf, async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, hook)
        return ddp
    if method == "single":
        return model.to(device)
    raise ValueError(f"unknown method {method!r}; choose from {METHODS}")


def run(method: str, cfg: Config) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    counter = ByteCounter()
    counter.install()
    dist.barrier()
    rss_before = rss_mb("VmRSS")
    model = build(method, cfg, device, counter)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    autocast = torch.autocast(
        device.type,
        dtype=torch.bfloat16,
        enabled=cfg.precision == "bf16" and method in ("ddp", "single"),
    )
    times, losses = [], []
    for step in range(cfg.warmup + cfg.steps):
        if step == cfg.warmup:
            counter.bytes = counter.calls = 0
            if method == "shardwrap":
                model.comm_stats.reset()
        tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen).to(device)
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with autocast:
            logits = model(tokens[:, :-1])  # (B, T, vocab), bf16 under mixed precision
            loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize()
        elapsed = torch.tensor(time.perf_counter() - t0)
        counter.paused = True  # the benchmark's own reduction is not the method's traffic
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step ends when the slowest rank ends
        counter.paused = False
        if step >= cfg.warmup:
            times.append(elapsed.item())
            losses.append(loss.item())
    if method == "shardwrap":
        comm_bytes = sum(model.comm_stats.bytes.values())
        comm_calls = sum(model.comm_stats.calls.values())
    else:
        comm_bytes, comm_calls = counter.bytes, counter.calls
    peak = torch.tensor(rss_mb("VmHWM") - rss_before)
    if device.type == "cuda":
        peak = torch.tensor(torch.cuda.max_memory_allocated(device) / 2**20)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return {
        "method": method,
        "world_size": world,
        "device": device.type,
        "params": counter.params,
        "step_s": statistics.median(times),
        "step_times": times,
        "tokens_per_s_per_rank": cfg.batch * cfg.context / statistics.median(times),
        "peak_mb_per_rank": peak.item(),
        "comm_bytes_per_step": comm_bytes / cfg.steps,
        "comm_calls_per_step": comm_calls / cfg.steps,
        "final_loss": losses[-1],
        "config": asdict(cfg),
    }


def main() -> None:
    method = sys.argv[1]
    cfg = Config(**json.loads(sys.argv[2])) if len(sys.argv) > 2 else Config()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    result = run(method, cfg)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
