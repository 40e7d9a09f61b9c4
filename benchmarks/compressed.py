"""Compressed communication: shardwrap with and without ``Compression`` against DDP, FSDP2 and
DeepSpeed ZeRO-3 (with and without its ZeRO++ options), on a rate-limited link and on the open
loopback, in one run.

    python benchmarks/compressed.py                       # 2 ranks, 2 Gbit/s and open
    python benchmarks/compressed.py --nproc 4 --methods shardwrap-s3 shardwrap-s3-int8 ddp fsdp2
    python benchmarks/compressed.py --links 2gbit --rounds 1 --steps 2

Every method trains the same model (``benchmarks/_worker.py``: same seed, batch, fp32 torch
AdamW) under ``torchrun``, each run in fresh processes. The rate-limited link is a network
namespace of the run's own (``unshare -n``, so it needs root) whose loopback sends at most
``--rate`` (``tc``'s token bucket; see ``benchmarks/_launch.py``); the open loopback is the
machine's own. Methods and links alternate (A B C ... on each link, then the next round) so
that drift of a shared machine hits all of them alike. A method that fails (DeepSpeed's ZeRO++
quantizers have no CPU kernels) is reported with its error and not launched again.

Methods (``METHODS``): shardwrap at stages 2 and 3 without compression and with
``Compression(params="int8", grads="int8")`` (error feedback on, blocks of 256), stage 3 also
with ``grads="int4"``; DDP; FSDP2; DeepSpeed ZeRO-3, plain and with each ZeRO++ option
(``zero_quantized_weights``, ``zero_quantized_gradients``, ``zero_hpz_partition_size=2``) and
all three together. Bytes per step: shardwrap's own ``comm_stats`` (the bytes it hands to
collectives, compressed payload and scales included); for the others the buffers handed to
``torch.distributed``'s collectives (all-gather output, reduce-scatter input, all-reduce,
reduce and broadcast tensor) in the dtype they travel in, counted by the worker.

Goals (``GOALS``), per link and rank count: on the rate-limited link, shardwrap stage 3 with
int8 compression takes at most 0.6x the step time and 0.3x the bytes of stage 3 uncompressed
and is faster than DDP and FSDP2; on the open loopback it is no slower than uncompressed.
Output: ``benchmarks/results/compressed/<theme>_<hardware>_<date>.md`` and a JSON file beside
it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from _launch import commit, hardware, results_dir, run_once
from compare import deepspeed_installed, deepspeed_version, model_line

INT8 = {"compress_params": "int8", "compress_grads": "int8"}
# Row name: (worker method, config overrides).
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "shardwrap-s2": ("shardwrap-s2", {}),
    "shardwrap-s2-int8": ("shardwrap-s2", INT8),
    "shardwrap-s3": ("shardwrap-s3", {}),
    "shardwrap-s3-int8": ("shardwrap-s3", INT8),
    "shardwrap-s3-int8-int4": ("shardwrap-s3", {**INT8, "compress_grads": "int4"}),
    "ddp": ("ddp", {}),
    "fsdp2": ("fsdp2", {}),
    "deepspeed-s3": ("deepspeed-s3", {}),
    "deepspeed-s3-qwz": ("deepspeed-s3", {"zeropp": "qwz"}),
    "deepspeed-s3-qgz": ("deepspeed-s3", {"zeropp": "qgz"}),
    "deepspeed-s3-hpz": ("deepspeed-s3", {"zeropp": "hpz"}),
    "deepspeed-s3-zeropp": ("deepspeed-s3", {"zeropp": "qwz,qgz,hpz"}),
}
DESCRIPTIONS = {
    "shardwrap-s2-int8": 'stage 2, `Compression(params="int8", grads="int8")`',
    "shardwrap-s3-int8": 'stage 3, `Compression(params="int8", grads="int8")`',
    "shardwrap-s3-int8-int4": 'stage 3, `Compression(params="int8", grads="int4")`',
    "deepspeed-s3-qwz": "ZeRO-3 with `zero_quantized_weights`",
    "deepspeed-s3-qgz": "ZeRO-3 with `zero_quantized_gradients`",
    "deepspeed-s3-hpz": "ZeRO-3 with `zero_hpz_partition_size: 2`",
    "deepspeed-s3-zeropp": "ZeRO-3 with all three ZeRO++ options",
}
OPEN = "open"
# (method, reference, key, bound on the ratio, which links: "limited", "open" or "all").
GOALS = (
    ("shardwrap-s3-int8", "shardwrap-s3", "step_s", 0.6, "limited"),
    ("shardwrap-s3-int8", "shardwrap-s3", "comm_mb_per_step", 0.3, "limited"),
    ("shardwrap-s3-int8", "ddp", "step_s", 1.0, "limited"),
    ("shardwrap-s3-int8", "fsdp2", "step_s", 1.0, "limited"),
    ("shardwrap-s3-int8", "shardwrap-s3", "step_s", 1.0, "open"),
)
REFERENCES = ("shardwrap-s3", "ddp", "fsdp2")


def failure(error: str) -> str:
    """The line of a failed run's output that names rank 0's exception, with the frame that
    raised it and its caller: what the report shows."""
    lines = [line.removeprefix("[rank0]:").strip() for line in error.splitlines()]
    named = [i for i, line in enumerate(lines) if line.split(":")[0].endswith("Error")]
    if not named:
        return lines[-1] if lines else "no output"
    frames = [  # library paths from the package on: the report holds no install path
        line.split("site-packages/")[-1].replace('"', "")
        for line in lines[: named[0]]
        if line.startswith("File ")
    ]
    where = " <- ".join(reversed(frames[-2:]))
    return lines[named[0]] + (f" (in {where})" if where else "")


def sent_mb_per_rank(method: str, result: dict[str, Any]) -> float:
    """Estimated MB each rank sends per step: a ring gather or reduce-scatter sends (n-1)/n of
    its output or input, an all-reduce twice that. shardwrap counts bytes per kind; DDP's are
    all all-reduces; FSDP2's and DeepSpeed's are taken as gathers and reduce-scatters (their
    few small all-reduces, norms and flags, are not told apart)."""
    n = result["world_size"]
    kinds = result["comm_bytes_per_step_by_kind"] or {
        "all_reduce" if METHODS[method][0] == "ddp" else "all_gather": result["comm_bytes_per_step"]
    }
    factor = {"all_reduce": 2 * (n - 1) / n}
    return sum(b * factor.get(kind, (n - 1) / n) for kind, b in kinds.items()) / 2**20


def summarize(results: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """One row per method that ran on one link, with its ratios to ``REFERENCES``."""
    rows: dict[str, dict[str, float]] = {}
    for method, runs in results.items():
        if not runs:
            continue
        step = statistics.median(t for r in runs for t in r["step_times"])
        rows[method] = {
            "step_s": step,
            "comm_mb_per_step": statistics.median(r["comm_bytes_per_step"] for r in runs) / 2**20,
            "sent_mb_per_rank": sent_mb_per_rank(method, runs[-1]),
            "peak_mb_per_rank": max(r["peak_mb_per_rank"] for r in runs),
            "final_loss": runs[-1]["final_loss"],
        }
    for row in rows.values():
        for ref in REFERENCES:
            if ref in rows:
                row[f"time_vs_{ref}"] = row["step_s"] / rows[ref]["step_s"]
                row[f"bytes_vs_{ref}"] = row["comm_mb_per_step"] / rows[ref]["comm_mb_per_step"]
    return rows


def goal_lines(rows: dict[str, dict[str, dict[str, float]]], nproc: int) -> list[str]:
    """Each goal whose two methods ran on its link, met or not."""
    lines = []
    for link, by_method in rows.items():
        kind = "open" if link == OPEN else "limited"
        for method, ref, key, bound, where in GOALS:
            if where not in (kind, "all") or method not in by_method or ref not in by_method:
                continue
            ratio = by_method[method][key] / by_method[ref][key]
            what = "step time" if key == "step_s" else "bytes per step"
            verdict = "met" if ratio <= bound else "NOT met"
            lines.append(
                f"- {nproc} ranks, {link}: {method} {what} {ratio:.2f}x {ref}'s "
                f"(goal <= {bound}x): {verdict}"
            )
    return lines


def load_line(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[str]:
    """The range of the machine's load average at the launches, where every run recorded it."""
    loads = [r.get("load_at_launch") for by in results.values() for rs in by.values() for r in rs]
    if not loads or None in loads:
        return []
    return [f"- load average (1 min) at the launches: {min(loads):.1f} to {max(loads):.1f}"]


def markdown(
    rows: dict[str, dict[str, dict[str, float]]],
    results: dict[str, dict[str, list[dict[str, Any]]]],
    failed: dict[str, str],
    args: argparse.Namespace,
) -> str:
    first = next(r[0] for by in results.values() for r in by.values() if r)
    cfg = first["config"]
    lines = [
        f"# {args.theme}: compressed communication on a {args.rate} link and the open loopback",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}"
        ", shared with other work: timings are noisy",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, "
        f"{deepspeed_version()}, backend {'nccl' if torch.cuda.is_available() else 'gloo'}, "
        f"{args.nproc} ranks, OMP_NUM_THREADS=1",
        model_line(cfg, first["params"]),
        f"- training: fp32 AdamW, batch {cfg['batch']} per rank, {cfg['warmup']} warm-up + "
        f"{cfg['steps']} timed steps per run, {args.rounds} alternating rounds per method and link",
        f"- links: `{args.rate}`: the ranks' own network namespace whose loopback sends at most "
        f"{args.rate} (`tc qdisc add dev lo root tbf rate {args.rate} burst 256kb latency 50ms`,"
        " both directions share it); `open`: the machine's loopback",
        *load_line(results),
        f"- command: `python benchmarks/compressed.py {' '.join(sys.argv[1:])}`, "
        f"launched at commit {args.commit}",
        "",
        "| link | method | step (s, median) | MB per step | est. MB sent per rank "
        "| peak MB per rank | final loss | time vs s3 | bytes vs s3 | time vs DDP "
        "| bytes vs DDP | time vs FSDP2 | bytes vs FSDP2 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for link, by_method in rows.items():
        for method, r in by_method.items():
            ratios = " | ".join(
                f"{r[f'{k}_vs_{ref}']:.2f}" if f"{k}_vs_{ref}" in r else "-"
                for ref in REFERENCES
                for k in ("time", "bytes")
            )
            lines.append(
                f"| {link} | {method} | {r['step_s']:.2f} | {r['comm_mb_per_step']:.0f} | "
                f"{r['sent_mb_per_rank']:.0f} | {r['peak_mb_per_rank']:.0f} | "
                f"{r['final_loss']:.4f} | {ratios} |"
            )
    goals = goal_lines(rows, args.nproc)
    if goals:
        lines += ["", "Goals:", "", *goals]
    if failed:
        lines += ["", "Did not run here (rank 0's error, and where it was raised):", ""]
        lines += [f"- {method}: `{error}`" for method, error in failed.items()]
    lines += ["", "Methods:", ""]
    lines += [f"- {m}: {DESCRIPTIONS[m]}" for m in METHODS if m in DESCRIPTIONS]
    lines += ["", "Step times of every run, in order:", ""]
    for link, by_method in results.items():
        for method, runs in by_method.items():
            times = ", ".join(f"{t:.2f}" for r in runs for t in r["step_times"])
            if times:
                lines.append(f"- {link}, {method}: {times}")
    lines += [
        "",
        "MB per step: shardwrap's `comm_stats` (bytes handed to its collectives, compressed "
        "payloads and their scales included); for the others the buffers handed to "
        "torch.distributed's collectives in the dtype they travel in (all-gather output, "
        "reduce-scatter input, all-reduce, reduce and broadcast tensor); the bytes ratios are "
        "of these. Est. MB sent per rank: what a ring algorithm sends of them, (n-1)/n of a "
        "gather or reduce-scatter and 2(n-1)/n of an all-reduce (DDP's all-reduce of the "
        "gradients thus sends twice what it hands over; FSDP2's and DeepSpeed's collectives "
        "are all taken as gathers and reduce-scatters). Ratios compare methods on the same "
        "link. Peak memory: resident-set high-water mark above the resident set "
        "before the model was built, the worst rank of the worst round. Final loss: rank 0's "
        "loss on the last timed step of the last round.",
    ]
    return "\n".join(lines) + "\n"


def launch_all(
    methods: list[str],
    links: list[str],
    config: dict[str, Any],
    args: argparse.Namespace,
    results: dict[str, dict[str, list[dict[str, Any]]]],
    failed: dict[str, str],
) -> None:
    """``args.rounds`` rounds of every method on every link, into ``results``; a method that
    fails goes into ``failed`` with its error and is not launched again."""
    for round_ in range(args.rounds):
        for link in links:
            for method in methods:
                if method in failed:
                    continue
                worker, overrides = METHODS[method]
                rate = None if link == OPEN else link
                load = os.getloadavg()[0]
                try:
                    result = run_once(
                        worker, {**config, **overrides}, args.nproc, args.timeout, rate
                    )
                except RuntimeError as e:
                    failed[method] = failure(str(e))
                    print(f"round {round_ + 1} {link} {method}: failed: {failed[method]}")
                    continue
                results[link][method].append({**result, "load_at_launch": load})
                print(
                    f"round {round_ + 1} {link} {method}: {result['step_s']:.2f} s/step, "
                    f"{result['comm_bytes_per_step'] / 2**20:.0f} MB/step, "
                    f"final loss {result['final_loss']:.4f}",
                    flush=True,
                )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), help="default: all")
    parser.add_argument("--links", nargs="+", choices=("limited", OPEN), default=["limited", OPEN])
    parser.add_argument("--rate", default="2gbit", help="the limited link's rate, tc's units")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--config", default="{}", help="JSON overrides of _worker.py Config")
    parser.add_argument("--theme", help="default: gpt101m_<nproc>ranks")
    parser.add_argument("--out-dir", type=Path, default=results_dir("compressed"))
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument(
        "--from-json",
        type=Path,
        help="launch nothing: report the runs of an earlier report's JSON (give the flags it "
        "ran with, for the report's header)",
    )
    args = parser.parse_args()
    methods = args.methods or [
        m for m in METHODS if deepspeed_installed() or not m.startswith("deepspeed")
    ]
    if "limited" in args.links and os.geteuid() != 0:
        raise SystemExit(
            "the rate-limited link needs root (unshare -n, tc): run as root or pass --links open"
        )
    args.theme = args.theme or f"gpt101m_{args.nproc}ranks"
    config = {"steps": args.steps, "warmup": 1, **json.loads(args.config)}
    links = [args.rate if link == "limited" else OPEN for link in args.links]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {
        link: {m: [] for m in methods} for link in links
    }
    failed: dict[str, str] = {}
    args.commit = commit()
    if args.from_json:
        earlier = json.loads(args.from_json.read_text())
        results, failed = earlier["runs"], earlier["failed"]
        args.commit = earlier.get("commit", f"unknown (reported at {args.commit})")
    else:
        launch_all(methods, links, config, args, results, failed)
    rows = {link: summarize(by_method) for link, by_method in results.items()}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(rows, results, failed, args)
    (args.out_dir / f"{stem}.md").write_text(report)
    payload = {
        "commit": args.commit,
        "rows": rows,
        "runs": results,
        "failed": failed,
        "goals": goal_lines(rows, args.nproc),
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    print(report)


if __name__ == "__main__":
    main()
