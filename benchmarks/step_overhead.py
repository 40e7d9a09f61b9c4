"""The fixed cost of a unit per training step: shardwrap at stages 2 and 3 against FSDP2 and DDP
on a tiny Hugging Face T5, where that cost, not compute, sets the step time.

    python benchmarks/step_overhead.py                        # the reference configuration
    python benchmarks/step_overhead.py --depths 2 --rounds 2 --steps 10
    python benchmarks/step_overhead.py --profile shardwrap-s3 # where shardwrap's time goes

Every method trains ``T5ForConditionalGeneration`` of width 64 (``benchmarks/_worker.py``,
``"model": "t5"``: ``depth`` encoder and ``depth`` decoder blocks, random weights, byte
vocabulary) on 2 ranks under ``torchrun`` with gloo and ``OMP_NUM_THREADS=1``, in fresh processes,
methods alternating round by round (``benchmarks/_launch.py``). Each sharded method runs twice
per depth: every ``T5Block`` its own unit (``wrap`` ``block``: ``2 * depth + 1`` units with the
root) and the whole model one unit (``wrap`` ``root``). The two train the same model with the
same bytes communicated, so the difference of their step times is what the extra units cost;
per depth, ``(t_block - t_root) / (units - 1)`` is the cost of one unit per step, and over all
depths the least-squares slope of ``t = a_depth + b * units`` (one intercept per depth, one
slope) is the fixed cost ``b``. Both are given for wall time (the slowest rank) and for CPU time
(the busiest rank's, every thread; steadier on a shared machine).

``--profile METHOD`` runs one more launch instead, at the first depth: rank 0 trains under
``cProfile`` and the report lists the functions with the most time of their own, and
shardwrap's own functions by cumulative time.

Output: ``benchmarks/results/step_overhead/<theme>_<hardware>_<date>.md`` and a JSON file of every
run beside it (``<theme>_profile_...`` for ``--profile``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import json
import os
import platform
import pstats
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from _launch import HERE, commit, end_ranks, hardware, results_dir, run_once, torchrun

SHARDED = ("fsdp2", "shardwrap-s2", "shardwrap-s3")
METHODS = ("ddp", *SHARDED)


def units_of(method: str, wrap: str, depth: int) -> int:
    """Units (FSDP2: ``fully_shard`` groups) of a T5 with ``depth`` blocks a side; DDP: 1."""
    return 2 * depth + 1 if method in SHARDED and wrap == "block" else 1


def slope(points: dict[int, list[tuple[int, float]]]) -> float:
    """Least-squares ``b`` of ``t = a_depth + b * units`` over ``{depth: [(units, t), ...]}``."""
    num = den = 0.0
    for pts in points.values():
        mu = statistics.fmean(u for u, _ in pts)
        mt = statistics.fmean(t for _, t in pts)
        num += sum((u - mu) * (t - mt) for u, t in pts)
        den += sum((u - mu) ** 2 for u, _ in pts)
    return num / den if den else float("nan")


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Rows keyed ``depth/method/wrap`` with medians and ratios, and each method's fixed cost."""
    rows: dict[str, dict[str, Any]] = {}
    for key, results in runs.items():
        depth, method, wrap = key.split("/")
        times = [t for r in results for t in r["step_times"]]
        cpu = [t for r in results for t in r["cpu_step_times"]]
        calls = results[-1]["comm_calls_per_step"]
        handshakes = results[-1].get("comm_calls_per_step_by_kind", {}).get("handshake")
        rows[key] = {
            "depth": int(depth),
            "method": method,
            "wrap": wrap,
            "units": units_of(method, wrap, int(depth)),
            "step_ms": 1e3 * statistics.median(times),
            "cpu_ms": 1e3 * statistics.median(cpu),
            "comm_calls_per_step": calls,
            "handshakes_per_step": handshakes,
            "final_loss": results[-1]["final_loss"],
            "losses": results[-1]["losses"],
        }
    for row in rows.values():
        for ref in ("ddp", "fsdp2"):
            ref_wrap = "block" if ref == "ddp" else row["wrap"]
            other = rows.get(f"{row['depth']}/{ref}/{ref_wrap}")
            if other is not None:
                row[f"time_vs_{ref}"] = row["step_ms"] / other["step_ms"]
                row[f"cpu_vs_{ref}"] = row["cpu_ms"] / other["cpu_ms"]
                row[f"loss_diff_vs_{ref}"] = max(
                    abs(a - b) for a, b in zip(row["losses"], other["losses"])
                )
    per_unit: dict[str, dict[str, Any]] = {}
    for method in SHARDED:
        wall: dict[int, list[tuple[int, float]]] = {}
        cpu: dict[int, list[tuple[int, float]]] = {}
        for row in rows.values():
            if row["method"] == method:
                wall.setdefault(row["depth"], []).append((row["units"], row["step_ms"]))
                cpu.setdefault(row["depth"], []).append((row["units"], row["cpu_ms"]))
        fits = {d: pts for d, pts in wall.items() if len({u for u, _ in pts}) > 1}
        if fits:
            per_unit[method] = {
                "wall_ms_per_unit": slope(fits),
                "cpu_ms_per_unit": slope({d: cpu[d] for d in fits}),
                "by_depth_wall_ms_per_unit": {d: slope({d: pts}) for d, pts in fits.items()},
            }
    return {"rows": rows, "per_unit": per_unit}


def markdown(summary: dict[str, Any], args: argparse.Namespace, params: dict[int, int]) -> str:
    rows, per_unit = summary["rows"], summary["per_unit"]
    lines = [
        f"# {args.theme}: the fixed cost of a unit per step, shardwrap vs FSDP2 and DDP",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, backend "
        f"{'nccl' if torch.cuda.is_available() else 'gloo'}, {args.nproc} ranks, "
        "OMP_NUM_THREADS=1",
        f"- model: T5ForConditionalGeneration, width {args.width}, {args.heads} heads, "
        f"d_ff {4 * args.width}, vocabulary 256, depth (encoder and decoder blocks each) "
        + ", ".join(f"{d} ({p / 1e3:.0f}k parameters)" for d, p in params.items()),
        f"- training: fp32 AdamW, batch {args.batch} per rank, context {args.context}, "
        f"{args.warmup} warm-up + {args.steps} timed steps per run, {args.rounds} alternating "
        "rounds",
        f"- command: `python benchmarks/step_overhead.py {' '.join(sys.argv[1:])}`, at commit "
        f"{commit()}",
        "",
        "| depth | method | wrap | units | step ms (median) | CPU ms (median) | vs DDP | "
        "vs FSDP2 | CPU vs DDP | CPU vs FSDP2 | collective calls per step | handshakes per step | "
        "max loss diff vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows.values():
        ratio = " | ".join(
            f"{r[k]:.2f}" if k in r else "-"
            for k in ("time_vs_ddp", "time_vs_fsdp2", "cpu_vs_ddp", "cpu_vs_fsdp2")
        )
        hs = "-" if r["handshakes_per_step"] is None else f"{r['handshakes_per_step']:.0f}"
        diff = f"{r['loss_diff_vs_ddp']:.1e}" if "loss_diff_vs_ddp" in r else "-"
        lines.append(
            f"| {r['depth']} | {r['method']} | {r['wrap']} | {r['units']} | {r['step_ms']:.1f} "
            f"| {r['cpu_ms']:.1f} | {ratio} | {r['comm_calls_per_step']:.0f} | {hs} | {diff} |"
        )
    lines += [
        "",
        "Fixed cost of one unit per step (least-squares slope over depths, then per depth):",
        "",
        "| method | wall ms per unit | CPU ms per unit | wall ms per unit, by depth |",
        "|---|---|---|---|",
    ]
    for method, fit in per_unit.items():
        by_depth = ", ".join(f"{d}: {v:.2f}" for d, v in fit["by_depth_wall_ms_per_unit"].items())
        lines.append(
            f"| {method} | {fit['wall_ms_per_unit']:.2f} | {fit['cpu_ms_per_unit']:.2f} | "
            f"{by_depth} |"
        )
    lines += [
        "",
        "Step ms: wall time of a training step (forward, backward, optimizer step) on the slowest "
        "rank, median over every timed step of every round; CPU ms: the busiest rank's CPU time "
        "of the step (every thread). Ratios: to DDP at the same depth, to FSDP2 at the same depth "
        "and wrap. Collective calls: shardwrap's own count (handshakes, all-gathers, "
        "reduce-scatters), the others' calls of torch.distributed's collectives. Max loss diff: "
        "over the last round's steps, every method training the same global batch.",
    ]
    return "\n".join(lines) + "\n"


def profile_rank(method: str, config: dict[str, Any], steps: int, top: int) -> None:
    """Under torchrun: train ``method`` and print rank 0's profile of ``steps`` steps."""
    import torch.distributed as dist
    import torch.nn.functional as F

    sys.path.insert(0, str(HERE))
    from _worker import ByteCounter, Config, build, logits_of

    dist.init_process_group("gloo")
    cfg = Config(**config)
    trainer = build(method, cfg, torch.device("cpu"), ByteCounter())
    gen = torch.Generator().manual_seed(cfg.seed + dist.get_rank())

    def step() -> None:
        tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen)
        logits = logits_of(trainer.model, cfg, tokens[:, :-1])
        trainer.backward(F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()))
        trainer.step()

    for _ in range(cfg.warmup):
        step()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    if dist.get_rank() == 0:
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        stats.sort_stats("tottime").print_stats(top)
        stats.sort_stats("cumulative").print_stats("shardwrap", top)
        print("PROFILE " + json.dumps({"steps": steps, "text": out.getvalue()}), flush=True)
    end_ranks()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--depths", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--theme", default="t5w64")
    parser.add_argument("--profile", choices=SHARDED, help="profile this method instead")
    parser.add_argument("--profile-rank", help=argparse.SUPPRESS)  # set by --profile's launch
    parser.add_argument("--out-dir", type=Path, default=results_dir("step_overhead"))
    parser.add_argument("--timeout", type=float, default=600)
    args = parser.parse_args()
    base = {
        "model": "t5",
        "width": args.width,
        "heads": args.heads,
        "batch": args.batch,
        "context": args.context,
        "warmup": args.warmup,
        "steps": args.steps,
    }
    if args.profile_rank:
        method, config = json.loads(args.profile_rank)
        profile_rank(method, config, args.steps, top=40)
        return
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    if args.profile:
        config = {**base, "depth": args.depths[0]}
        spec = json.dumps([args.profile, config])
        proc = torchrun(
            Path(__file__), "--profile-rank", spec, "--steps", str(args.steps),
            nproc=args.nproc, timeout=args.timeout,
        )  # fmt: skip
        line = next((x for x in proc.stdout.splitlines() if x.startswith("PROFILE ")), None)
        if line is None:
            raise RuntimeError(f"profile failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        text = json.loads(line[len("PROFILE ") :])["text"]
        report = (
            f"# {args.theme}: cProfile of {args.profile}, rank 0, {args.steps} steps\n\n"
            f"- config: `{json.dumps(config)}`, 2 ranks, gloo, at commit {commit()}\n"
            f"- command: `python benchmarks/step_overhead.py {' '.join(sys.argv[1:])}`\n\n"
            f"```\n{text.strip()}\n```\n"
        )
        (args.out_dir / f"{args.theme}_profile_{args.profile}_{hardware()}.md").write_text(report)
        print(report)
        return
    combos = [("ddp", "block")] if "ddp" in args.methods else []
    combos += [(m, w) for m in args.methods if m in SHARDED for w in ("block", "root")]
    runs: dict[str, list[dict[str, Any]]] = {}
    params: dict[int, int] = {}
    for round_ in range(args.rounds):
        for depth in args.depths:
            for method, wrap in combos:
                config = {**base, "depth": depth, "wrap": wrap}
                result = run_once(method, config, args.nproc, args.timeout)
                params[depth] = result["params"]
                runs.setdefault(f"{depth}/{method}/{wrap}", []).append(result)
                print(
                    f"round {round_ + 1} depth {depth} {method} {wrap}: "
                    f"{1e3 * result['step_s']:.1f} ms/step",
                    flush=True,
                )
    summary = summarize(runs)
    report = markdown(summary, args, params)
    (args.out_dir / f"{stem}.md").write_text(report)
    (args.out_dir / f"{stem}.json").write_text(json.dumps({**summary, "runs": runs}, indent=1))
    print(report)


if __name__ == "__main__":
    main()
