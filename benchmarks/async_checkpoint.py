"""Checkpoints that do not stop training: shardwrap's non-blocking save against torch's DCP.

    python benchmarks/async_checkpoint.py                  # the 101M GPT at 2 ranks
    python benchmarks/async_checkpoint.py --config '{"width": 64, "depth": 2}' --theme tiny

One ``torchrun`` run of 2 ranks trains the 101M GPT of ``benchmarks/compare.py`` (AdamW, fp32)
twice, one model after the other in the same processes: wrapped with shardwrap (stage 3), and
with FSDP2 (``torch.distributed.fsdp.fully_shard`` on every block and the root). Each saves its
model and optimizer state in two ways:

- shardwrap: ``save_checkpoint(..., blocking=True)``, then ``blocking=False``;
- FSDP2: ``torch.distributed.checkpoint.save`` (synchronous), then
  ``torch.distributed.checkpoint.async_save`` (a background thread; given a gloo group of its
  own, as torch advises, so that its collectives do not interleave with training's), each of
  ``get_state_dict(model, opt)``.

For each save it measures, on every rank, taking the slowest rank: **hold**, the seconds the
save call keeps the training loop; **complete**, the seconds from the call until the
checkpoint is whole on disk (for a background save, when a watcher thread sees it end); and for
the background saves, the time of each of ``--during`` training steps run right after the call,
those that began while the write still ran set against the median of ``--steps`` normal steps
before it. Each library's background save runs twice: the first of a run also pays one-time
costs (shardwrap: creating the writers' gloo group and allocating the host copy, which later
saves reuse), the second is what every later save costs. Goals (shardwrap's second
non-blocking save): hold at most ``HOLD_GOAL`` x its blocking save's, steps during a write at
most ``STEP_GOAL`` x a normal step. Every checkpoint goes to a
temporary folder, deleted when the run ends. Output:
``benchmarks/results/async_checkpoint/<theme>_<hardware>_<date>.md`` and a JSON file beside it.

NOTE: on this project's machine (2 cores, 2 ranks with one thread each) a writer thread has no
core of its own: it takes CPU time from the training steps that run meanwhile.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from _launch import commit, end_ranks, hardware, results_dir, torchrun

HOLD_GOAL = 0.1  # a non-blocking save holds the loop at most this times a blocking one
STEP_GOAL = 1.25  # a step while a write runs takes at most this times a normal step
MODES = ("blocking", "non-blocking, first", "non-blocking")
SAVES = (
    ("shardwrap", "blocking", "shardwrap `save_checkpoint(blocking=True)`"),
    ("shardwrap", "non-blocking, first", "shardwrap `save_checkpoint(blocking=False)`, first"),
    ("shardwrap", "non-blocking", "shardwrap `save_checkpoint(blocking=False)`"),
    ("fsdp2", "blocking", "FSDP2 + DCP `save`"),
    ("fsdp2", "non-blocking, first", "FSDP2 + DCP `async_save`, first"),
    ("fsdp2", "non-blocking", "FSDP2 + DCP `async_save`"),
)


# the worker: one torchrun rank -------------------------------------------------------


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _worker(cfg_json: str, folder: str, steps: int, during: int) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    import torch.distributed.checkpoint as dcp
    from _worker import Config, make_model
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from shardwrap import ShardedModule, save_checkpoint

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = Config(**json.loads(cfg_json))
    gen = torch.Generator().manual_seed(cfg.seed + rank)
    dcp_group = dist.new_group(backend="gloo")  # async_save's own, as torch advises
    results: dict[str, Any] = {}

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> float:
        tokens = torch.randint(256, (cfg.batch, cfg.context + 1), generator=gen)
        t0 = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    for library in ("shardwrap", "fsdp2"):
        model, block = make_model(cfg)
        params = sum(p.numel() for p in model.parameters())
        if library == "shardwrap":
            model = ShardedModule(model, auto_wrap=block)
        else:
            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for module in model.modules():
                if isinstance(module, block):
                    fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
        for _ in range(cfg.warmup):
            step(model, opt)
        normal = [_slowest(step(model, opt)) for _ in range(steps)]
        for i, mode in enumerate(MODES):
            target = Path(folder) / f"{library}-{i}"
            ended: list[float] = []
            watch: threading.Thread | None = None
            dist.barrier()
            t0 = time.perf_counter()
            if library == "shardwrap" and mode == "blocking":
                save_checkpoint(target, model, opt)
            elif library == "shardwrap":
                pending = save_checkpoint(target, model, opt, blocking=False)
                done: Callable[[], bool] = pending.done

                def watched(pending: Any = pending, ended: list[float] = ended) -> None:
                    pending.wait()
                    ended.append(time.perf_counter())

                watch = threading.Thread(target=watched)
                watch.start()
            else:
                model_state, optim_state = get_state_dict(model, opt)
                state = {"model": model_state, "optim": optim_state}
                if mode == "blocking":
                    dcp.save(state, checkpoint_id=str(target))
                else:
                    future = dcp.async_save(
                        state, checkpoint_id=str(target), process_group=dcp_group
                    )
                    future = getattr(future, "upload_completion", future)
                    done = future.done
                    future.add_done_callback(
                        lambda f, ended=ended: ended.append(time.perf_counter())
                    )
            hold = time.perf_counter() - t0
            steps_during: list[tuple[float, bool]] = []
            if mode != "blocking":
                for _ in range(during):
                    running = not done()
                    steps_during.append((step(model, opt), running))
                if watch is not None:
                    watch.join()
                else:
                    future.result()
                complete = ended[0] - t0
            else:
                complete = hold
            # every rank takes part in each collective below, whatever it saw
            while_writing = [s for s, running in steps_during if running]
            mean = statistics.mean(while_writing) if while_writing else 0.0
            counted = int(_slowest(len(while_writing)))
            results[f"{library} {mode}"] = {
                "hold_s": _slowest(hold),
                "complete_s": _slowest(complete),
                "steps_during_s": [_slowest(s) for s, _ in steps_during],
                "steps_while_writing": counted,
                "step_while_writing_s": _slowest(mean) if counted else None,
                "normal_step_s": statistics.median(normal),
                "params": params,
            }
            dist.barrier()
            if rank == 0:
                shutil.rmtree(target, ignore_errors=True)
        del model, opt
    if rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    end_ranks()


# the driver: launch, judge, report ---------------------------------------------------


def _ratio(a: float | None, b: float) -> float | None:
    return None if a is None else a / b


def markdown(report: dict[str, Any]) -> str:
    rows = report["results"]
    cfg = report["config"]
    lines = [
        f"# Non-blocking checkpoints against DCP: {report['theme']}",
        "",
        f"- date: {report['date']}, commit {report['commit']}, {report['hardware']}, "
        f"{report['machine']}, torch {report['torch']}, python {report['python']}",
        f"- model: GPT of width {cfg.get('width', 1024)}, {cfg.get('depth', 8)} blocks, "
        f"{report['params'] / 1e6:.1f}M parameters, AdamW fp32, 2 ranks (gloo), "
        f"batch {cfg.get('batch', 2)} x context {cfg.get('context', 64)} per rank",
        f"- command: `{report['command']}`",
        f"- {report['steps']} normal steps timed before each model's saves, "
        f"{report['during']} steps run right after each background save's call; every "
        "figure is the slowest rank's; goals judged on the second background save",
        "",
        "| save | hold (s) | complete (s) | normal step (s) | steps begun while writing | "
        "step while writing (s) | vs normal |",
        "|---|---|---|---|---|---|---|",
    ]
    for library, mode, label in SAVES:
        r = rows[f"{library} {mode}"]
        during = r["step_while_writing_s"]
        ratio = _ratio(during, r["normal_step_s"])
        lines.append(
            f"| {label} | {r['hold_s']:.3f} | {r['complete_s']:.2f} | {r['normal_step_s']:.2f} | "
            + (
                f"{r['steps_while_writing']} of {len(r['steps_during_s'])} | {during:.2f} | "
                f"{ratio:.2f}x |"
                if during is not None
                else ("- | - | - |" if mode == "blocking" else "0 | - | - |")
            )
        )
    judged = report["goals"]
    ours, theirs = rows["shardwrap non-blocking"], rows["fsdp2 non-blocking"]
    lines += [
        "",
        "Goals (shardwrap's non-blocking save):",
        "",
        f"- hold at most {HOLD_GOAL}x the blocking save's: "
        f"{judged['hold_ratio']:.3f}x, {'met' if judged['hold_met'] else 'missed'}",
        f"- a step while a write runs at most {STEP_GOAL}x a normal step: "
        + (
            f"{judged['step_ratio']:.2f}x, {'met' if judged['step_met'] else 'missed'}"
            if judged["step_ratio"] is not None
            else "no step began while the write ran"
        ),
        "",
        f"Against DCP: shardwrap's non-blocking hold is {ours['hold_s'] / theirs['hold_s']:.2f}x "
        "`async_save`'s; its time to a complete checkpoint "
        f"{ours['complete_s'] / theirs['complete_s']:.2f}x.",
        "",
        "Noise: the machine is shared (load average at launch: "
        f"{report['load_average']}); it has 2 cores for 2 ranks, so a writer thread competes "
        "with the training thread of its rank for CPU time. One run; read differences of "
        "less than about 20% as noise.",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="{}", help="overrides of the GPT's Config (JSON)")
    parser.add_argument("--steps", type=int, default=4, help="normal steps timed per model")
    parser.add_argument("--during", type=int, default=4, help="steps after a background save")
    parser.add_argument("--theme", default="gpt101m")
    parser.add_argument("--out-dir", type=Path, default=results_dir("async_checkpoint"))
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "FOLDER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker[0], args.worker[1], args.steps, args.during)
        return
    cfg = json.loads(args.config)
    folder = tempfile.mkdtemp(prefix="async_checkpoint_")
    load = os.getloadavg()
    try:
        proc = torchrun(
            Path(__file__).resolve(),
            *("--steps", str(args.steps), "--during", str(args.during)),
            *("--worker", json.dumps(cfg), folder),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"the run failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr}")
    results = json.loads(lines[0][len("RESULT ") :])
    ours, blocking = results["shardwrap non-blocking"], results["shardwrap blocking"]
    step_ratio = _ratio(ours["step_while_writing_s"], ours["normal_step_s"])
    date = datetime.date.today().isoformat()
    report = {
        "theme": args.theme,
        "date": date,
        "commit": commit(),
        "hardware": hardware(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "command": " ".join(["python", "benchmarks/async_checkpoint.py", *sys.argv[1:]]),
        "config": cfg,
        "steps": args.steps,
        "during": args.during,
        "params": ours["params"],
        "load_average": f"{load[0]:.2f}, {load[1]:.2f}, {load[2]:.2f}",
        "results": results,
        "goals": {
            "hold_ratio": ours["hold_s"] / blocking["hold_s"],
            "hold_met": ours["hold_s"] <= HOLD_GOAL * blocking["hold_s"],
            "step_ratio": step_ratio,
            "step_met": step_ratio is not None and step_ratio <= STEP_GOAL,
        },
    }
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"{args.theme}_{hardware()}_{date}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
