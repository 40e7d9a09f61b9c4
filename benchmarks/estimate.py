"""The memory planner against measured peaks: the 101M benchmark GPT at stages 1, 2 and 3.

    python benchmarks/estimate.py            # about three minutes on 2 CPU cores

Each stage trains in fresh ``torchrun`` processes (2 ranks, gloo) through ``_worker.py``
(``shardwrap-s1``/``-s2``/``-s3``, fp32 AdamW, its reference configuration), which reports each
rank's peak memory: the resident set's high-water mark above the resident set before the model
was built (on GPU, ``max_memory_allocated``). ``shardwrap.estimate_memory`` plans the same model,
world size and batch from the meta device. The report goes to ``benchmarks/results/estimate/``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import _launch
import torch
from _launch import ROOT

sys.path.insert(0, str(ROOT))

from shardwrap import estimate_memory  # noqa: E402

MB = 2**20


def measure(stage: int, config: dict[str, object]) -> dict[str, object]:
    """One ``_worker.py`` run of ``shardwrap-s{stage}``; its result line."""
    return _launch.run_once(f"shardwrap-s{stage}", config, 2, None)


def tracked(stage: int, model: dict[str, int], batch: int, steps: int) -> int:
    """The same training with ranks as threads, every storage each rank creates from wrapping
    on tracked (``tests/_memory.py``); the larger rank's peak of live bytes."""
    from tests.planning.test_estimate import measured_peak

    return measured_peak({"vocab": 256, **model}, stage, batch, steps, timeout=600.0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument(
        "--out", type=Path, default=ROOT / "benchmarks/results/estimate/estimate_cpu2_2026-11-23.md"
    )
    args = p.parse_args()
    model = {"width": 1024, "depth": 8, "heads": 16, "context": 64}  # _worker.Config's defaults
    batch = 2
    config = {"warmup": args.warmup, "steps": args.steps, "batch": batch, **model}
    start = time.perf_counter()
    plan = estimate_memory(
        "examples.train_gpt:GPT", world_size=2, batch=batch, seq=model["context"], kwargs=model
    )
    planned = time.perf_counter() - start
    rows = []
    for stage in (1, 2, 3):
        rss = measure(stage, config)["peak_mb_per_rank"]
        live = tracked(stage, model, batch, args.warmup + args.steps) / MB
        est = plan.row(stage)
        parts = [est.params, est.grads, est.optimizer, est.working_set, est.activations]
        rows.append(
            f"| {stage} | {' | '.join(f'{n / MB:.0f}' for n in parts)} | {est.phase} "
            f"| {est.peak / MB:.1f} | {live:.1f} ({est.peak / MB / live:.3f}) "
            f"| {rss:.0f} ({est.peak / MB / rss:.3f}) |"
        )
        print(rows[-1], flush=True)
    commit = _launch.commit()
    cols = ["stage", "params", "grads", "optimizer", "working set", "activations", "peak at"]
    cols += ["estimate", "tracked (ratio)", "resident set (ratio)"]
    header = f"| {' | '.join(cols)} |\n|{'---|' * len(cols)}"
    report = f"""# The memory planner against measured peaks, 101M GPT, 2 CPU ranks

`python benchmarks/estimate.py` at commit {commit}, {time.strftime("%Y-%m-%d")}.

- Hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python
  {platform.python_version()}, torch {torch.__version__}.
- Model: the GPT of `examples/train_gpt.py`, width {model["width"]}, depth {model["depth"]},
  {model["heads"]} heads, context {model["context"]}, byte vocabulary ({plan.params / 1e6:.1f}M
  parameters, {plan.units} units), fp32 AdamW, batch {batch} per rank, 2 ranks with gloo.
- Measured two ways, each the larger of the two ranks:
  - tracked: the same training loop ({args.warmup + args.steps} steps) with ranks as threads of
    one process, every storage each rank creates from wrapping on tracked while it lives
    (`tests/_memory.py`): what the planner models;
  - resident set: `benchmarks/_worker.py shardwrap-sN` under `torchrun --nproc_per_node=2`,
    {args.warmup} warm-up and {args.steps} timed steps, the peak resident set above the resident
    set before the model was built: what the operating system sees, which adds the allocator's
    retention and fragmentation, kernel scratch buffers and library code paged in on first use.
- Estimated: `shardwrap.estimate_memory("examples.train_gpt:GPT", world_size=2, batch={batch},
  seq={model["context"]}, kwargs=...)` on the meta device, in {planned:.1f} s; the parts are taken
  at the estimated peak.

MiB per rank (2^20 bytes); the ratio is estimate / measured:

{header}
{chr(10).join(rows)}

```
{plan}
```
"""
    args.out.write_text(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
