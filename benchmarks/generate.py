"""Generation time: beam search on a sharded T5 against the plain model on every rank (DDP's
evaluation) and FSDP2, in one run.

    python benchmarks/generate.py                      # 2 ranks, 64 rows, beam 4, 16 tokens
    python benchmarks/generate.py --nproc 2 --rows 64 --beams 4 --tokens 16 --repeats 3

Each method runs in fresh processes under torchrun (gloo, one thread per rank): a T5 of about
5.5M parameters (3 + 3 layers of width 256, vocabulary 256, random weights, seeded), every rank
generating its share of the rows (``min_new_tokens`` = ``max_new_tokens``, so every row decodes
the same steps). One untimed call, then the median of ``--repeats`` timed calls (the slowest
rank's time). Methods:

- ``ddp``: the unwrapped model on every rank (what DDP evaluates with);
- ``shardwrap-s2``: stage 2 (full parameters kept between steps);
- ``shardwrap-s3``: stage 3, ``generate()`` as it is (units gathered once per call where the
  model fits, then each rank decoding on its own, with no collective per token);
- ``shardwrap-s3-synced``: the same with ``synced_gpus=True``: every rank steps until all are
  done, a handshake and an all-reduce per token (what ``generate()`` did before);
- ``shardwrap-s3-per-forward``: stage 3 inside ``keep_gathered(False)``: every decoding step
  gathers every unit again, as a training forward does;
- ``fsdp2``: torch's ``fully_shard`` on every T5 block and the root (resharding after forward),
  ``generate`` registered as a forward method (``register_fsdp_forward_method``), without which
  FSDP2 cannot run ``generate()`` on T5 at all.

The report (``benchmarks/results/generate/``) gives each method's time, its ratio to ``ddp``,
and for shardwrap the all-gathers and bytes per call.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import date
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _launch import ROOT, commit, end_ranks, hardware, results_dir, torchrun_json  # noqa: E402

METHODS = [
    "ddp",
    "shardwrap-s2",
    "shardwrap-s3",
    "shardwrap-s3-synced",
    "shardwrap-s3-per-forward",
    "fsdp2",
]


def t5_model() -> torch.nn.Module:
    """The benchmark's T5 (see the module docstring), the same on every rank, in eval mode."""
    import transformers

    torch.manual_seed(0)
    config = transformers.T5Config(
        vocab_size=256,
        d_model=256,
        d_kv=32,
        d_ff=1024,
        num_layers=3,
        num_decoder_layers=3,
        num_heads=8,
        dropout_rate=0.0,
        decoder_start_token_id=0,
        pad_token_id=0,
        eos_token_id=1,
    )
    return transformers.T5ForConditionalGeneration(config).eval()


def fsdp2_t5(model: torch.nn.Module) -> None:
    """Shard a T5 with FSDP2 as accelerate does: every ``T5Block``, then the root; ``generate``
    calls the encoder by itself, so it is registered as a forward that gathers the root first."""
    from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
    from transformers.models.t5.modeling_t5 import T5Block

    for m in model.modules():
        if isinstance(m, T5Block):
            fully_shard(m)
    fully_shard(model)
    register_fsdp_forward_method(model, "generate")


def worker(method: str, rows: int, beams: int, tokens: int, repeats: int, out: str) -> None:
    import torch.distributed as dist
    from transformers.models.t5.modeling_t5 import T5Block

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = t5_model()
    params = sum(p.numel() for p in model.parameters())
    stats = None
    keep = None
    synced = None
    if method.startswith("shardwrap"):
        from shardwrap import ShardedModule

        stage = 2 if method == "shardwrap-s2" else 3
        model = ShardedModule(model, auto_wrap=T5Block, stage=stage)
        stats = model.comm_stats
        keep = False if method.endswith("per-forward") else None
        synced = True if method.endswith("synced") else None
    elif method == "fsdp2":
        fsdp2_t5(model)
        synced = True  # every decoding step gathers: ranks must step together
    g = torch.Generator().manual_seed(1 + rank)
    inputs = torch.randint(2, 256, (rows // world, 32), generator=g)

    def call() -> tuple[float, float]:
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        with torch.no_grad():
            if keep is False:
                with model.keep_gathered(False):
                    _generate(model, inputs, beams, tokens, synced)
            else:
                _generate(model, inputs, beams, tokens, synced)
        took = torch.tensor([time.perf_counter() - start, time.process_time() - cpu])
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        return took[0].item(), took[1].item()

    call()
    if stats is not None:
        stats.reset()
    calls = [call() for _ in range(repeats)]
    times = [wall for wall, _ in calls]
    result = {"method": method, "seconds": statistics.median(times), "times": times}
    result["cpu_seconds"] = statistics.median(cpu for _, cpu in calls)
    result["params"] = params
    if stats is not None:
        result["all_gathers"] = stats.calls.get("all_gather", 0) / repeats
        result["gather_mb"] = stats.bytes.get("all_gather", 0) / repeats / 2**20
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    end_ranks()


def _generate(
    model: torch.nn.Module, inputs: torch.Tensor, beams: int, tokens: int, synced: bool | None
) -> None:
    """``synced``: ``None`` leaves it to the model (false for the plain model; shardwrap's
    choice for a sharded one)."""
    model.generate(
        inputs,
        num_beams=beams,
        max_new_tokens=tokens,
        min_new_tokens=tokens,
        do_sample=False,
        synced_gpus=synced,
    )


def time_method(method: str, args: argparse.Namespace, timeout: float | None = None) -> dict:
    """Time ``method`` in fresh ``torchrun`` processes (``args``: ``nproc``, ``rows``, ``beams``,
    ``tokens``, ``repeats``): its worker's result, or its ``error``."""
    settings = (args.rows, args.beams, args.tokens, args.repeats)
    result = torchrun_json(
        Path(__file__).resolve(),
        "--worker",
        method,
        *map(str, settings),
        nproc=args.nproc,
        timeout=timeout,
    )
    return {"method": method, **result}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--rows", type=int, default=64, help="rows over all ranks (default 64)")
    parser.add_argument("--beams", type=int, default=4, help="beam width (default 4)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens generated (default 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls (default 3)")
    parser.add_argument("--methods", nargs="+", default=METHODS, choices=METHODS)
    parser.add_argument("--report", type=Path, default=None, help="report path (default: dated)")
    args = parser.parse_args()
    results = [time_method(method, args) for method in args.methods]
    print(_report(args, results))
    path = args.report or results_dir("generate") / f"generate_cpu{args.nproc}_{date.today()}.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(_report(args, results))
    print(f"report: {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")


def _report(args: argparse.Namespace, results: list[dict]) -> str:
    base = next((r["seconds"] for r in results if r["method"] == "ddp" and "seconds" in r), None)
    base_cpu = next(
        (r["cpu_seconds"] for r in results if r["method"] == "ddp" and "seconds" in r), None
    )
    params = next((r["params"] for r in results if "params" in r), 0)
    lines = [
        f"# Generation: beam search on a sharded T5 ({date.today()})",
        "",
        f"`python benchmarks/generate.py --nproc {args.nproc} --rows {args.rows} "
        f"--beams {args.beams} --tokens {args.tokens} --repeats {args.repeats}`; {hardware()}; "
        f"commit {commit()}; load average {os.getloadavg()[0]:.1f} at the end.",
        "",
        f"T5 of {params / 1e6:.2f}M parameters, {args.rows} rows of 32 bytes over {args.nproc} "
        f"ranks, beam {args.beams}, {args.tokens} new tokens per row; median of {args.repeats} "
        "calls after one untimed call (the slowest rank's time); CPU seconds: the process's "
        "CPU time over the call, the busiest rank's, median (less sensitive to other jobs "
        "than wall time on a shared machine).",
        "",
        "| method | seconds per call | vs ddp | CPU seconds per call | vs ddp "
        "| all-gathers per call | MiB gathered per call |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['method']} | failed: {r['error']} | | | | | |")
            continue
        ratio = f"{r['seconds'] / base:.2f}x" if base else ""
        gathers = f"{r['all_gathers']:.0f}" if "all_gathers" in r else ""
        mb = f"{r['gather_mb']:.1f}" if "gather_mb" in r else ""
        cpu = r.get("cpu_seconds")
        cpu_ratio = f"{cpu / base_cpu:.2f}x" if cpu and base_cpu else ""
        lines.append(
            f"| {r['method']} | {r['seconds']:.3f} | {ratio} | {cpu:.3f} | {cpu_ratio} "
            f"| {gathers} | {mb} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(
            sys.argv[2],
            int(sys.argv[3]),
            int(sys.argv[4]),
            int(sys.argv[5]),
            int(sys.argv[6]),
            sys.argv[7],
        )
    else:
        main()
