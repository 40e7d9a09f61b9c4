"""2-D parallelism at 4 ranks: shardwrap dp=2 x tp=2 against FSDP2 with the same tensor
parallelism and against shardwrap dp=4.

    python benchmarks/tensor_parallel.py                      # the 101M GPT, 2 rounds
    python benchmarks/tensor_parallel.py --rounds 1 --config '{"depth": 2, "width": 256}'

Every method trains the GPT of ``examples/train_gpt.py`` (the 101M one of
``benchmarks/compare.py`` by default) on the same global batch of each step, under ``torchrun``
in fresh processes (``benchmarks/_tp_worker.py``); the tensor-parallel methods use
``examples/train_gpt_tp.py``'s plan. Methods alternate (A B C A B C ...) so that drift of this
shared machine hits all alike. The report gives per method the median step time over all
rounds, the peak memory per rank (worst round), the bytes handed to collectives per step over
each axis (dp, tp, and shardwrap's handshakes over every rank), the largest per-step difference
of the global loss from FSDP2's, and the goals: parity (losses within 1e-4 of FSDP2's), bytes
over dp at most FSDP2's, step time at most 0.8x FSDP2's with the same plan. Output:
``benchmarks/results/tensor_parallel/<theme>_<hardware>_<date>.md`` and a JSON file beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from _launch import HERE, commit, hardware, results_dir, torchrun

METHODS = ("shardwrap-tp", "fsdp2-tp", "shardwrap-dp")
PARITY = 1e-4  # the largest difference of a step's global loss from FSDP2's
STEP_GOAL = 0.8  # shardwrap dp x tp's step time against FSDP2's with the same plan


def run_once(method: str, config: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One run of ``method`` on 4 ranks; rank 0's result, or ``{"error": ...}``."""
    proc = torchrun(HERE / "_tp_worker.py", method, json.dumps(config), nproc=4, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    return {"method": method, "error": (proc.stderr or "").strip().splitlines()[-3:]}


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method: the median step time over every round's steps, the worst peak, the bytes
    of its last round, its losses (one round's: every round trains the same)."""
    out = {}
    for method in METHODS:
        mine = [r for r in runs if r["method"] == method and "error" not in r]
        if not mine:
            continue
        out[method] = {
            "step_s": statistics.median(t for r in mine for t in r["step_times"]),
            "peak_mb_per_rank": max(r["peak_mb_per_rank"] for r in mine),
            "dp_bytes_per_step": mine[-1]["dp_bytes_per_step"],
            "tp_bytes_per_step": mine[-1]["tp_bytes_per_step"],
            "control_bytes_per_step": mine[-1]["control_bytes_per_step"],
            "losses": mine[-1]["losses"],
        }
    return out


def goals(summary: dict[str, dict[str, Any]]) -> list[tuple[str, str, bool]]:
    """(goal, measured, met) for each goal whose methods ran."""
    ours, theirs = summary.get("shardwrap-tp"), summary.get("fsdp2-tp")
    if ours is None or theirs is None:
        return []
    lines = []
    for method in ("shardwrap-tp", "shardwrap-dp"):
        if method in summary:
            gap = max(abs(a - b) for a, b in zip(summary[method]["losses"], theirs["losses"]))
            goal = f"{method} losses within {PARITY:g} of FSDP2's"
            lines.append((goal, f"{gap:.2e}", gap <= PARITY))
    dp = ours["dp_bytes_per_step"] / theirs["dp_bytes_per_step"]
    lines.append(("bytes over dp <= FSDP2's", f"{dp:.3f}x", dp <= 1.0))
    step = ours["step_s"] / theirs["step_s"]
    lines.append((f"step time <= {STEP_GOAL}x FSDP2's", f"{step:.3f}x", step <= STEP_GOAL))
    return lines


def report(summary: dict[str, Any], runs: list[dict[str, Any]], args: argparse.Namespace) -> str:
    mb = 2**20
    rows = [
        "| method | step (s) | vs FSDP2 | peak MB/rank | dp MB/step | tp MB/step | "
        "handshakes KB/step |",
        "|---|---|---|---|---|---|---|",
    ]
    base = summary.get("fsdp2-tp", {}).get("step_s")
    for method, s in summary.items():
        ratio = f"{s['step_s'] / base:.2f}x" if base else "-"
        rows.append(
            f"| {method} | {s['step_s']:.3f} | {ratio} | {s['peak_mb_per_rank']:.0f} | "
            f"{s['dp_bytes_per_step'] / mb:.1f} | {s['tp_bytes_per_step'] / mb:.1f} | "
            f"{s['control_bytes_per_step'] / 1024:.1f} |"
        )
    judged = [f"- {'met' if met else 'MISSED'}: {g} ({got})" for g, got, met in goals(summary)]
    failed = [f"- {r['method']} failed: {' / '.join(r['error'])}" for r in runs if "error" in r]
    cfg = runs[0].get("config", args.config) if runs else args.config
    return "\n".join(
        [
            "# 2-D parallelism: shardwrap dp=2 x tp=2 against FSDP2 + TP and shardwrap dp=4",
            "",
            f"- command: `python benchmarks/tensor_parallel.py {' '.join(args.argv)}`",
            f"- commit {commit()}, {datetime.date.today()}, torch {torch.__version__}, "
            f"{platform.machine()} {hardware()}, gloo, 4 ranks under torchrun, OMP_NUM_THREADS=1",
            f"- model: the GPT of examples/train_gpt.py, {json.dumps(cfg)}; AdamW fp32; the "
            "tensor-parallel methods split its MLPs, attention projections, embedding and head "
            "(examples/train_gpt_tp.py); every method trains on the same global batch",
            f"- {args.rounds} rounds, methods alternating; step time: the median over every "
            "timed step of the slowest rank's wall time; peak: resident-set high-water above "
            "the process before the model was built (worst round)",
            "",
            *rows,
            "",
            "Goals:",
            *judged,
            *failed,
            "",
        ]
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", type=json.loads, default={}, help="JSON: _tp_worker.Config fields")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--theme", default="gpt101m_dp2tp2")
    p.add_argument("--out-dir", type=Path, default=results_dir("tensor_parallel"))
    args = p.parse_args()
    args.argv = sys.argv[1:]
    runs = []
    for _ in range(args.rounds):
        for method in args.methods:
            result = run_once(method, args.config, args.timeout)
            runs.append(result)
            print(json.dumps({k: v for k, v in result.items() if k != "config"}), flush=True)
    summary = summarize(runs)
    text = report(summary, runs, args)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{args.theme}_{hardware()}_{datetime.date.today()}"
    stem.with_suffix(".md").write_text(text)
    stem.with_suffix(".json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    print(text)


if __name__ == "__main__":
    main()
