"""The largest per-rank batch each method trains within a per-rank memory budget.

    python benchmarks/max_batch.py --budget-mb 2048
    python benchmarks/max_batch.py --methods shardwrap-s3 ddp --config '{"width": 512}' \
        --budget-mb 800

The shape of the ZeRO paper's table (DeepSpeed's row against DDP's): for every method, trials at
batch 8 and 16 fit a line to peak memory against batch, the line guesses the largest batch within
the budget, and bisection finds the edge (see :func:`search`); each trial is a fresh ``torchrun``
launch of ``benchmarks/_worker.py`` (one warm-up step, then two timed steps unless the config says
``"steps"``: the first step allocates AdamW's state, so the peak is reached in the second). The
budget is CPU resident memory above the level before the model was built, or
``max_memory_allocated`` on GPU. The methods are ``compare.py``'s; by default DDP, shardwrap at each
stage, FSDP2 and DeepSpeed at each stage (skipped, with a notice, where DeepSpeed is not installed).
The time column is ``--samples`` samples over all ranks at each method's largest batch: its step
time times the steps needed. That step time is the fitting trial's, or, with ``--time-steps K``,
the median of K steps of one more launch at that batch (a search can then run one timed step
per trial, ``"steps": 1`` in the config, and still report a steady time). Output:
``benchmarks/results/max_batch/<name>_<hardware>_<date>.md`` (``--name``, default ``max_batch``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import torch
from _launch import commit, hardware, results_dir, run_once
from compare import (
    ALIASES,
    DEEPSPEED,
    INSTALL_HINT,
    METHODS,
    deepspeed_installed,
    deepspeed_version,
    select_methods,
)

DEFAULT = ("ddp", "shardwrap-s1", "shardwrap-s2", "shardwrap-s3", "fsdp2", *DEEPSPEED)


def fits(
    method: str,
    batch: int,
    config: dict[str, Any],
    budget: float,
    nproc: int,
    trials: list[dict[str, Any]],
) -> bool:
    result = run_once(method, {"steps": 2, **config, "batch": batch, "warmup": 1}, nproc, 1800)
    ok = result["peak_mb_per_rank"] <= budget
    trials.append(
        {
            "batch": batch,
            "peak_mb": result["peak_mb_per_rank"],
            "step_s": result["step_s"],
            "fits": ok,
        }
    )
    print(
        f"{method} batch {batch}: {result['peak_mb_per_rank']:.0f} MB, "
        f"{result['step_s']:.2f} s/step -> {'fits' if ok else 'over budget'}",
        flush=True,
    )
    return ok


def search(
    method: str, config: dict[str, Any], budget: float, nproc: int, limit: int
) -> list[dict[str, Any]]:
    """The largest batch within ``budget``, in few trials; returns every trial.

    Peak memory grows about linearly with the batch (activations): trials at batch 8 and 16
    give a line (at batch 1 and 2 the allocator's noise is as large as the activations), its
    crossing of the budget is the first guess, and bisection closes the bracket. Peak memory
    is not monotonic in the batch to a few tens of MB, so the edge is only as sharp as that.
    Past a guess that fits, the search steps up by a quarter rather than doubling: the edge is
    near, and a trial at twice the batch costs twice the time.
    """
    trials: list[dict[str, Any]] = []
    lo, hi = 0, limit + 1  # lo fits (0: nothing yet), hi does not

    def trial(batch: int) -> None:
        nonlocal lo, hi
        if fits(method, batch, config, budget, nproc, trials):
            lo = max(lo, batch)
        else:
            hi = min(hi, batch)

    trial(1)
    if lo == 0:
        return trials
    for batch in (8, 16):
        if batch <= limit and batch < hi:
            trial(batch)
    line = sorted((t["batch"], t["peak_mb"]) for t in trials if t["batch"] >= 8)
    guessed = len(line) == 2 and line[1][1] > line[0][1]  # the line puts the edge near
    if guessed:
        (b0, m0), (b1, m1) = line
        guess = int(b1 + (budget - m1) * (b1 - b0) / (m1 - m0))
        if lo < guess < hi:
            trial(guess)
            if lo == guess and guess + 1 < hi:
                trial(guess + 1)
    while hi - lo > 1:
        if hi <= limit:
            trial((lo + hi) // 2)
        else:  # no edge yet: past a fitting guess the edge is near, so step by a quarter
            trial(min(limit, lo + max(1, lo // 4) if guessed else 2 * lo))
    return trials


def trial_lines(trials: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The report's section listing each method's trials (``search``'s ``trials``)."""
    lines = ["", "Trials (batch: peak MB, fits):", ""]
    for method, tried in trials.items():
        lines.append(
            f"- {method}: "
            + ", ".join(
                f"{t['batch']}: {t['peak_mb']:.0f}{'' if t['fits'] else ' (over)'}" for t in tried
            )
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", nargs="+", choices=[*METHODS, *ALIASES], help=f"default: {' '.join(DEFAULT)}"
    )
    parser.add_argument("--budget-mb", type=float, required=True)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--limit", type=int, default=256, help="largest batch tried")
    parser.add_argument(
        "--samples", type=int, default=4096, help="samples (all ranks) the time column trains"
    )
    parser.add_argument(
        "--time-steps",
        type=int,
        default=0,
        help="time each largest batch in one more launch of this many steps (0: the trial's)",
    )
    parser.add_argument(
        "--config", default="{}", help="JSON overrides of benchmarks/_worker.py Config"
    )
    parser.add_argument("--out-dir", type=Path, default=results_dir("max_batch"))
    parser.add_argument("--name", default="max_batch", help="the report's file name stem")
    args = parser.parse_args()
    methods, skipped = select_methods(args.methods, DEFAULT, deepspeed_installed())
    if skipped:
        print(f"DeepSpeed is not installed ({INSTALL_HINT}): skipping {', '.join(skipped)}")
    config = json.loads(args.config)
    found = {}
    for method in methods:
        trials = search(method, config, args.budget_mb, args.nproc, args.limit)
        best = max((t for t in trials if t["fits"]), key=lambda t: t["batch"], default=None)
        if best is not None and args.time_steps > 0:
            timed = {**config, "batch": best["batch"], "warmup": 1, "steps": args.time_steps}
            best = {**best, "step_s": run_once(method, timed, args.nproc, 3600)["step_s"]}
            print(f"{method} batch {best['batch']}: {best['step_s']:.2f} s/step", flush=True)
        found[method] = {"best": best, "trials": trials}
    ddp = found.get("ddp", {}).get("best")
    lines = [
        "# Largest per-rank batch within a memory budget",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}; "
        f"torch {torch.__version__}, {deepspeed_version()}, {args.nproc} ranks",
        f"- budget: {args.budget_mb:.0f} MB per rank (resident memory above the level before the "
        "model was built)"
        if not torch.cuda.is_available()
        else f"- budget: {args.budget_mb:.0f} MB per GPU",
        f"- model: benchmarks/_worker.py Config with {json.dumps(config)}; "
        f"{config.get('precision', 'fp32')} compute, AdamW on fp32 master weights",
        "- step time at the largest batch: "
        + (
            f"median of {args.time_steps} steps of one more launch at it, after one warm-up step"
            if args.time_steps > 0
            else "the fitting trial's timed steps"
        ),
        *([f"- skipped, DeepSpeed not installed: {', '.join(skipped)}"] if skipped else []),
        f"- command: `python benchmarks/max_batch.py {' '.join(sys.argv[1:])}`, "
        f"at commit {commit()}",
        "",
        "| method | max batch per rank | peak MB at it | step (s) at it | tokens/s per rank "
        f"| time for {args.samples} samples | batch vs DDP |",
        "|---|---|---|---|---|---|---|",
    ]
    for method, f in found.items():
        b = f["best"]
        if b is None:
            lines.append(f"| {method} | none fits | - | - | - | - | - |")
            continue
        context = config.get("context", 64)
        ratio = f"{b['batch'] / ddp['batch']:.2f}" if ddp else "-"
        steps = -(-args.samples // (b["batch"] * args.nproc))  # at that batch, rounded up
        lines.append(
            f"| {method} | {b['batch']} | {b['peak_mb']:.0f} | {b['step_s']:.2f} | "
            f"{b['batch'] * context / b['step_s']:.1f} | {steps * b['step_s']:.0f} s "
            f"({steps} steps) | {ratio} |"
        )
    lines += trial_lines({method: f["trials"] for method, f in found.items()})
    report = "\n".join(lines) + "\n"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.name}_{hardware()}_{datetime.date.today().isoformat()}.md").write_text(
        report
    )
    print(report)


if __name__ == "__main__":
    main()
