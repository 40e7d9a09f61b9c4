"""What one exchange costs on this machine's gloo, by its size and by the compute around it.

    python benchmarks/exchange_latency.py                 # the reference configuration
    python benchmarks/exchange_latency.py --sizes 3000 200000 --compute 0 2

Two ranks under ``torchrun`` (gloo, ``OMP_NUM_THREADS=1``) alternate a stretch of compute (a
256x256 matmul loop for ``--compute`` ms of wall time) with one exchange, waited for at once: a
point-to-point exchange (each rank sends its buffer and receives the peer's, as shardwrap's
gathers on gloo do), ``all_gather_into_tensor``, or ``all_reduce``. Reported per exchange: the
wall time beyond the compute, the process's CPU time, and the CPU time of gloo's own threads
(its socket loop and worker threads), medians of ``--rounds`` launches. It shows what sets a
small model's step on a busy CPU: with compute between exchanges each costs its peers thread
wake-ups whatever its size, which is why shardwrap packs small units' collectives into buckets
(``shardwrap/comm/buckets.py``).

Output: ``benchmarks/results/exchange_latency/<theme>_<hardware>_<date>.md`` and a JSON file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _launch import commit, hardware, results_dir, torchrun

MODES = ("p2p", "all_gather", "all_reduce")


def _gloo_cpu_s() -> float:
    """CPU seconds of this process's gloo threads so far (Linux)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                name = f.read().strip()
            if name.startswith(("gloo", "pt_gloo")):
                with open(f"/proc/self/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def rank_main(mode: str, nbytes: int, compute_ms: float, iters: int) -> None:
    """Under torchrun: time ``iters`` exchanges of ``nbytes`` with ``compute_ms`` before each."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    group = dist.distributed_c10d._get_default_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    n = nbytes // 4
    shard, out = torch.randn(n), torch.empty(n * world)
    a = torch.randn(256, 256)
    tag = 0

    def compute() -> None:
        start = time.perf_counter()
        while time.perf_counter() - start < compute_ms / 1e3:
            a @ a

    def exchange() -> None:
        nonlocal tag
        tag += 1
        if mode == "p2p":
            peer = (rank + 1) % world
            sent = group.send([shard], peer, tag)
            group.recv([out[peer * n : (peer + 1) * n]], peer, tag).wait()
            sent.wait()
        elif mode == "all_gather":
            dist.all_gather_into_tensor(out, shard)
        else:
            dist.all_reduce(shard)

    for _ in range(20):
        compute()
        exchange()
    dist.barrier()
    gloo0, cpu0, wall0 = _gloo_cpu_s(), time.process_time(), time.perf_counter()
    for _ in range(iters):
        compute()
        exchange()
    wall, cpu, gloo = (
        time.perf_counter() - wall0,
        time.process_time() - cpu0,
        _gloo_cpu_s() - gloo0,
    )
    if rank == 0:
        result = {
            "beyond_compute_ms": 1e3 * wall / iters - compute_ms,
            "cpu_ms": 1e3 * cpu / iters,
            "gloo_cpu_ms": 1e3 * gloo / iters,
        }
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--sizes", nargs="+", type=int, default=[3000, 200000], help="bytes")
    parser.add_argument("--compute", nargs="+", type=float, default=[0, 2], help="ms")
    parser.add_argument("--iters", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--theme", default="exchange_latency")
    parser.add_argument("--out-dir", type=Path, default=results_dir("exchange_latency"))
    parser.add_argument("--rank", help=argparse.SUPPRESS)  # set by the launch
    args = parser.parse_args()
    if args.rank:
        rank_main(**json.loads(args.rank))
        return
    rows: dict[str, list[dict[str, Any]]] = {}
    for _ in range(args.rounds):
        for mode in args.modes:
            for nbytes in args.sizes:
                for compute_ms in args.compute:
                    spec = {"mode": mode, "nbytes": nbytes, "compute_ms": compute_ms}
                    proc = torchrun(
                        Path(__file__),
                        "--rank",
                        json.dumps({**spec, "iters": args.iters}),
                        nproc=2,
                        timeout=600,
                        check=True,
                    )
                    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
                    key = f"{mode}/{nbytes}/{compute_ms:g}"
                    rows.setdefault(key, []).append(json.loads(line[len("RESULT ") :]))
    lines = [
        f"# {args.theme}: one gloo exchange, by size and by the compute between exchanges",
        "",
        f"- date: {datetime.date.today().isoformat()}",
        f"- hardware: {platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        f"- software: Python {platform.python_version()}, torch {torch.__version__}, gloo, "
        "2 ranks, OMP_NUM_THREADS=1",
        f"- command: `python benchmarks/exchange_latency.py {' '.join(sys.argv[1:])}`, at "
        f"commit {commit()}; {args.iters} exchanges a launch, medians of {args.rounds} launches",
        "",
        "| exchange | bytes per rank | compute between (ms) | wall ms beyond the compute | "
        "process CPU ms | gloo threads' CPU ms |",
        "|---|---|---|---|---|---|",
    ]
    for key, results in rows.items():
        mode, nbytes, compute_ms = key.split("/")
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        lines.append(
            f"| {mode} | {int(nbytes):,} | {compute_ms} | {med['beyond_compute_ms']:.2f} | "
            f"{med['cpu_ms']:.2f} | {med['gloo_cpu_ms']:.2f} |"
        )
    lines += [
        "",
        "Per exchange, on rank 0. Process CPU includes the compute; gloo threads' CPU is the "
        "socket loop and worker threads of the process.",
    ]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.theme}_{hardware()}_{datetime.date.today().isoformat()}"
    (args.out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (args.out_dir / f"{stem}.json").write_text(json.dumps(rows, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
