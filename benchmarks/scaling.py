"""How cost grows with the work: shardwrap's per-rank memory and step time at each ZeRO stage,
world size and model size, against each stage's memory formula.

    python benchmarks/scaling.py                  # 25m, 100m, 400m x N = 1, 2, 4 x stages 1-3
    python benchmarks/scaling.py --sizes 25m 100m --world-sizes 1 2 --stages 2 3 --steps 2
    python benchmarks/scaling.py --sizes 64x2x2 --world-sizes 1 2   # WIDTHxDEPTHxHEADS

Each cell is two ``torchrun`` launches of ``benchmarks/_worker.py`` (``_launch.run_once``) with
``shardwrap-s<stage>``: the GPT of ``examples/train_gpt.py`` trained in fp32 with AdamW, the
per-rank batch and context fixed, so the work per rank is the same at every world size N (the
global batch grows with N). The first launch measures the median step time (slowest rank) and
the resident-set peak; the second counts every storage each rank creates (``"track"``: the
CPU's counterpart of ``max_memory_allocated``, what the library and the model allocate, without
the allocator's retention) over a first and a steady second step. Predicted: each stage's
formula (docs/stages-and-tiers.md): the model states of ``FORMULAS`` plus the working set and
activations, evaluated on this model, batch and N by ``shardwrap.estimate_memory`` on the meta
device. A cell meets the project's requirement when the allocated peak is within
``TOLERANCE`` of the prediction; on GPU the first launch's ``max_memory_allocated`` is that
peak and the second launch is skipped. Output:
``benchmarks/results/scaling/scaling_<hardware>_<date>.md``, a JSON file and a PNG plot beside it.
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
from _launch import ROOT, commit, hardware, results_dir, run_once

sys.path.insert(0, str(ROOT))

from shardwrap import estimate_memory  # noqa: E402

VOCAB = 256  # the worker's byte vocabulary
TOLERANCE = 0.10
# Model states per rank for Ψ parameters on N ranks, fp32 AdamW, bytes: (a, b) in a·Ψ + b·Ψ/N.
FORMULAS = {
    # The full parameters (the shard is their 1/N slice), the gradient shard and both AdamW
    # moments, and at the end of backward every unit's full gradient.
    1: (8, 12),
    # The full parameters, the gradient shard and both AdamW moments.
    2: (4, 12),
    # The parameter shard, its gradient and both AdamW moments.
    3: (0, 16),
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


def states_bytes(stage: int, params: int, world_size: int) -> float:
    a, b = FORMULAS[stage]
    return a * params + b * params / world_size


def planned(size: Size, stage: int, world_size: int, config: dict[str, Any]) -> dict[str, float]:
    """The stage's formula on this model: ``estimate_memory``'s parts at its peak, in MB."""
    context = config["context"]
    kwargs = {"vocab": VOCAB, "width": size.width, "depth": size.depth, "heads": size.heads}
    plan = estimate_memory(
        "examples.train_gpt:GPT",
        world_size=world_size,
        stage=stage,
        batch=config["batch"],
        seq=context,
        kwargs={**kwargs, "context": context},
    )
    row = plan.row(stage)
    parts = ("params", "grads", "optimizer", "working_set", "activations", "peak")
    return {part: getattr(row, part) / 2**20 for part in parts} | {"phase": row.phase}


def summarize(
    size: Size, stage: int, timed: dict[str, Any], allocated_mb: float, plan: dict[str, Any]
) -> dict[str, Any]:
    """One table row from the timed launch, the allocated peak and the plan."""
    params, world = timed["params"], timed["world_size"]
    ratio = allocated_mb / plan["peak"]
    return {
        "size": size.name,
        "stage": stage,
        "world_size": world,
        "params": params,
        "block_mb": 4 * block_params(size) / 2**20,
        "step_s": timed["step_s"],
        "resident_mb": timed["peak_mb_per_rank"],
        "build_resident_mb": timed["build_peak_mb_per_rank"],
        "allocated_mb": allocated_mb,
        "states_mb": states_bytes(stage, params, world) / 2**20,
        "plan": plan,
        "predicted_mb": plan["peak"],
        "ratio": ratio,
        "within": abs(ratio - 1) <= TOLERANCE,
    }


def verdict_lines(rows: Sequence[dict[str, Any]], failed: Sequence[dict[str, Any]]) -> list[str]:
    misses = [r for r in rows if not r["within"]]
    lines = [
        f"{len(rows) - len(misses)} of {len(rows)} cells have their allocated peak within "
        f"{TOLERANCE:.0%} of their stage's formula (the requirement's check)"
        f"{'.' if not misses else '; outside it:'}",
        "",
    ]
    lines += [
        f"- {r['size']}, stage {r['stage']}, N={r['world_size']}: {r['ratio']:.2f}x "
        f"({r['allocated_mb']:.0f} MB allocated, {r['predicted_mb']:.0f} MB predicted)."
        for r in misses
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
    config: dict[str, Any],
    command: str,
) -> str:
    context = config["context"]
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
        f"- training: fp32 AdamW, batch {config['batch']} per rank, context {context}; the timed "
        f"launch runs {config['warmup']} warm-up + {config['steps']} timed steps, the tracked "
        "launch 2 steps; the work per rank is the same at every N (the global batch grows with "
        f"N), and the N ranks share the machine's {os.cpu_count()} cores",
        *(
            f"- {s.name}: GPT of `examples/train_gpt.py`, {s.depth} blocks of width {s.width}, "
            f"{s.heads} heads, byte vocabulary: Ψ = {gpt_params(s, context):,} parameters "
            f"(4Ψ = {4 * gpt_params(s, context) / 2**20:.0f} MB; one block "
            f"{4 * block_params(s) / 2**20:.0f} MB)"
            for s in sizes
        ),
        "- model states: "
        + "; ".join(f"stage {st}: `{formula(st)}`" for st in FORMULAS)
        + " (fp32 parameters, gradients and AdamW's two moments; stage 1 counts every unit's "
        "full gradient, alive together at the end of backward)",
        "- predicted: the stage's formula, model states plus the working set (stage 3's gathered "
        "units, every stage's per-parameter and flat gradients of the units in backward, "
        "the reductions in flight) and activations, evaluated by `shardwrap.estimate_memory` "
        "on the meta device for this model, batch and N, at its peak",
        "- allocated: the worst rank's peak of live bytes in every storage created after wrapping "
        "(the tracked launch; on CPU the counterpart of max_memory_allocated), the "
        f"requirement's check: within {TOLERANCE:.0%} means |allocated / predicted - 1| <= "
        f"{TOLERANCE}. MB = 2^20 bytes",
        "- resident: the worst rank's resident-set high-water mark above its resident set before "
        "the model was built (the timed launch): what the operating system sees, adding the "
        "allocator's retention and fragmentation, library code paged in on first use, and the "
        "unsharded model each rank builds before wrapping",
        "",
        "| model | stage | N | step (s, median) | step vs N=1 | model states MB | predicted MB "
        f"| allocated MB | allocated / predicted | within {TOLERANCE:.0%} | resident MB "
        "| resident / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        one = at_one.get((r["size"], r["stage"]))
        vs_one = f"{r['step_s'] / one:.2f}" if one else "-"
        lines.append(
            f"| {r['size']} | {r['stage']} | {r['world_size']} | {r['step_s']:.2f} | {vs_one} "
            f"| {r['states_mb']:.0f} | {r['predicted_mb']:.0f} | {r['allocated_mb']:.0f} "
            f"| {r['ratio']:.3f} | {yes(r['within'])} | {r['resident_mb']:.0f} "
            f"| {r['resident_mb'] / r['predicted_mb']:.2f} |"
        )
    lines += ["", *verdict_lines(rows, failed)]
    lines += [
        "",
        "The prediction's parts at its peak (MB: params, grads, optimizer, working set, "
        "activations; where the peak falls):",
        "",
    ]
    lines += [
        f"- {r['size']}, stage {r['stage']}, N={r['world_size']}: "
        + ", ".join(
            f"{r['plan'][k]:.0f}"
            for k in ("params", "grads", "optimizer", "working_set", "activations")
        )
        + f"; {r['plan']['phase']}"
        for r in rows
    ]
    lines += [
        "",
        "Step time: median over the timed steps, each the slowest rank's.",
    ]
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Per-rank allocated peak (predicted dashed, model states dotted) and step time against
    N, one column per size."""
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
            memory.plot(
                ns, [r["allocated_mb"] for r in line], "o-", color=color, label=f"stage {stage}"
            )
            memory.plot(ns, [r["predicted_mb"] for r in line], "--", color=color)
            memory.plot(ns, [r["states_mb"] for r in line], ":", color=color)
            time.plot(ns, [r["step_s"] for r in line], "o-", color=color, label=f"stage {stage}")
        memory.set_title(f"{name}: Ψ = {mine[0]['params'] / 1e6:.1f}M")
        memory.set_ylabel("allocated peak per rank (MB)")
        time.set_ylabel("step time (s, median)")
        for ax in (memory, time):
            ax.set_xlabel("world size N")
            ax.set_xticks(sorted({r["world_size"] for r in mine}))
            ax.set_ylim(bottom=0)
            ax.grid(alpha=0.3)
        memory.legend(title="measured; predicted --; model states ..", fontsize=7, title_fontsize=7)
        time.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_cell(
    size: Size, stage: int, world_size: int, config: dict[str, Any], timeout: float
) -> dict[str, Any]:
    """Launch one run of a cell; on failure the error, so that the rest of the grid still runs."""
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
    parser.add_argument("--out-dir", type=Path, default=results_dir("scaling"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    args = parser.parse_args()
    config = {
        "precision": "fp32",
        "batch": args.batch,
        "context": args.context,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    tracked = {**config, "warmup": 2, "steps": 1, "track": True}
    sizes = list(dict.fromkeys(args.sizes))
    world_sizes = sorted(set(args.world_sizes))
    rows: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    runs: list[dict[str, Any]] = []
    for size in sizes:
        for stage in sorted(set(args.stages)):
            for world_size in world_sizes:
                cell = {"size": size.name, "stage": stage, "world_size": world_size}
                timed = run_cell(size, stage, world_size, config, args.timeout)
                counted = (
                    {"tracked_peak_mb_per_rank": timed.get("peak_mb_per_rank")}
                    if torch.cuda.is_available()
                    else run_cell(size, stage, world_size, tracked, args.timeout)
                )
                runs.append({**cell, "timed": timed, "tracked": counted})
                error = timed.get("error") or counted.get("error")
                if error:
                    failed.append({**cell, "error": error})
                    print(f"{size.name} stage {stage} N={world_size}: {error}", flush=True)
                    continue
                plan = planned(size, stage, world_size, config)
                row = summarize(size, stage, timed, counted["tracked_peak_mb_per_rank"], plan)
                rows.append(row)
                print(
                    f"{size.name} stage {stage} N={world_size}: {row['step_s']:.2f} s/step, "
                    f"{row['allocated_mb']:.0f} MB allocated, {row['ratio']:.3f}x predicted, "
                    f"{row['resident_mb']:.0f} MB resident",
                    flush=True,
                )
    command = shlex.join(["python", "benchmarks/scaling.py", *sys.argv[1:]])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"scaling_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(rows, failed, sizes, config, command)
    (args.out_dir / f"{stem}.md").write_text(report)
    sizes_json = {s.name: {**asdict(s), "params": gpt_params(s, args.context)} for s in sizes}
    (args.out_dir / f"{stem}.json").write_text(
        json.dumps(
            {
                "config": config,
                "sizes": sizes_json,
                "formulas": {stage: formula(stage) for stage in FORMULAS},
                "tolerance": TOLERANCE,
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
