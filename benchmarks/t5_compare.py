"""The classic DDP-against-ZeRO comparison on a small T5: max batch, train time and eval time
(beam search through ``Seq2SeqTrainer.evaluate()``) per method, in one run.

    python benchmarks/t5_compare.py                      # 2 ranks, 256 MB per rank
    python benchmarks/t5_compare.py --budget-mb 256 --samples 4096 --rows 64 --beams 4
    python benchmarks/t5_compare.py --only eval          # the eval columns alone

The T5 is ``benchmarks/generate.py``'s (3 + 3 blocks of width 256, 8 heads, feed-forward 1024,
vocabulary 256: about 5.6M parameters), the same in both halves. For each of DDP, shardwrap at
stages 2 and 3 and FSDP2 (every ``T5Block`` and the root):

- **max batch**: the largest per-rank batch whose training step (AdamW, fp32, sequences of 64
  bytes as encoder and decoder input) stays within ``--budget-mb`` of resident memory per rank
  above the level before the model was built, found by ``benchmarks/max_batch.py``'s search
  (fresh ``torchrun`` launches of ``benchmarks/_worker.py``);
- **train time**: the step time at that batch (the fitting trial's median of timed steps) and
  the time for ``--samples`` samples over all ranks at it;
- **eval time**: ``Seq2SeqTrainer.evaluate()`` end to end with ``predict_with_generate``, beam
  ``--beams``, ``--tokens`` new tokens, over ``--rows`` rows at ``--eval-batch`` rows per rank
  and batch (``--rows`` a multiple of ``--nproc`` x ``--eval-batch``: the Trainer would fill a
  short last batch with repeated rows and evaluate them), as ``benchmarks/trainer_eval.py``
  runs it (the stock Trainer for DDP and FSDP2,
  ``shardwrap.hf.Seq2SeqTrainer`` for shardwrap, whose ``evaluate()`` keeps the units gathered
  where the model fits): median of ``--repeats`` calls after one untimed call, the slowest
  rank's time, and the busiest rank's CPU time; every method's ``eval_loss`` and generated
  tokens are compared with DDP's. Beside it, with ``--generate`` (the default), ``generate()``
  alone over the same number of rows as ``benchmarks/generate.py`` times it (the former eval
  column).

``--only train`` or ``--only eval`` runs one half. Report: ``t5_compare[_<only>]_<hardware>_
<date>.md`` and ``.json`` (every result, the predictions included) in ``--out-dir``
(``benchmarks/results/t5_compare/``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import date
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, commit, hardware, results_dir  # noqa: E402
from generate import time_method  # noqa: E402
from max_batch import search, trial_lines  # noqa: E402
from trainer_eval import time_evaluate  # noqa: E402

METHODS = ("ddp", "shardwrap-s2", "shardwrap-s3", "fsdp2")
# benchmarks/_worker.py's T5 of that width and depth is generate.py's T5.
TRAIN_CONFIG = {"model": "t5", "depth": 3, "width": 256, "heads": 8, "context": 64}
GOAL = 1.3  # stage 3's evaluate() against DDP's, at most (issue 26)
LOSS_TOLERANCE = 1e-5  # eval losses that agree differ by no more


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
    parser.add_argument("--rows", type=int, default=64, help="rows evaluated over all ranks")
    parser.add_argument("--eval-batch", type=int, default=8, help="eval rows per rank and batch")
    parser.add_argument("--beams", type=int, default=4, help="beam width (default 4)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls of each eval")
    parser.add_argument(
        "--generate",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also time generate() alone (default: yes)",
    )
    parser.add_argument("--only", choices=("train", "eval"), help="run one half alone")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--out-dir", type=Path, default=results_dir("t5_compare"))
    args = parser.parse_args()
    if args.only != "train" and args.rows % (args.nproc * args.eval_batch):
        # NOTE: transformers 5.23 pads a short last batch with rows from the start, which every
        # rank then evaluates and the results keep (12 rows at 2 x 4 give 16 predictions).
        parser.error(
            f"--rows ({args.rows}) must be a multiple of --nproc x --eval-batch "
            f"({args.nproc} x {args.eval_batch}): the Trainer would evaluate repeated rows"
        )
    results: dict[str, dict[str, Any]] = {}
    for method in args.methods:
        results[method] = {}
        if args.only != "eval":
            results[method]["train"] = max_batch(method, args.budget_mb, args.nproc, args.limit)
        if args.only != "train":
            ev = time_evaluate(method, args, timeout=1800)
            results[method]["evaluate"] = ev
            print(f"{method} evaluate(): {_brief(ev)}", flush=True)
            if args.generate:
                gen = time_method(method, args, timeout=1800)
                results[method]["generate"] = gen
                print(f"{method} generate(): {_brief(gen)}", flush=True)
    report = _report(args, results)
    stem = f"t5_compare{'_' + args.only if args.only else ''}_{hardware()}_{date.today()}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{stem}.md").write_text(report)
    (args.out_dir / f"{stem}.json").write_text(json.dumps(results, indent=1))
    print(report)
    path = args.out_dir / f"{stem}.md"
    print(f"report: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def _brief(result: dict[str, Any]) -> str:
    """A timing result without its predictions, for the console."""
    return json.dumps({k: v for k, v in result.items() if k != "predictions"})


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value is not None and base else ""


def _timing(result: dict[str, Any] | None, base: dict[str, Any] | None) -> str:
    """Four cells: seconds, vs DDP, CPU seconds, vs DDP; or why there are none."""
    if result is None:
        return "| | | | |"
    if "seconds" not in result:
        return f"| failed: {result.get('error', '')} | | | |"
    base = base if base and "seconds" in base else {}
    wall, cpu = result["seconds"], result["cpu_seconds"]
    return (
        f"| {wall:.3f} | {_ratio(wall, base.get('seconds'))} "
        f"| {cpu:.3f} | {_ratio(cpu, base.get('cpu_seconds'))} |"
    )


def agreement(results: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each method's ``evaluate()`` results against the reference's (DDP's, or the first
    method's): its ``eval_loss`` (first timed call), the largest difference of any of its calls
    from the reference's loss, and how many rows it generated exactly as the reference did."""
    done = {m: r["evaluate"] for m, r in results.items() if "eval_losses" in r.get("evaluate", {})}
    if not done:
        return {}
    reference = done.get("ddp") or next(iter(done.values()))
    loss, rows = reference["eval_losses"][0], reference["predictions"]
    return {
        method: {
            "eval_loss": ev["eval_losses"][0],
            "loss_diff": max(abs(x - loss) for x in ev["eval_losses"]),
            "rows_equal": sum(a == b for a, b in zip(ev["predictions"], rows, strict=False)),
            "rows": len(rows),
            "distinct": len({tuple(r) for r in ev["predictions"]}),
        }
        for method, ev in done.items()
    }


def _report(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> str:
    ddp = results.get("ddp", {})
    ddp_batch = (ddp.get("train", {}).get("best") or {}).get("batch")
    command = (
        f"python benchmarks/t5_compare.py --nproc {args.nproc} --budget-mb {args.budget_mb:.0f} "
        f"--samples {args.samples} --rows {args.rows} --eval-batch {args.eval_batch} --beams "
        f"{args.beams} --tokens {args.tokens} --repeats {args.repeats}"
        + ("" if args.generate else " --no-generate")
        + (f" --only {args.only}" if args.only else "")
        + (f" --methods {' '.join(args.methods)}" if list(args.methods) != list(METHODS) else "")
    )
    lines = [
        f"# DDP against ZeRO on a small T5: max batch, train time, eval time ({date.today()})",
        "",
        f"`{command}`; {hardware()}, gloo, one thread per rank; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; commit {commit()}; load average "
        f"{os.getloadavg()[0]:.1f} at the end.",
        "",
        f"T5 of 3 + 3 blocks of width 256 (about 5.6M parameters). Train: AdamW in fp32, "
        f"sequences of {TRAIN_CONFIG['context']} bytes, the largest per-rank batch within "
        f"{args.budget_mb:.0f} MB of resident memory per rank (above the level before the "
        f"model was built), the step time at it and the time for {args.samples} samples over "
        f"all ranks. Eval: `Seq2SeqTrainer.evaluate()` end to end (`predict_with_generate`, "
        f"beam {args.beams}, {args.tokens} new tokens per row) over {args.rows} rows of 32 bytes, "
        f"{args.eval_batch} rows per rank and batch, as `benchmarks/trainer_eval.py` runs it: "
        "the stock Trainer for DDP and FSDP2 (`fully_shard` on every block and the root, by "
        "hand: the Trainer's own FSDP2 does not shard on CPU), `shardwrap.hf.Seq2SeqTrainer` "
        "for shardwrap. generate(): the same rows, one call per rank, as `benchmarks/generate.py` "
        f"times it. Each eval: median of {args.repeats} calls after one untimed call, the "
        "slowest rank's wall time; CPU s: the process's CPU time over a call, the busiest "
        "rank's, median (less sensitive to other jobs than wall time).",
        "",
        "| method | max batch per rank | vs DDP | peak MB at it | step (s) at it "
        f"| train time, {args.samples} samples | evaluate() s | vs DDP | evaluate() CPU s "
        "| vs DDP | generate() s | vs DDP | generate() CPU s | vs DDP |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, r in results.items():
        if "train" not in r:
            train = "| not run | | | | "
        elif r["train"]["best"] is None:
            train = "| none fits | | | | "
        else:
            best = r["train"]["best"]
            steps = -(-args.samples // (best["batch"] * args.nproc))
            train = (
                f"| {best['batch']} | {_ratio(best['batch'], ddp_batch)} | {best['peak_mb']:.0f} "
                f"| {best['step_s']:.3f} | {steps * best['step_s']:.1f} s ({steps} steps) "
            )
        evaluation = _timing(r.get("evaluate"), ddp.get("evaluate"))
        generation = _timing(r.get("generate"), ddp.get("generate"))
        lines.append(f"| {method} {train}{evaluation}{generation[1:]}")
    s3, base = results.get("shardwrap-s3", {}).get("evaluate", {}), ddp.get("evaluate", {})
    if "seconds" in s3 and "seconds" in base:
        wall, cpu = s3["seconds"] / base["seconds"], s3["cpu_seconds"] / base["cpu_seconds"]
        lines += [
            "",
            f"Stage 3's evaluate() against DDP's: {wall:.2f}x wall time (goal at most {GOAL}x: "
            f"{'met' if wall <= GOAL else 'not met'}), {cpu:.2f}x CPU time.",
        ]
    lines += _eval_results(results)
    if any("train" in r for r in results.values()):
        lines += trial_lines({m: r.get("train", {}).get("trials", []) for m, r in results.items()})
    for kind in ("evaluate", "generate"):
        calls = {m: r[kind]["times"] for m, r in results.items() if r.get(kind, {}).get("times")}
        if calls:
            lines += ["", f"{kind}() calls (seconds):", ""]
            lines += [f"- {m}: " + ", ".join(f"{t:.3f}" for t in ts) for m, ts in calls.items()]
    return "\n".join(lines) + "\n"


def _eval_results(results: dict[str, dict[str, Any]]) -> list[str]:
    """The lines that compare the methods' evaluation results with DDP's."""
    agreed = agreement(results)
    if not agreed:
        return []
    lines = [
        "",
        f"Eval results against {'DDP' if 'ddp' in agreed else next(iter(agreed))}'s "
        f"(losses agree within {LOSS_TOLERANCE:g}; predictions: every row's generated tokens "
        "as `compute_metrics` saw them in the last call):",
        "",
    ]
    for method, a in agreed.items():
        ev = results[method]["evaluate"]
        same = a["loss_diff"] <= LOSS_TOLERANCE and a["rows_equal"] == a["rows"]
        collectives = ev.get("collectives")
        lines.append(
            f"- {method}: eval_loss {a['eval_loss']:.7f}, largest difference {a['loss_diff']:.1e}; "
            f"{a['rows_equal']} of {a['rows']} rows generated alike ({a['distinct']} distinct); "
            f"{'agrees' if same else 'DIFFERS'}; evaluated as {ev['evaluated_as']}, "
            f"synced_gpus={'/'.join(map(str, ev['synced_gpus']))}"
            + (
                f"; per call {', '.join(f'{n:g} {k}' for k, n in collectives.items())}, "
                f"{ev['gather_mb']:.1f} MiB gathered"
                if collectives is not None
                else ""
            )
        )
    return lines


if __name__ == "__main__":
    main()
