"""shardwrap against PyTorch FSDP2, DDP and an unsharded process, side by side.

    python benchmarks/compare.py                          # the reference configuration
    python benchmarks/compare.py --precision bf16         # bf16 mixed precision
    python benchmarks/compare.py --precision fp32 bf16    # both, side by side
    python benchmarks/compare.py --methods shardwrap fsdp2 --rounds 3 --steps 6
    python benchmarks/compare.py --config '{"width": 256, "depth": 2}' --theme tiny

Every method trains the same GPT (same seed, batch, optimizer) under ``torchrun``, each run
in fresh processes so that memory high-water marks are its own. Methods and precisions
alternate (A B C A B C ...) so that drift of this shared machine hits all of them alike. For
each method and precision the report gives the median step time over all rounds, tokens/s per
rank, the peak memory per rank (worst round), the bytes handed to collectives per step, the
final loss, and the ratios to FSDP2 and DDP of the same precision, then whether shardwrap meets
its targets against FSDP2 (step time <= 0.6x, peak memory <= 0.85x). ``bf16`` is mixed
precision on fp32 master weights (see ``benchmarks/_worker.py``). Output:
``benchmarks/results/<theme>_<hardware>_<date>.md``, a JSON file and a PNG bar chart beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
METHODS = ("shardwrap", "fsdp2", "ddp", "single")
PRECISIONS = ("fp32", "bf16")
TARGETS = {"time_vs_fsdp2": 0.6, "memory_vs_fsdp2": 0.85}  # shardwrap's, at every precision
RECIPES = {
    "fp32": "fp32 AdamW",
    "bf16": "AdamW on fp32 master weights, bf16 compute, gradients reduced in fp32: shardwrap "
    "`MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)`, FSDP2 "
    "`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` on every "
    "`fully_shard`, DDP and single under `torch.autocast(dtype=bfloat16)`; loss in fp32",
}


def run_once(method: str, config: dict[str, Any], nproc: int, timeout: float) -> dict[str, Any]:
    """Launch one method under torchrun; return rank 0's result."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(HERE / "_worker.py"),
        method,
        json.dumps(config),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"{method} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )


def hardware() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).replace(" ", "-").lower()
    return f"cpu{os.cpu_count()}"


def commit() -> str:
    """The checked-out commit, for the report (``unknown`` outside a git checkout)."""
    proc = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    )
    return proc.stdout.strip() or "unknown"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """One row per method of one precision, with ratios to that precision's FSDP2 and DDP."""
    rows = {}
    for method, results in runs.items():
        times = [t for r in results for t in r["step_times"]]
        rows[method] = {
            "step_s": statistics.median(times),
            "tokens_per_s_per_rank": results[0]["config"]["batch"]
            * results[0]["config"]["context"]
            / statistics.median(times),
            "peak_mb_per_rank": max(r["peak_mb_per_rank"] for r in results),
            "comm_mb_per_step": statistics.median(r["comm_bytes_per_step"] for r in results)
            / 2**20,
            "final_loss": results[-1]["final_loss"],
        }
    for row in rows.values():
        for ref in ("fsdp2", "ddp"):
            if ref in rows:
                row[f"time_vs_{ref}"] = row["step_s"] / rows[ref]["step_s"]
                row[f"memory_vs_{ref}"] = row["peak_mb_per_rank"] / rows[ref]["peak_mb_per_rank"]
    return rows


def target_lines(rows: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Whether shardwrap meets its targets against FSDP2, one line per precision."""
    lines = []
    for precision, by_method in rows.items():
        row = by_method.get("shardwrap", {})
        if "time_vs_fsdp2" not in row:
            continue
        checks = [
            f"{label} {row[key]:.2f}x FSDP2's (target <= {TARGETS[key]}x): "
            + ("met" if row[key] <= TARGETS[key] else "NOT met")
            for key, label in (("time_vs_fsdp2", "step time"), ("memory_vs_fsdp2", "peak memory"))
        ]
        verdict = "all met" if all(row[k] <= v for k, v in TARGETS.items()) else "NOT all met"
        lines.append(f"- {precision}: {'; '.join(checks)}. Targets {verdict}.")
    return lines


def markdown(
    rows: dict[str, dict[str, dict[str, float]]],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
) -> str:
    first = next(iter(next(iter(runs.values())).values()))[0]
    cfg = first["config"]
    lines = [
        f"# {args.theme}: shardwrap vs FSDP2, DDP and one unsharded process",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, backend "
        f"{'nccl' if torch.cuda.is_available() else 'gloo'}, {args.nproc} ranks, OMP_NUM_THREADS=1",
        f"- model: GPT, {cfg['depth']} blocks of width {cfg['width']}, {cfg['heads']} heads, "
        f"byte vocabulary, context {cfg['context']}, {first['params'] / 1e6:.1f}M parameters",
        f"- training: batch {cfg['batch']} per rank, {cfg['warmup']} warm-up + "
        f"{cfg['steps']} timed steps per run, {args.rounds} alternating rounds per method "
        "and precision",
        *(f"- {precision}: {RECIPES[precision]}" for precision in rows),
        f"- command: `python benchmarks/compare.py {' '.join(sys.argv[1:])}`, at commit {commit()}",
        "",
        "| method | precision | step (s, median) | tokens/s per rank | peak MB per rank "
        "| comm MB per step | final loss | time vs FSDP2 | memory vs FSDP2 | time vs DDP "
        "| memory vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision, by_method in rows.items():
        for method, r in by_method.items():
            ratios = " | ".join(
                f"{r[key]:.2f}" if key in r else "-"
                for key in ("time_vs_fsdp2", "memory_vs_fsdp2", "time_vs_ddp", "memory_vs_ddp")
            )
            lines.append(
                f"| {method} | {precision} | {r['step_s']:.2f} | "
                f"{r['tokens_per_s_per_rank']:.1f} | {r['peak_mb_per_rank']:.0f} | "
                f"{r['comm_mb_per_step']:.0f} | {r['final_loss']:.4f} | {ratios} |"
            )
    checks = target_lines(rows)
    if checks:
        lines += ["", "shardwrap against FSDP2 at the same precision:", "", *checks]
    lines += ["", "Step times of every run, in order:", ""]
    for precision, by_method in runs.items():
        for method, results in by_method.items():
            times = ", ".join(f"{t:.2f}" for r in results for t in r["step_times"])
            lines.append(f"- {method} {precision}: {times}")
    lines += [
        "",
        "Ratios compare methods of the same precision. Peak memory: resident-set high-water "
        "mark above the resident set just before the model was built (CPU), or "
        "max_memory_allocated (GPU); the worst rank of the worst round. Comm MB: buffers "
        "handed to collectives per step (all-gather output, reduce-scatter input, all-reduce "
        "tensor), in the dtype they travel in. Final loss: rank 0's fp32 loss on the last "
        "timed step of the last round. `single` trains an unsharded copy on every rank with no "
        "communication.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, p, r) for p, by_method in rows.items() for m, r in by_method.items()]
    labels = [m if len(rows) == 1 else f"{m}\n{p}" for m, p, _ in bars]
    fig, axes = plt.subplots(1, 2, figsize=(9 if len(rows) == 1 else 14, 3.5))
    for ax, key, label in zip(
        axes, ("step_s", "peak_mb_per_rank"), ("step time (s)", "peak memory per rank (MB)")
    ):
        drawn = ax.bar(
            labels,
            [r[key] for _, _, r in bars],
            color=["C0" if m == "shardwrap" else "C7" for m, _, _ in bars],
            hatch=["//" if p == "bf16" else "" for _, p, _ in bars],
        )
        ax.bar_label(drawn, fmt="%.2f" if key == "step_s" else "%.0f")
        ax.set_title(label)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=PRECISIONS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--config", default="{}", help="JSON overrides of benchmarks/_worker.py Config"
    )
    parser.add_argument("--theme", help="default: gpt101m_<precisions>, e.g. gpt101m_bf16")
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    precisions = list(dict.fromkeys(args.precision))
    args.theme = args.theme or "gpt101m_" + "_".join(precisions)
    config = {"steps": args.steps, **json.loads(args.config)}
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {m: [] for m in args.methods} for p in precisions
    }
    for round_ in range(args.rounds):
        for precision in precisions:
            for method in args.methods:
                result = run_once(
                    method, {**config, "precision": precision}, args.nproc, args.timeout
                )
                runs[precision][method].append(result)
                print(
                    f"round {round_ + 1} {method} {precision}: {result['step_s']:.2f} s/step, "
                    f"{result['peak_mb_per_rank']:.0f} MB",
                    flush=True,
                )
    rows = {precision: summarize(by_method) for precision, by_method in runs.items()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(rows, runs, args)
    (args.out_dir / f"{stem}.md").write_text(report)
    (args.out_dir / f"{stem}.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    plot(rows, args.out_dir / f"{stem}.png")
    print(report)


if __name__ == "__main__":
    main()
