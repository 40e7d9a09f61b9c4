"""How cost grows with the work: shardwrap's per-rank memory and step time at each ZeRO stage,
world size and model size, against each stage's memory formula.

    python benchmarks/scaling.py                  # 25m, 100m, 400m x N = 1, 2, 4 x stages 1-3
    python benchmarks/scaling.py --sizes 25m 100m --world-sizes 1 2 --stages 2 3 --steps 2
    python benchmarks/scaling.py --sizes 64x2x2 --world-sizes 1 2   # WIDTHxDEPTHxHEADS

Each cell is one ``torchrun`` launch of ``benchmarks/_worker.py`` (``compare.run_once``) with
``shardwrap-s<stage>``: the GPT of ``examples/train_gpt.py`` trained in fp32 with AdamW, the
per-rank batch and context fixed, so the work per rank is the same at every world size N (the
global batch grows with N). Measured: the median step time (slowest rank) and the per-rank peak
memory (the worst rank; on CPU the resident-set high-water mark above the resident set before
the model was built, so activations and transient buffers count). Predicted: the README's fp32
AdamW bytes per rank for Ψ parameters (``FORMULAS``); a cell meets the project's requirement
when measured / predicted is within ``TOLERANCE`` of 1. One launch of ``PROBE``, a GPT too small
to matter, per world size measures the fixed cost that every cell's peak includes (library
imports, first-use buffers); the report also gives each ratio net of it, as an aid to reading.
Output: ``benchmarks/results/scaling_<hardware>_<date>.md``, a JSON file and a PNG plot beside
it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from compare import HERE, commit, hardware, run_once

VOCAB = 256  # the worker's byte vocabulary
TOLERANCE = 0.10
# Bytes per rank for Ψ parameters on N ranks, fp32 AdamW: (a, b) in a·Ψ + b·Ψ/N.
FORMULAS = {
    # Peak: the full parameters (the shard is their 1/N slice), the gradient shard and both
    # AdamW moments (4 + 8 per parameter, over N), and every unit's full gradient, alive
    # together at the end of backward.
    1: (8, 12),
    # The full parameters, the gradient shard and both AdamW moments.
    2: (4, 12),
    # The parameter shard, its gradient and both AdamW moments.
    3: (0, 16),
}
REASONS = {
    1: "activations and transient buffers",
    2: "activations and the full gradients of the units being reduced (about two)",
    3: "activations and the gathered working set (a unit or two of full parameters and one "
    "unit's full gradient)",
}


@dataclass(frozen=True, kw_only=True)
class Size:
    """One GPT of ``examples/train_gpt.py`` over bytes."""

    name: str
    """What ``--sizes`` and the report call it."""
    width: int
    depth: int
    """Blocks, each one shardwrap unit."""
    heads: int

    def __post_init__(self) -> None:
        if min(self.width, self.depth, self.heads) < 1:
            raise ValueError(f"width, depth and heads must be positive, got {self}")
        if self.width % self.heads:
            raise ValueError(f"heads must divide width, got heads={self.heads} of {self.width}")


PROBE = Size(name="64x2x2", width=64, depth=2, heads=2)  # 137K parameters, 0.5 MB
SIZES = {
    s.name: s
    for s in (
        Size(name="25m", width=512, depth=8, heads=8),
        Size(name="100m", width=1024, depth=8, heads=16),
        Size(name="400m", width=2048, depth=8, heads=32),
    )
}


def size_arg(text: str) -> Size:
    """A name in ``SIZES`` or ``WIDTHxDEPTHxHEADS`` (``--sizes``)."""
    if text in SIZES:
        return SIZES[text]
    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)", text)
    if match is None:
        raise argparse.ArgumentTypeError(
            f"{text!r} is neither one of {', '.join(SIZES)} nor WIDTHxDEPTHxHEADS"
        )
    width, depth, heads = map(int, match.groups())
    try:
        return Size(name=text, width=width, depth=depth, heads=heads)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def block_params(size: Size) -> int:
    """One block: QKV 3w² + 3w, projection w² + w, MLP 8w² + 5w, two LayerNorms 4w."""
    return 12 * size.width**2 + 13 * size.width


def gpt_params(size: Size, context: int) -> int:
    """Ψ: the blocks, both embeddings, the final LayerNorm and the untied head."""
    return size.depth * block_params(size) + size.width * (2 * VOCAB + context + 2)


def formula(stage: int) -> str:
    """``FORMULAS[stage]`` as text, e.g. ``4Ψ + 12Ψ/N``."""
    a, b = FORMULAS[stage]
    return " + ".join(([f"{a}Ψ"] if a else []) + [f"{b}Ψ/N"])


def predicted_bytes(stage: int, params: int, world_size: int) -> float:
    a, b = FORMULAS[stage]
    return a * params + b * params / world_size


def summarize(
    size: Size, stage: int, result: dict[str, Any], fixed_mb: float | None
) -> dict[str, Any]:
    """One table row from the worker's result and ``PROBE``'s peak at its world size."""
    params, world, peak = result["params"], result["world_size"], result["peak_mb_per_rank"]
    predicted = predicted_bytes(stage, params, world) / 2**20
    ratio = peak / predicted
    net = None if fixed_mb is None else (peak - fixed_mb) / predicted
    return {
        "size": size.name,
        "stage": stage,
        "world_size": world,
        "params": params,
        "block_mb": 4 * block_params(size) / 2**20,
        "step_s": result["step_s"],
        "peak_mb": peak,
        "build_peak_mb": result["build_peak_mb_per_rank"],
        "predicted_mb": predicted,
        "ratio": ratio,
        "within": abs(ratio - 1) <= TOLERANCE,
        "fixed_mb": fixed_mb,
        "net_ratio": net,
        "net_within": None if net is None else abs(net - 1) <= TOLERANCE,
    }


def miss_reason(row: dict[str, Any]) -> str:
    """The likely reason a row is outside ``TOLERANCE``, from what its runs measured."""
    if row["build_peak_mb"] >= 0.99 * row["peak_mb"]:
        return (
            "the peak was set before training: every rank builds the unsharded model "
            f"(4Ψ = {4 * row['params'] / 2**20:.0f} MB) and wraps it, more than this stage "
            "holds at this N"
        )
    excess = row["peak_mb"] - row["predicted_mb"]
    if excess < 0:
        return "below the formula: not every term it counts was resident at the same time"
    parts, rest = [f"{excess:.0f} MB above the formula"], excess
    if row["fixed_mb"] is not None:
        parts.append(f"{row['fixed_mb']:.0f} MB of it is the fixed cost")
        rest -= row["fixed_mb"]
        if row["net_within"] or rest < 0:
            return "; ".join([*parts, f"net of it, {row['net_ratio']:.2f}x"])
    parts.append(
        f"the other {rest:.0f} MB ({rest / row['predicted_mb']:.0%} of the prediction) is "
        f"{REASONS[row['stage']]}, which the formula leaves out (one block's full parameters "
        f"are {row['block_mb']:.0f} MB)"
    )
    return "; ".join(parts)


def verdict_lines(rows: Sequence[dict[str, Any]], failed: Sequence[dict[str, Any]]) -> list[str]:
    misses = [r for r in rows if not r["within"]]
    lines = [
        f"{len(rows) - len(misses)} of {len(rows)} cells within {TOLERANCE:.0%} of their "
        f"stage's formula as measured (the requirement's check)"
        f"{'.' if not misses else '; outside it:'}",
        "",
    ]
    lines += [
        f"- {r['size']}, stage {r['stage']}, N={r['world_size']}: {r['ratio']:.2f}x, "
        f"{miss_reason(r)}."
        for r in misses
    ]
    netted = [r for r in rows if r["net_within"] is not None]
    if netted:
        lines += [
            "",
            f"Net of the fixed cost, {sum(r['net_within'] for r in netted)} of {len(netted)} "
            f"cells are within {TOLERANCE:.0%}.",
        ]
    if failed:
        lines += ["", "Cells that did not finish:", ""]
        lines += [
            f"- {f['size']}, stage {f['stage']}, N={f['world_size']}: {f['error']}" for f in failed
        ]
    return lines


def yes(within: bool) -> str:
    return "yes" if within else "NO"


def markdown(
    rows: Sequence[dict[str, Any]],
    failed: Sequence[dict[str, Any]],
    sizes: Sequence[Size],
    fixed_mb: dict[int, float],
    config: dict[str, Any],
    command: str,
) -> str:
    context = config["context"]
    fixed = ", ".join(f"{mb:.0f} MB at N={n}" for n, mb in sorted(fixed_mb.items())) or "not run"
    at_one = {(r["size"], r["stage"]): r["step_s"] for r in rows if r["world_size"] == 1}
    lines = [
        "# scaling: shardwrap's per-rank memory and step time by ZeRO stage, world size and "
        "model size",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, backend "
        f"{'nccl' if torch.cuda.is_available() else 'gloo'}, OMP_NUM_THREADS=1 per rank",
        f"- command: `{command}`, at commit {commit()}",
        f"- training: fp32 AdamW, batch {config['batch']} per rank, context {context}, "
        f"{config['warmup']} warm-up + {config['steps']} timed steps, one launch per cell; the "
        "work per rank is the same at every N (the global batch grows with N), and the N ranks "
        f"share the machine's {os.cpu_count()} cores",
        *(
            f"- {s.name}: GPT of `examples/train_gpt.py`, {s.depth} blocks of width {s.width}, "
            f"{s.heads} heads, byte vocabulary: Ψ = {gpt_params(s, context):,} parameters "
            f"(4Ψ = {4 * gpt_params(s, context) / 2**20:.0f} MB)"
            for s in sizes
        ),
        "- predicted: the README's fp32 AdamW bytes per rank for Ψ parameters on N ranks. "
        f"Stage 1, its peak `{formula(1)}`: the full parameters 4Ψ (the shard is their 1/N "
        "slice), the gradient shard 4Ψ/N, both AdamW moments 8Ψ/N, and every unit's full "
        "gradient, 4Ψ, alive together at the end of backward. "
        f"Stage 2, `{formula(2)}`: the same without the full gradients. "
        f"Stage 3, `{formula(3)}`: the parameter shard, its gradient and both moments. None "
        "counts activations, the gathered working set, transient buffers or the unsharded "
        "model each rank builds before wrapping",
        f"- within {TOLERANCE:.0%}: |measured / predicted - 1| <= {TOLERANCE}; MB = 2^20 bytes",
        f"- fixed cost per rank: {fixed}, the peak of the same run of a "
        f"{gpt_params(PROBE, context) / 1e3:.0f}K-parameter GPT ({PROBE.name}, stage 3): library "
        "imports (AdamW's constructor imports torch._dynamo) and first-use buffers, which every "
        "cell pays whatever its size. The last two columns subtract it, an aid to reading the "
        "table, not the requirement's check",
        "",
        "| model | Ψ | stage | N | step (s, median) | step vs N=1 | peak MB per rank "
        "| peak MB when wrapped | predicted MB | formula | measured / predicted "
        f"| within {TOLERANCE:.0%} | (peak - fixed) / predicted | within {TOLERANCE:.0%} net |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = at_one.get((r["size"], r["stage"]))
        vs_one = f"{r['step_s'] / one:.2f}" if one else "-"
        net = (
            "- | -" if r["net_ratio"] is None else f"{r['net_ratio']:.2f} | " + yes(r["net_within"])
        )
        lines.append(
            f"| {r['size']} | {r['params'] / 1e6:.1f}M | {r['stage']} | {r['world_size']} "
            f"| {r['step_s']:.2f} | {vs_one} | {r['peak_mb']:.0f} | {r['build_peak_mb']:.0f} "
            f"| {r['predicted_mb']:.0f} | {formula(r['stage'])} | {r['ratio']:.2f} "
            f"| {yes(r['within'])} | {net} |"
        )
    lines += ["", *verdict_lines(rows, failed)]
    lines += [
        "",
        "Step time: median over the timed steps, each the slowest rank's. Peak MB per rank: the "
        "worst rank's resident-set high-water mark above its resident set just before the model "
        "was built (CPU), or max_memory_allocated (GPU); it counts activations, transient "
        "buffers and the unsharded model every rank builds before wrapping. Peak MB when wrapped: "
        "the same mark when wrapping had ended, before the first step; where it equals the peak, "
        "building set the peak, not training.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Per-rank peak memory (predicted dashed) and step time against N, one column per size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(r["size"] for r in rows))
    fig, axes = plt.subplots(2, len(sizes), figsize=(4.5 * len(sizes), 7), squeeze=False)
    for col, name in enumerate(sizes):
        mine = [r for r in rows if r["size"] == name]
        memory, time = axes[0][col], axes[1][col]
        for stage in sorted({r["stage"] for r in mine}):
            line = sorted((r for r in mine if r["stage"] == stage), key=lambda r: r["world_size"])
            ns = [r["world_size"] for r in line]
            color = f"C{stage - 1}"
            memory.plot(ns, [r["peak_mb"] for r in line], "o-", color=color, label=f"stage {stage}")
            memory.plot(
                ns,
                [r["predicted_mb"] for r in line],
                "--",
                color=color,
                label=f"{formula(stage)} (predicted)",
            )
            time.plot(ns, [r["step_s"] for r in line], "o-", color=color, label=f"stage {stage}")
        memory.set_title(f"{name}: Ψ = {mine[0]['params'] / 1e6:.1f}M")
        memory.set_ylabel("peak memory per rank (MB)")
        time.set_ylabel("step time (s, median)")
        for ax in (memory, time):
            ax.set_xlabel("world size N")
            ax.set_xticks(sorted({r["world_size"] for r in mine}))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        memory.legend(fontsize=7)
        time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_cell(
    size: Size, stage: int, world_size: int, config: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Launch one cell; on failure the error, so that the rest of the grid still runs."""
    cfg = {**config, "width": size.width, "depth": size.depth, "heads": size.heads}
    try:
        return run_once(f"shardwrap-s{stage}", cfg, world_size, timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    except RuntimeError as e:
        text = str(e)
        killed = " (killed by SIGKILL: most likely out of memory)" if "SIGKILL" in text else ""
        return {"error": text.splitlines()[0] + killed, "output": text}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=size_arg,
        default=list(SIZES.values()),
        help=f"{', '.join(SIZES)} or WIDTHxDEPTHxHEADS; default: {' '.join(SIZES)}",
    )
    parser.add_argument("--world-sizes", nargs="+", type=int, default=[1, 2, 4])
    parser.add_argument("--stages", nargs="+", type=int, default=[1, 2, 3], choices=FORMULAS)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per cell")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2, help="per rank")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out-dir", type=Path, default=HERE / "results")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per cell")
    args = parser.parse_args()
    config = {
        "precision": "fp32",
        "batch": args.batch,
        "context": args.context,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    sizes = list(dict.fromkeys(args.sizes))
    world_sizes = sorted(set(args.world_sizes))
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    fixed_mb: dict[int, float] = {}

    def launch(size: Size, stage: int, world_size: int) -> dict[str, Any] | None:
        result = run_cell(size, stage, world_size, config, args.timeout)
        cell = {"size": size.name, "stage": stage, "world_size": world_size}
        runs.append({**cell, "result": result})
        if "error" in result:
            failed.append({**cell, "error": result["error"]})
            print(f"{size.name} stage {stage} N={world_size}: {result['error']}", flush=True)
            return None
        return result

    for world_size in world_sizes:
        probe = launch(PROBE, 3, world_size)
        if probe is not None:
            fixed_mb[world_size] = probe["peak_mb_per_rank"]
            print(f"fixed cost N={world_size}: {fixed_mb[world_size]:.0f} MB", flush=True)
    for size in sizes:
        for stage in sorted(set(args.stages)):
            for world_size in world_sizes:
                result = launch(size, stage, world_size)
                if result is None:
                    continue
                row = summarize(size, stage, result, fixed_mb.get(world_size))
                rows.append(row)
                print(
                    f"{size.name} stage {stage} N={world_size}: {row['step_s']:.2f} s/step, "
                    f"{row['peak_mb']:.0f} MB per rank, {row['ratio']:.2f}x predicted",
                    flush=True,
                )
    command = shlex.join(["python", "benchmarks/scaling.py", *sys.argv[1:]])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"scaling_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(rows, failed, sizes, fixed_mb, config, command)
    (args.out_dir / f"{stem}.md").write_text(report)
    sizes_json = {s.name: {**asdict(s), "params": gpt_params(s, args.context)} for s in sizes}
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps(
            {
                "config": config,
                "sizes": sizes_json,
                "formulas": {stage: formula(stage) for stage in FORMULAS},
                "tolerance": TOLERANCE,
                "fixed_mb": fixed_mb,
                "rows": rows,
                "failed": failed,
                "runs": runs,
            },
            indent=1,
            ensure_ascii=False,
        )
    )
    if rows:
        plot(rows, args.out_dir / f"{stem}.png")
    print(report)


if __name__ == "__main__":
    main()
