"""Shape-aware optimizers (Muon, Adafactor) against AdamW: shardwrap stage 3, DDP and DeepSpeed.

    python benchmarks/optimizers.py                      # 2 and 4 ranks, every method, optimizer
    python benchmarks/optimizers.py --nproc 2 --methods shardwrap ddp --optimizers adamw muon
    python benchmarks/optimizers.py --config '{"width": 256, "depth": 2}' --theme tiny

Every cell (ranks, method, optimizer) trains the same model (the 101M GPT of
``benchmarks/compare.py`` unless ``--config`` says otherwise) in fresh ``torchrun`` processes
(``benchmarks/_worker.py``): AdamW; Muon on the matrices with AdamW on the rest, as torch's
documentation advises; Adafactor. shardwrap steps Muon's matrices and Adafactor's parameters
whole, each on one owner rank, with one all-to-all before the step and one after
(``shardwrap/engine/optim/whole_params.py``); DDP steps every parameter on every rank; DeepSpeed
ZeRO-1 and ZeRO-2 train with DeepSpeed's own Muon (its ``"optimizer": {"type": "Muon"}``) and,
for reference, with AdamW; Adafactor is not run under DeepSpeed (its ZeRO hands a client
optimizer flat 1-D partitions). Cells alternate round by round so that drift of this shared
machine hits all of them alike; the machine's load average is recorded at each launch.

The report gives, per world size, each cell's median step time (forward, backward and optimizer
step) over the timed steps after warm-up, the forward+backward and optimizer-step parts, the
peak memory per rank, the bytes of gathers and reductions per step, the bytes the owner exchange
sends per step and rank, the final loss and the largest loss difference from DDP with the same
optimizer; then the ratios: Muon and Adafactor against AdamW per method (shardwrap's Muon goal:
at most ``MUON_GOAL`` x AdamW's step time), shardwrap against DDP per optimizer, shardwrap's Muon
against DeepSpeed's; then where each rank's optimizer step goes (the exchange in, the
Newton-Schulz iteration, the rest of the update, the exchange out). DeepSpeed needs the
``bench`` extra (``pip install -e '.[bench]'`` or ``make bench``); without it its cells are
skipped unless asked for. Output: ``benchmarks/results/optimizers/<theme>_<hardware>_<date>.md``
and a JSON file of every run beside it.
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
from compare import (
    ALIASES,
    DEEPSPEED,
    INSTALL_HINT,
    OPTIMIZERS,
    deepspeed_installed,
    deepspeed_version,
    model_line,
    select_methods,
)

METHODS = ("shardwrap-s3", "ddp", "deepspeed-s1", "deepspeed-s2")
DEEPSPEED_OPTIMIZERS = ("adamw", "muon")
MUON_GOAL = 1.15  # shardwrap stage 3: Muon's step time at most this times AdamW's
RECIPES = {
    "adamw": "`torch.optim.AdamW` over every parameter",
    "muon": "`torch.optim.Muon` over the matrices (`p.ndim == 2`: every weight matrix, the "
    "embeddings and the head), `torch.optim.AdamW` over the rest; DeepSpeed: its own Muon "
    '(`"optimizer": {"type": "Muon", "params": {"lr": ..., "momentum": 0.95, "ns_method": '
    '"standard"}}`), which tags the same matrices and runs the same quintic Newton-Schulz '
    "iteration in bf16 (its momentum and weight decay follow its own recipe, so its losses "
    "are not DDP's)",
    "adafactor": "`torch.optim.Adafactor` over every parameter",
}


def cells(
    nprocs: list[int], methods: list[str], optimizers: list[str]
) -> list[tuple[int, str, str]]:
    """Every (ranks, method, optimizer) to run: DeepSpeed only with ``DEEPSPEED_OPTIMIZERS``."""
    return [
        (n, m, o)
        for n in nprocs
        for m in methods
        for o in optimizers
        if m not in DEEPSPEED or o in DEEPSPEED_OPTIMIZERS
    ]


def summarize(runs: list[dict[str, Any]], ddp: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One cell's row from its runs (one per round), against DDP's runs with its optimizer."""
    first = runs[0]
    phases = [p for r in runs for p in r["phases_s_per_rank"]]
    row = {
        "step_s": statistics.median(t for r in runs for t in r["step_times"]),
        "forward_backward_s": statistics.median(p["forward_backward"] for p in phases),
        "optimizer_step_s": statistics.median(p["step"] for p in phases),
        "peak_mb_per_rank": max(r["peak_mb_per_rank"] for r in runs),
        "comm_mb_per_step": statistics.median(r["comm_bytes_per_step"] for r in runs) / 2**20,
        "exchange_mb_per_step_per_rank": max(
            max(r["owner_exchange_bytes_per_step_per_rank"]) for r in runs
        )
        / 2**20,
        "final_loss": runs[-1]["final_loss"],
        "params": first["params"],
        "load": [r["load"] for r in runs],
    }
    if ddp:
        ref = ddp[-1]["losses"]
        row["loss_diff_vs_ddp"] = max(abs(a - b) for a, b in zip(runs[-1]["losses"], ref))
    return row


def _ratio(
    by_cell: dict[tuple[str, str], dict[str, Any]],
    a: tuple[str, str],
    b: tuple[str, str],
    key: str = "step_s",
) -> float | None:
    """Cell ``a``'s ``key`` over cell ``b``'s, or ``None`` where either did not run."""
    if a in by_cell and b in by_cell:
        return by_cell[a][key] / by_cell[b][key]
    return None


def ratio_lines(rows: dict[int, dict[tuple[str, str], dict[str, Any]]]) -> list[str]:
    """The report's ratios, per world size: each optimizer against AdamW per method (with
    shardwrap's Muon goal), shardwrap against DDP per optimizer, and shardwrap's Muon against
    DeepSpeed's."""
    lines = []
    for n, by_cell in rows.items():
        for method in METHODS:
            for opt in ("muon", "adafactor"):
                r = _ratio(by_cell, (method, opt), (method, "adamw"))
                if r is None:
                    continue
                goal = ""
                if method == "shardwrap-s3" and opt == "muon":
                    met = "met" if r <= MUON_GOAL else "NOT met"
                    goal = f" (goal <= {MUON_GOAL}x: {met})"
                lines.append(f"- {n} ranks, {method}: {opt} step time {r:.2f}x adamw's{goal}.")
        for opt in OPTIMIZERS:
            t = _ratio(by_cell, ("shardwrap-s3", opt), ("ddp", opt))
            m = _ratio(by_cell, ("shardwrap-s3", opt), ("ddp", opt), "peak_mb_per_rank")
            if t is not None and m is not None:
                lines.append(
                    f"- {n} ranks, {opt}: shardwrap stage 3 vs DDP: step time {t:.2f}x, "
                    f"peak memory {m:.2f}x."
                )
        for ds in ("deepspeed-s1", "deepspeed-s2"):
            t = _ratio(by_cell, ("shardwrap-s3", "muon"), (ds, "muon"))
            m = _ratio(by_cell, ("shardwrap-s3", "muon"), (ds, "muon"), "peak_mb_per_rank")
            if t is not None and m is not None:
                lines.append(
                    f"- {n} ranks, muon: shardwrap stage 3 vs {ds}: step time {t:.2f}x, "
                    f"peak memory {m:.2f}x."
                )
        for opt in ("muon", "adafactor"):
            row = by_cell.get(("shardwrap-s3", opt))
            if row is not None and row["comm_mb_per_step"] and n > 1:
                extra = row["exchange_mb_per_step_per_rank"]
                sent = row["comm_mb_per_step"] * (n - 1) / n
                lines.append(
                    f"- {n} ranks, {opt}: the owner exchange sends {extra:.1f} MB per step and "
                    f"rank, {extra / sent:.2f}x the {sent:.1f} MB a rank sends in the step's "
                    f"gathers and reductions ({n - 1}/{n} of their "
                    f"{row['comm_mb_per_step']:.1f} MB of buffers)."
                )
    return lines


PROFILE = (
    ("forward_backward", "fwd+bwd"),
    ("step", "optimizer step"),
    ("{opt} exchange in", "exchange in"),
    ("newton_schulz", "Newton-Schulz"),
    ("{opt} update", "update (all)"),
    ("{opt} exchange out", "exchange out"),
    ("owner all-to-all", "of both: all-to-all"),
    ("adamw update", "AdamW (the rest)"),
)


def profile_lines(runs: dict[tuple[int, str, str], list[dict[str, Any]]]) -> list[str]:
    """Per rank, the medians of each phase of the step for the shape-aware cells (the last
    round's run): where their optimizer step goes."""
    lines = [
        "| ranks | method | optimizer | rank | " + " | ".join(h for _, h in PROFILE) + " |",
        "|---|---|---|---|" + "---|" * len(PROFILE),
    ]
    for (n, method, opt), results in runs.items():
        if opt == "adamw" or method in DEEPSPEED and opt != "muon":
            continue
        for rank, phases in enumerate(results[-1]["phases_s_per_rank"]):
            cells_ = []
            for key, _ in PROFILE:
                if (
                    opt == "adafactor"
                    and key in ("newton_schulz", "adamw update")
                    or (key == "owner all-to-all" and method != "shardwrap-s3")
                ):
                    cells_.append("-")
                    continue
                value = phases.get(key.format(opt=opt))
                cells_.append("-" if value is None else f"{value:.3f}")
            lines.append(f"| {n} | {method} | {opt} | {rank} | " + " | ".join(cells_) + " |")
    return lines


def markdown(
    rows: dict[int, dict[tuple[str, str], dict[str, Any]]],
    runs: dict[tuple[int, str, str], list[dict[str, Any]]],
    args: argparse.Namespace,
) -> str:
    first = next(iter(runs.values()))[0]
    cfg = first["config"]
    loads = [r["load"] for results in runs.values() for r in results]
    lines = [
        f"# {args.theme}: Muon and Adafactor against AdamW, shardwrap stage 3, DDP, DeepSpeed",
        "",
        f"- date: {datetime.date.today().isoformat()}, runs from {args.started} to "
        f"{args.ended} UTC",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, "
        f"{deepspeed_version()}, backend {'nccl' if torch.cuda.is_available() else 'gloo'}, "
        f"OMP_NUM_THREADS=1 per rank",
        model_line(cfg, first["params"]),
        f"- training: fp32, batch {cfg['batch']} per rank, lr {cfg['lr']}, {cfg['warmup']} "
        f"warm-up + {cfg['steps']} timed steps per run, {args.rounds} alternating round(s)",
        *(f"- {opt}: {RECIPES[opt]}" for opt in dict.fromkeys(o for _, _, o in runs)),
        "- load average (1 min) at the launches: "
        f"{min(loads):.2f} to {max(loads):.2f}; at the start {args.load_start}, "
        f"at the end {args.load_end}",
        *(
            [f"- skipped, DeepSpeed not installed ({INSTALL_HINT}): {', '.join(args.skipped)}"]
            if args.skipped
            else []
        ),
        f"- command: `python benchmarks/optimizers.py {' '.join(sys.argv[1:])}`, at commit "
        f"{commit()}",
        "",
        "| ranks | method | optimizer | step (s, median) | fwd+bwd (s) | optimizer step (s) "
        "| peak MB per rank | gathers+reductions MB per step | owner exchange MB per step "
        "and rank | final loss | max loss diff vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for n, by_cell in rows.items():
        for (method, opt), r in by_cell.items():
            diff = f"{r['loss_diff_vs_ddp']:.1e}" if "loss_diff_vs_ddp" in r else "-"
            lines.append(
                f"| {n} | {method} | {opt} | {r['step_s']:.2f} | {r['forward_backward_s']:.2f} "
                f"| {r['optimizer_step_s']:.2f} | {r['peak_mb_per_rank']:.0f} "
                f"| {r['comm_mb_per_step']:.1f} | {r['exchange_mb_per_step_per_rank']:.1f} "
                f"| {r['final_loss']:.4f} | {diff} |"
            )
    lines += ["", "Ratios (step times are medians, memory the worst rank):", ""]
    lines += ratio_lines(rows)
    lines += [
        "",
        "Where each rank's step goes, seconds (medians over the timed steps of the last round; "
        "the phases of the table's `fwd+bwd` and `optimizer step` columns are their medians "
        "over all rounds and ranks):",
        "",
        *profile_lines(runs),
        "",
        "Step times of every run, in order:",
        "",
    ]
    for (n, method, opt), results in runs.items():
        times = ", ".join(f"{t:.2f}" for r in results for t in r["step_times"])
        lines.append(f"- {n} ranks, {method}, {opt}: {times}")
    lines += [
        "",
        "A step is forward, backward and the optimizer step, timed on every rank and taken at "
        "the slowest. Peak memory: resident-set high-water mark above the resident set just "
        "before the model was built; the worst rank of the worst round. Gathers+reductions: "
        "buffers handed to collectives per step on rank 0 (shardwrap: its `comm_stats`), of "
        "which a rank sends (N-1)/N; the owner exchange: bytes a rank sends in the two "
        "all-to-alls of a shape-aware step, the most of any rank (counted by the benchmark: "
        "the model's `comm_stats` does not record them). Profile: `exchange in` is the time "
        "from the optimizer's `step()` call to its "
        "own pre-hook, so for shardwrap's shape-aware steps the all-to-all bringing each owner "
        "its parameters' values and gradients, and the copies around it; `update (all)` the "
        "optimizer's own step (for Muon: momentum, the Newton-Schulz iteration, the parameter "
        "update), `Newton-Schulz` the part of it in torch's `_zeropower_via_newtonschulz` (for "
        "DeepSpeed: in its `muon_update`, wherever ZeRO calls it, momentum included); "
        "`exchange out` from its post-hook to the end of `step()`: the all-to-all sending the "
        "new values back and their copies; `of both: all-to-all` the part of exchange in and "
        "out spent in the two all-to-alls themselves (issue to end of wait), the rest of them "
        "being copies and bookkeeping. An all-to-all waits for its slowest peer, so a rank "
        "that owns less Newton-Schulz work shows the difference as exchange time.",
    ]
    return "\n".join(lines) + "\n"


def load() -> float:
    return os.getloadavg()[0]


def uptime() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f}, {five:.2f}, {fifteen:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--methods", nargs="+", choices=[*METHODS, *ALIASES], help="default: every method"
    )
    parser.add_argument("--optimizers", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--nproc", nargs="+", type=int, default=[2, 4], help="world sizes")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=1, help="warm-up steps per run")
    parser.add_argument(
        "--config", default="{}", help="JSON overrides of benchmarks/_worker.py Config"
    )
    parser.add_argument("--theme", default="gpt101m", help="the report's name before hardware")
    parser.add_argument("--out-dir", type=Path, default=results_dir("optimizers"))
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per launch")
    args = parser.parse_args()
    methods, args.skipped = select_methods(args.methods, METHODS, deepspeed_installed())
    if args.skipped:
        print(f"DeepSpeed is not installed ({INSTALL_HINT}): skipping {', '.join(args.skipped)}")
    todo = cells(list(dict.fromkeys(args.nproc)), methods, list(dict.fromkeys(args.optimizers)))
    config = {"steps": args.steps, "warmup": args.warmup, **json.loads(args.config)}
    runs: dict[tuple[int, str, str], list[dict[str, Any]]] = {cell: [] for cell in todo}
    args.started = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")
    args.load_start = uptime()
    for round_ in range(args.rounds):
        for n, method, opt in todo:
            at = load()
            result = run_once(method, {**config, "optimizer": opt}, n, args.timeout)
            result["load"] = at
            runs[(n, method, opt)].append(result)
            print(
                f"round {round_ + 1}, {n} ranks, {method}, {opt}: {result['step_s']:.2f} s/step, "
                f"{result['peak_mb_per_rank']:.0f} MB, final loss {result['final_loss']:.4f}, "
                f"load {at:.2f}",
                flush=True,
            )
    args.ended = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")
    args.load_end = uptime()
    rows: dict[int, dict[tuple[str, str], dict[str, Any]]] = {}
    for (n, method, opt), results in runs.items():
        rows.setdefault(n, {})[(method, opt)] = summarize(results, runs.get((n, "ddp", opt)))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    report = markdown(rows, runs, args)
    (args.out_dir / f"{stem}.md").write_text(report)
    dump = {
        "rows": [
            {"ranks": n, "method": m, "optimizer": o, **r}
            for n, c in rows.items()
            for (m, o), r in c.items()
        ],
        "runs": [r for results in runs.values() for r in results],
    }
    (args.out_dir / f"{stem}.json").write_text(json.dumps(dump, indent=1))
    print(report)


if __name__ == "__main__":
    main()
