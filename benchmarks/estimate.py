"""The memory planner against measured peaks: six model families, 2 ranks, every stage and tier.

    python benchmarks/estimate.py                       # about 10 minutes on 2 CPU cores
    python benchmarks/estimate.py --families qwen2 bert --size test

Each family of ``benchmarks/_memory.py`` (GPT-2, Llama, Qwen2, BERT, T5, ViT; ``--size bench``:
tens of millions of parameters, random weights) is planned and trained in six cells: stages
1, 2 and 3, the host tier at stages 1 and 3 (staged on the CPU through the switch its tests
use) and the disk tier. Every run wraps with the model's ``_no_split_modules`` blocks, trains
three AdamW steps on the inputs the planner assumes, and keeps each step's outputs until the
next forward returns. Three numbers per cell, each the larger of the two ranks:

- plan: ``shardwrap.estimate_memory(model, world_size=2, stage=..., offload=..., batch=...,
  seq=...)`` on the meta device;
- tracked: ranks as threads of this process, ``shardwrap.track_allocations()`` from wrapping
  on (``benchmarks._memory.training_peak``): what the plan counts;
- resident set: the same training under ``torchrun --nproc_per_node=2`` (this script with
  ``--worker``), the peak resident set after wrapping (its high-water mark reset then:
  building the unsharded model is not training) above the resident set before the model was
  built; at the disk tier minus the store's mapped files, which are resident once touched.

The report goes to ``benchmarks/results/estimate/``.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import shardwrap  # noqa: E402
from benchmarks._memory import (  # noqa: E402
    FAMILIES,
    family_model,
    hf_batches,
    hf_loss,
    staged_on_cpu,
    training_peak,
)
from shardwrap import estimate_memory  # noqa: E402

MB = 2**20
CELLS = [(1, None), (2, None), (3, None), (1, "cpu"), (3, "cpu"), (3, "disk")]
STEPS = 3


def blocks(model: torch.nn.Module) -> tuple[type, ...]:
    names = set(model._no_split_modules)
    return tuple({type(m) for m in model.modules() if type(m).__name__ in names})


def rss_mib(field: str) -> float:
    """A field of /proc/self/status (VmRSS, VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    raise KeyError(field)


def worker(family: str, size: str, stage: int, offload: str | None, batch: int, seq: int) -> None:
    """One rank under torchrun: train as ``training_peak`` does, untracked; rank 0 prints the
    larger rank's peak resident set (MiB) after wrapping, above the set before building."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    importlib.import_module("torch._dynamo")  # library code the first optimizer imports
    importlib.import_module("transformers")
    dist.barrier()
    before = rss_mib("VmRSS")
    model = family_model(family, size)
    steps = hf_batches(STEPS, batch, seq)(rank, model)
    with contextlib.ExitStack() as stack:
        tier = None
        if offload == "disk":
            folder = stack.enter_context(tempfile.TemporaryDirectory())
            tier = shardwrap.Offload(device="disk", path=folder)
        elif offload == "cpu":
            stack.enter_context(staged_on_cpu())
            tier = shardwrap.Offload(device="cpu")
        m = shardwrap.ShardedModule(model, auto_wrap=blocks(model), stage=stage, offload=tier)
        del model
        opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the high-water mark starts again from here
        for i, batch_ in enumerate(steps):
            if i == 1:
                start = time.perf_counter()
            value, out = hf_loss(m, batch_)
            value.backward()
            opt.step()
            opt.zero_grad()
        seconds = (time.perf_counter() - start) / (len(steps) - 1)
        files = getattr(m._shardwrap_root.home, "nbytes", 0) / MB  # the disk tier's files
        peak = torch.tensor([rss_mib("VmHWM") - before - files, seconds], dtype=torch.float64)
        dist.all_reduce(peak, dist.ReduceOp.MAX)
        if rank == 0:
            result = {"resident_mib": peak[0].item(), "step_s": peak[1].item(), "files_mib": files}
            print("RESULT " + json.dumps(result))
        del m, opt, out
    dist.destroy_process_group()


def resident(family: str, size: str, stage: int, offload: str | None, batch: int, seq: int) -> dict:
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", "--nproc_per_node=2", "benchmarks/estimate.py"]
    cmd += ["--worker", family, size, str(stage), offload or "-", str(batch), str(seq)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    p.add_argument("--size", default="bench", choices=("bench", "test"))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128, help="token models' sequence length")
    p.add_argument("--no-resident", action="store_true", help="skip the torchrun runs")
    p.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    day = time.strftime("%Y-%m-%d")
    out = ROOT / f"benchmarks/results/estimate/estimate_cpu2_{day}.md"
    p.add_argument("--out", type=Path, default=out)
    args = p.parse_args()
    if args.worker:
        family, size, stage, offload, batch, seq = args.worker
        worker(family, size, int(stage), None if offload == "-" else offload, int(batch), int(seq))
        return
    start = time.perf_counter()
    rows, models = [], []
    for family in args.families:
        model = family_model(family, args.size)
        inputs = ""
        for stage, offload in CELLS:
            t0 = time.perf_counter()
            with staged_on_cpu(offload == "cpu"):
                plan = estimate_memory(
                    model, world_size=2, stage=stage, offload=offload, batch=args.batch,
                    seq=args.seq, auto_wrap=blocks(model),
                )  # fmt: skip
            planned = time.perf_counter() - t0
            est = plan.row(stage, offload)
            live = training_peak(
                model, hf_batches(STEPS, args.batch, args.seq), hf_loss, offload=offload,
                timeout=1200.0, auto_wrap=blocks(model), stage=stage,
            ) / MB  # fmt: skip
            row = [family, str(stage), offload or "-", f"{est.peak / MB:.1f}", est.phase]
            row += [f"{live:.1f}", f"{live / (est.peak / MB):.3f}", f"{planned:.1f}"]
            if not args.no_resident:
                rss = resident(family, args.size, stage, offload, args.batch, args.seq)
                row += [f"{rss['resident_mib']:.0f}", f"{rss['resident_mib'] - est.peak / MB:+.0f}"]
                row += [f"{rss['step_s']:.2f}"]
            rows.append(row)
            inputs = plan.inputs
            print("| " + " | ".join(row) + " |", flush=True)
        params = sum(p.numel() for p in model.parameters())
        models.append(
            f"| {family} | {type(model).__name__} | {params / 1e6:.1f}M | {plan.units} | {inputs} |"
        )
    minutes = (time.perf_counter() - start) / 60
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    import transformers

    cols = ["family", "stage", "offload", "plan", "peak at", "tracked", "tracked / plan"]
    cols += ["planned in (s)"]
    if not args.no_resident:
        cols += ["resident set", "resident - plan", "s/step"]
    lines = [f"| {' | '.join(cols)} |", f"|{'---|' * len(cols)}"]
    table = "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])
    malloc = ", ".join(f"`{k}={v}`" for k, v in os.environ.items() if k.startswith("MALLOC_"))
    malloc = malloc or "glibc malloc's defaults (no `MALLOC_` variables)"
    report = f"""# The memory planner against measured peaks, six model families, 2 CPU ranks

`python benchmarks/estimate.py --size {args.size} --batch {args.batch} --seq {args.seq}` at
commit {commit}, {time.strftime("%Y-%m-%d")}, {minutes:.0f} minutes.

- Hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; Python
  {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}.
- Models (`benchmarks/_memory.py`, size `{args.size}`, random weights, their configs' defaults
  otherwise: dropout on where the config has it), wrapped by their `_no_split_modules`:

| family | class | parameters | units | each sample |
|---|---|---|---|---|
{chr(10).join(models)}

- Environment: {malloc}.
- Training: fp32 AdamW (fused by shardwrap at the offload tiers), batch {args.batch} per rank,
  {STEPS} steps, 2 ranks with gloo; the host tier (`Offload(device="cpu")`) runs its staged
  path on the CPU (`benchmarks._memory.staged_on_cpu`, as its tests do), the disk tier's files
  in a temporary folder.
- plan: `shardwrap.estimate_memory(model, world_size=2, stage=..., offload=...,
  batch={args.batch}, seq={args.seq}, auto_wrap=...)`, the peak of rank 0 over the first step
  and the steady ones.
- tracked: ranks as threads, `shardwrap.track_allocations()` from wrapping on; the larger
  rank's peak.
- resident set: under `torchrun --nproc_per_node=2`, the peak resident set after wrapping
  above the resident set before the model was built (after the process group, `transformers`
  and `torch._dynamo` were loaded), the larger rank's; at the disk tier less the store's files,
  mapped and so resident once touched. What the operating system sees adds the allocator's
  retention, kernel scratch buffers and library code paged in on first use. s/step: the
  torchrun run's mean over its steps after the first, the slower rank's.

MiB per rank (2^20 bytes):

{table}
"""
    args.out.write_text(report)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
