"""Does compressed communication train as well? The demo, ``examples/train_gpt.py``, three ways.

    python benchmarks/compressed_convergence.py                  # 500 steps, 2 ranks
    python benchmarks/compressed_convergence.py --grads int4 --steps 200

Runs the demo with its defaults (the standard library's ``.py`` files, the same seed, so the
same initial weights and the same batches) under ``torchrun`` on ``--nproc`` ranks: without
compression, with ``--compress-params int8 --compress-grads <grads>`` (error feedback on), and
the same with ``--no-error-feedback``. From each run's logbook it reports the loss of the last
step and the mean loss of the last ``--tail`` steps (less noisy: one step's loss is one batch),
each as a ratio to the uncompressed run's; the goal is both within 1% of it. Output:
``benchmarks/results/compressed/convergence_<hardware>_<date>.md`` and a JSON file beside it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from _launch import ROOT, commit, hardware, results_dir, torchrun

sys.path.insert(0, str(ROOT))

from shardwrap.runs.runlog import read  # noqa: E402

DEMO = ROOT / "examples" / "train_gpt.py"
GOAL = 0.01  # relative difference from the uncompressed run's loss


def variants(params: str, grads: str) -> dict[str, list[str]]:
    """Run name: the demo's compression flags."""
    flags = ["--compress-params", params, "--compress-grads", grads]
    return {
        "uncompressed": [],
        f"{params}-{grads}-ef": flags,
        f"{params}-{grads}-no-ef": [*flags, "--no-error-feedback"],
    }


def train(name: str, flags: list[str], args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One demo run; its losses, seconds per step and final figures from its logbook."""
    cmd = ["--steps", str(args.steps), "--name", name, "--out-dir", str(out)]
    cmd += ["--save-every", str(args.steps), "--sample-bytes", "8", *flags]
    proc = torchrun(DEMO, *cmd, nproc=args.nproc, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    steps = read(out / name).steps
    losses = [s["loss"] for s in steps]
    return {
        "flags": flags,
        "losses": losses,
        "final_loss": losses[-1],
        "tail_loss": statistics.fmean(losses[-args.tail :]),
        "step_s": statistics.median(s["seconds"] for s in steps),
    }


def markdown(runs: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    base = runs["uncompressed"]
    lines = [
        "# convergence: the demo with and without compressed communication",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, "
        f"{args.nproc} ranks, OMP_NUM_THREADS=1",
        f"- training: `examples/train_gpt.py` defaults (GPT of width 128, 4 blocks, context 128, "
        f"batch 16 per rank, AdamW, lr 3e-3 warm-up and cosine), {args.steps} steps, the same "
        "seed and batches in every run",
        f"- command: `python benchmarks/compressed_convergence.py {' '.join(sys.argv[1:])}`, "
        f"launched at commit {args.commit}",
        "",
        f"| run | demo flags | loss, step {args.steps} | vs uncompressed "
        f"| loss, mean of last {args.tail} | vs uncompressed | s per step |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in runs.items():
        lines.append(
            f"| {name} | `{' '.join(r['flags']) or '-'}` | {r['final_loss']:.4f} | "
            f"{r['final_loss'] / base['final_loss']:.4f} | {r['tail_loss']:.4f} | "
            f"{r['tail_loss'] / base['tail_loss']:.4f} | {r['step_s']:.3f} |"
        )
    lines += ["", f"Goal: within {GOAL:.0%} of the uncompressed run's loss.", ""]
    for name, r in list(runs.items())[1:]:
        for key, label in (("final_loss", f"step {args.steps}"), ("tail_loss", "tail mean")):
            diff = r[key] / base[key] - 1
            verdict = "met" if abs(diff) <= GOAL else "NOT met"
            lines.append(f"- {name}, {label}: {diff:+.2%} ({verdict})")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--params", choices=("int8", "fp8"), default="int8")
    parser.add_argument("--grads", choices=("int8", "int4"), default="int8")
    parser.add_argument("--tail", type=int, default=50, help="steps in the mean loss")
    parser.add_argument("--theme", default="convergence")
    parser.add_argument("--out-dir", type=Path, default=results_dir("compressed"))
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    args.commit = commit()
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, flags in variants(args.params, args.grads).items():
            runs[name] = train(name, flags, args, Path(tmp))
            print(f"{name}: loss {runs[name]['final_loss']:.4f}", flush=True)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(runs, args)
    (args.out_dir / f"{stem}.md").write_text(report)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(runs, indent=1))
    print(report)


if __name__ == "__main__":
    main()
