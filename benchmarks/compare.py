"""shardwrap at ZeRO stages 1-3 against FSDP2, DDP, DeepSpeed ZeRO and an unsharded process.

    python benchmarks/compare.py                          # the reference configuration
    python benchmarks/compare.py --precision bf16         # bf16 mixed precision
    python benchmarks/compare.py --precision fp32 bf16    # both, side by side
    python benchmarks/compare.py --methods shardwrap-s3 fsdp2 --rounds 3 --steps 6
    python benchmarks/compare.py --config '{"width": 256, "depth": 2}' --theme tiny
    python benchmarks/compare.py --config '{"model": "t5", "width": 512, "heads": 8}' --theme t5

Every method trains the same model (same seed, batch, torch AdamW) under ``torchrun``, each
run in fresh processes so that memory high-water marks are its own. Methods and precisions
alternate (A B C A B C ...) so that drift of this shared machine hits all of them alike. For
each method and precision the report gives the median step time over all rounds, tokens/s per
rank, the peak memory per rank (worst round), the bytes handed to collectives per step, the
final loss, the largest per-step loss difference from DDP (the same training, so near zero),
and the ratios to FSDP2 and DDP of the same precision; then the target ratios of shardwrap
against DeepSpeed at each stage, DDP and FSDP2, each met or not (``TARGETS``). ``bf16`` is
mixed precision on fp32 master weights (see ``benchmarks/_worker.py``). The DeepSpeed rows need
the ``bench`` extra (``pip install -e '.[bench]'`` or ``make bench``); without it they are
skipped unless asked for. Output: ``benchmarks/results/compare/<theme>_<hardware>_<date>.md``, a
JSON file and a PNG bar chart beside it.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from _launch import commit, hardware, results_dir, run_once

DEEPSPEED = ("deepspeed-s1", "deepspeed-s2", "deepspeed-s3")
METHODS = (
    "shardwrap-s1",
    "shardwrap-s2",
    "shardwrap-s3",
    "fsdp2",
    "fsdp2-noreshard",
    "ddp",
    "single",
    *DEEPSPEED,
)
ALIASES = {"shardwrap": "shardwrap-s3"}
PRECISIONS = ("fp32", "bf16")
# What the worker can train with (``benchmarks/optimizers.py`` compares them): AdamW; Muon on the
# matrices with AdamW on the rest; Adafactor.
OPTIMIZERS = ("adamw", "muon", "adafactor")
# shardwrap's targets at every precision: (method, reference, bound on the ratio of step
# times, bound on the ratio of peak memory or None).
TARGETS = (
    ("shardwrap-s1", "deepspeed-s1", 0.75, 0.6),
    ("shardwrap-s2", "deepspeed-s2", 0.75, 0.6),
    ("shardwrap-s3", "deepspeed-s3", 0.75, 0.6),
    ("shardwrap-s2", "ddp", 1.0, None),
    ("shardwrap-s3", "fsdp2", 0.6, 0.85),
)
RECIPES = {
    "fp32": "fp32 AdamW",
    "bf16": "AdamW on fp32 master weights, bf16 compute, gradients reduced in fp32: shardwrap "
    "`MixedPrecision(param_dtype=bfloat16, reduce_dtype=float32)`, FSDP2 "
    "`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)` on every "
    "`fully_shard`, DDP and single under `torch.autocast(dtype=bfloat16)`, DeepSpeed "
    '`"bf16": {"enabled": true}, "communication_data_type": "fp32"`; loss in fp32',
}
INSTALL_HINT = "pip install -e '.[bench]' or make bench"


def select_methods(
    requested: Sequence[str] | None, default: Sequence[str], have_deepspeed: bool
) -> tuple[list[str], list[str]]:
    """The methods to run, aliases resolved, and the DeepSpeed ones skipped for lack of it.

    Raises:
        SystemExit: a DeepSpeed method was asked for by name and DeepSpeed is not installed.
    """
    methods = list(dict.fromkeys(ALIASES.get(m, m) for m in (requested or default)))
    missing = [m for m in methods if m in DEEPSPEED and not have_deepspeed]
    if missing and requested:
        raise SystemExit(
            f"DeepSpeed is not installed, needed by {', '.join(missing)}: {INSTALL_HINT}"
        )
    return [m for m in methods if m not in missing], missing


def deepspeed_installed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


def deepspeed_version() -> str:
    if not deepspeed_installed():
        return "no DeepSpeed"
    from importlib.metadata import version

    return f"DeepSpeed {version('deepspeed')}"


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """One row per method of one precision, with ratios to that precision's FSDP2 and DDP.

    ``loss_diff_vs_ddp`` is the largest per-step loss difference from DDP in the last round,
    warm-up steps included: every method but ``single`` trains the same global batch.
    """
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
    for method, row in rows.items():
        for ref in ("fsdp2", "ddp"):
            if ref in rows:
                row[f"time_vs_{ref}"] = row["step_s"] / rows[ref]["step_s"]
                row[f"memory_vs_{ref}"] = row["peak_mb_per_rank"] / rows[ref]["peak_mb_per_rank"]
        if "ddp" in runs:
            ddp = runs["ddp"][-1]["losses"]
            row["loss_diff_vs_ddp"] = max(
                abs(a - b) for a, b in zip(runs[method][-1]["losses"], ddp)
            )
    return rows


def target_lines(rows: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Each of ``TARGETS`` whose two methods ran, met or not, then a count per precision."""
    lines = []
    for precision, by_method in rows.items():
        met = total = 0
        for method, ref, *bounds in TARGETS:
            if method not in by_method or ref not in by_method:
                continue
            checks = []
            for key, label, bound in zip(
                ("step_s", "peak_mb_per_rank"), ("step time", "peak memory"), bounds
            ):
                if bound is None:
                    continue
                ratio = by_method[method][key] / by_method[ref][key]
                met, total = met + (ratio <= bound), total + 1
                verdict = "met" if ratio <= bound else "NOT met"
                checks.append(f"{label} {ratio:.2f}x {ref}'s (target <= {bound}x): {verdict}")
            lines.append(f"- {precision}, {method} vs {ref}: {'; '.join(checks)}.")
        if total:
            lines.append(f"- {precision}: {met} of {total} targets met.")
    return lines


def model_line(cfg: dict[str, Any], params: int) -> str:
    shape = (
        f"GPT, {cfg['depth']} blocks"
        if cfg["model"] == "gpt"
        else f"T5, {cfg['depth']} encoder and {cfg['depth']} decoder blocks"
    )
    return (
        f"- model: {shape} of width {cfg['width']}, {cfg['heads']} heads, byte vocabulary, "
        f"context {cfg['context']}, {params / 1e6:.1f}M parameters"
    )


def markdown(
    rows: dict[str, dict[str, dict[str, float]]],
    runs: dict[str, dict[str, list[dict[str, Any]]]],
    args: argparse.Namespace,
) -> str:
    first = next(iter(next(iter(runs.values())).values()))[0]
    cfg = first["config"]
    lines = [
        f"# {args.theme}: shardwrap vs FSDP2, DDP, DeepSpeed ZeRO and one unsharded process",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, "
        f"{deepspeed_version()}, backend {'nccl' if torch.cuda.is_available() else 'gloo'}, "
        f"{args.nproc} ranks, OMP_NUM_THREADS=1",
        model_line(cfg, first["params"]),
        f"- training: batch {cfg['batch']} per rank, {cfg['warmup']} warm-up + "
        f"{cfg['steps']} timed steps per run, {args.rounds} alternating rounds per method "
        "and precision",
        *(f"- {precision}: {RECIPES[precision]}" for precision in rows),
        *(
            [f"- skipped, DeepSpeed not installed ({INSTALL_HINT}): {', '.join(args.skipped)}"]
            if args.skipped
            else []
        ),
        f"- command: `python benchmarks/compare.py {' '.join(sys.argv[1:])}`, at commit {commit()}",
        "",
        "| method | precision | step (s, median) | tokens/s per rank | peak MB per rank "
        "| comm MB per step | final loss | max loss diff vs DDP | time vs FSDP2 "
        "| memory vs FSDP2 | time vs DDP | memory vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for precision, by_method in rows.items():
        for method, r in by_method.items():
            ratios = " | ".join(
                f"{r[key]:.2f}" if key in r else "-"
                for key in ("time_vs_fsdp2", "memory_vs_fsdp2", "time_vs_ddp", "memory_vs_ddp")
            )
            diff = f"{r['loss_diff_vs_ddp']:.1e}" if "loss_diff_vs_ddp" in r else "-"
            lines.append(
                f"| {method} | {precision} | {r['step_s']:.2f} | "
                f"{r['tokens_per_s_per_rank']:.1f} | {r['peak_mb_per_rank']:.0f} | "
                f"{r['comm_mb_per_step']:.0f} | {r['final_loss']:.4f} | {diff} | {ratios} |"
            )
    checks = target_lines(rows)
    if checks:
        lines += ["", "shardwrap's targets, against methods of the same precision:", "", *checks]
    lines += ["", "Step times of every run, in order:", ""]
    for precision, by_method in runs.items():
        for method, results in by_method.items():
            times = ", ".join(f"{t:.2f}" for r in results for t in r["step_times"])
            lines.append(f"- {method} {precision}: {times}")
    lines += [
        "",
        "Ratios compare methods of the same precision. Peak memory: resident-set high-water "
        "mark above the resident set just before the model was built, after the process group "
        "and the method's library were set up (CPU), or max_memory_allocated (GPU); the worst "
        "rank of the worst round. Comm MB: buffers handed to collectives per step (all-gather "
        "output, reduce-scatter input, all-reduce, reduce and broadcast tensor), in the dtype "
        "they travel in. Final loss: rank 0's fp32 loss on the last timed step of the last "
        "round; max loss diff vs DDP: the largest difference from DDP's loss over that round's "
        "steps. `single` trains an unsharded copy on every rank with no communication (its "
        "losses differ from the second step on). `fsdp2-noreshard`: FSDP2 with "
        "`reshard_after_forward=False`. `deepspeed-sN`: DeepSpeed ZeRO stage N with its "
        "default bucket and stage-3 settings, gradient clipping off, the torch AdamW as its "
        "client optimizer.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = [(m, p, r) for p, by_method in rows.items() for m, r in by_method.items()]
    labels = [m if len(rows) == 1 else f"{m}\n{p}" for m, p, _ in bars]
    fig, axes = plt.subplots(2, 1, figsize=(max(6, 0.9 * len(bars)), 7))
    for ax, key, label in zip(
        axes, ("step_s", "peak_mb_per_rank"), ("step time (s)", "peak memory per rank (MB)")
    ):
        drawn = ax.bar(
            labels,
            [r[key] for _, _, r in bars],
            color=["C0" if m.startswith("shardwrap") else "C7" for m, _, _ in bars],
            hatch=["//" if p == "bf16" else "" for _, p, _ in bars],
        )
        ax.bar_label(drawn, fmt="%.2f" if key == "step_s" else "%.0f")
        ax.set_title(label)
        ax.tick_params(axis="x", labelrotation=45, labelsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", nargs="+", choices=[*METHODS, *ALIASES], help="default: every method"
    )
    parser.add_argument("--precision", nargs="+", default=["fp32"], choices=PRECISIONS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--config", default="{}", help="JSON overrides of benchmarks/_worker.py Config"
    )
    parser.add_argument(
        "--theme", help="default: gpt101m_<precisions> (t5_<precisions>), e.g. gpt101m_bf16"
    )
    parser.add_argument("--out-dir", type=Path, default=results_dir("compare"))
    parser.add_argument("--timeout", type=float, default=1200)
    args = parser.parse_args()
    methods, args.skipped = select_methods(args.methods, METHODS, deepspeed_installed())
    if args.skipped:
        print(f"DeepSpeed is not installed ({INSTALL_HINT}): skipping {', '.join(args.skipped)}")
    precisions = list(dict.fromkeys(args.precision))
    config = {"steps": args.steps, **json.loads(args.config)}
    model = "t5" if config.get("model") == "t5" else "gpt101m"
    args.theme = args.theme or f"{model}_" + "_".join(precisions)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        p: {m: [] for m in methods} for p in precisions
    }
    for round_ in range(args.rounds):
        for precision in precisions:
            for method in methods:
                result = run_once(
                    method, {**config, "precision": precision}, args.nproc, args.timeout
                )
                runs[precision][method].append(result)
                print(
                    f"round {round_ + 1} {method} {precision}: {result['step_s']:.2f} s/step, "
                    f"{result['peak_mb_per_rank']:.0f} MB, final loss {result['final_loss']:.4f}",
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
