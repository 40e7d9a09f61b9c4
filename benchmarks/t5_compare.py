"""The classic DDP-against-ZeRO comparison on a small T5: max batch, train time and eval time
(beam search) per method, in one run.

    python benchmarks/t5_compare.py                      # 2 ranks, 256 MB per rank
    python benchmarks/t5_compare.py --budget-mb 256 --samples 4096 --rows 64 --beams 4

The T5 is ``benchmarks/generate.py``'s (3 + 3 blocks of width 256, 8 heads, feed-forward 1024,
vocabulary 256: about 5.6M parameters), the same in both halves. For each of DDP, shardwrap at
stages 2 and 3 and FSDP2 (every ``T5Block`` and the root):

- **max batch**: the largest per-rank batch whose training step (AdamW, fp32, sequences of 64
  bytes as encoder and decoder input) stays within ``--budget-mb`` of resident memory per rank
  above the level before the model was built, found by ``benchmarks/max_batch.py``'s search
  (fresh ``torchrun`` launches of ``benchmarks/_worker.py``);
- **train time**: the step time at that batch (the fitting trial's median of timed steps) and
  the time for ``--samples`` samples over all ranks at it;
- **eval time**: ``generate()`` with beam search over ``--rows`` rows split across the ranks,
  as ``benchmarks/generate.py`` times it (median of ``--repeats`` calls after one untimed
  call, the slowest rank's time); shardwrap's ``generate()`` keeps its units gathered for the
  call where the model fits.

Report: ``benchmarks/results/t5_compare/t5_compare_<hardware>_<date>.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, commit, hardware, results_dir  # noqa: E402
from generate import time_method  # noqa: E402
from max_batch import search  # noqa: E402

METHODS = ("ddp", "shardwrap-s2", "shardwrap-s3", "fsdp2")
# benchmarks/_worker.py's T5 of that width and depth is generate.py's T5.
TRAIN_CONFIG = {"model": "t5", "depth": 3, "width": 256, "heads": 8, "context": 64}


def max_batch(method: str, budget: float, nproc: int, limit: int) -> dict[str, Any]:
    """The largest fitting batch's trial (``batch``, ``peak_mb``, ``step_s``) and every trial."""
    trials = search(method, TRAIN_CONFIG, budget, nproc, limit)
    best = max((t for t in trials if t["fits"]), key=lambda t: t["batch"], default=None)
    return {"best": best, "trials": trials}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--budget-mb", type=float, default=256, help="per rank (default 256)")
    parser.add_argument("--limit", type=int, default=512, help="largest batch tried")
    parser.add_argument("--samples", type=int, default=4096, help="samples the train time covers")
    parser.add_argument("--rows", type=int, default=64, help="rows generated over all ranks")
    parser.add_argument("--beams", type=int, default=4, help="beam width (default 4)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed generate() calls")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    args = parser.parse_args()
    results = {}
    for method in args.methods:
        results[method] = {"train": max_batch(method, args.budget_mb, args.nproc, args.limit)}
        results[method]["eval"] = time_method(method, args, timeout=1800)
        print(f"{method}: {json.dumps(results[method]['eval'])}", flush=True)
    report = _report(args, results)
    path = results_dir("t5_compare") / f"t5_compare_{hardware()}_{date.today()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report)
    print(report)
    print(f"report: {path.relative_to(ROOT)}")


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    ddp = results.get("ddp", {})
    ddp_batch = (ddp.get("train", {}).get("best") or {}).get("batch")
    ddp_eval = ddp.get("eval", {}).get("seconds")
    ddp_cpu = ddp.get("eval", {}).get("cpu_seconds")
    lines = [
        f"# DDP against ZeRO on a small T5: max batch, train time, eval time ({date.today()})",
        "",
        f"`python benchmarks/t5_compare.py --nproc {args.nproc} --budget-mb {args.budget_mb:.0f} "
        f"--samples {args.samples} --rows {args.rows} --beams {args.beams} --tokens "
        f"{args.tokens} --repeats {args.repeats}`; {hardware()}, gloo, one thread per rank; "
        f"commit {commit()}; load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        f"T5 of 3 + 3 blocks of width 256 (about 5.6M parameters). Train: AdamW in fp32, "
        f"sequences of {TRAIN_CONFIG['context']} bytes, the largest per-rank batch within "
        f"{args.budget_mb:.0f} MB of resident memory per rank (above the level before the "
        f"model was built), the step time at it and the time for {args.samples} samples over "
        f"all ranks. Eval: generate() over {args.rows} rows split across the ranks, beam "
        f"{args.beams}, {args.tokens} new tokens per row, median of {args.repeats} calls after "
        "one untimed call (the slowest rank's time); eval CPU s: the process's CPU time over a "
        "call, the busiest rank's, median (less sensitive to other jobs than wall time).",
        "",
        "| method | max batch per rank | vs DDP | peak MB at it | step (s) at it "
        f"| train time, {args.samples} samples | eval time (s) | vs DDP | eval CPU s | vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        best, ev = r["train"]["best"], r["eval"]
        if best is None:
            train = "| none fits | | | | "
        else:
            steps = -(-args.samples // (best["batch"] * args.nproc))
            ratio = f"{best['batch'] / ddp_batch:.2f}x" if ddp_batch else ""
            train = (
                f"| {best['batch']} | {ratio} | {best['peak_mb']:.0f} | {best['step_s']:.3f} "
                f"| {steps * best['step_s']:.1f} s ({steps} steps) "
            )
        if "seconds" in ev:
            vs = f"{ev['seconds'] / ddp_eval:.2f}x" if ddp_eval else ""
            cpu = ev["cpu_seconds"]
            cpu_vs = f"{cpu / ddp_cpu:.2f}x" if ddp_cpu else ""
            evaluation = f"| {ev['seconds']:.3f} | {vs} | {cpu:.3f} | {cpu_vs} |"
        else:
            evaluation = f"| failed: {ev.get('error', '')} | | | |"
        lines.append(f"| {method} {train}{evaluation}")
    lines += ["", "Trials (batch: peak MB, fits):", ""]
    for method, r in results.items():
        trials = r["train"]["trials"]
        lines.append(
            f"- {method}: "
            + ", ".join(
                f"{t['batch']}: {t['peak_mb']:.0f}{'' if t['fits'] else ' (over)'}" for t in trials
            )
        )
    lines += ["", "Eval calls (seconds):", ""]
    for method, r in results.items():
        times = r["eval"].get("times")
        if times:
            lines.append(f"- {method}: " + ", ".join(f"{t:.3f}" for t in times))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
