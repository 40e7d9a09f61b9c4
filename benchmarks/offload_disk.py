"""Train a GPT larger than memory with the disk tier, and set its step time against its floors.

    python benchmarks/offload_disk.py [--width 2560] [--depth 24] [--steps 3] [--out FILE]

Three parts, each under ``torchrun --nproc_per_node=2`` where it trains:

1. The disk's bandwidth, measured here: a 2 GiB file written and fsynced, then read back
   after its pages are evicted from the page cache.
2. The disk tier: a GPT built on the meta device, wrapped with
   ``Offload(device="disk", path=...)`` under a temporary folder, AdamW (fused), the same batch
   every step (so the loss falls). Per step and rank: wall time, bytes read and written
   (``/proc/self/io``), the peak of anonymous memory (``RssAnon``, sampled every 20 ms, so the
   page cache is not counted); free disk before and after.
3. The compute floor: the same width at depth 2, in memory, the same batch; its step time
   scaled by the ratio of parameters. The I/O floor: the bytes one step moves on both ranks
   divided by the measured bandwidths.

``--deepspeed`` and ``--deepspeed-nvme`` add DeepSpeed ZeRO-3 on the same model, its
parameters and optimizer offloaded to host memory, or to files through its NVMe path (which
needs libaio: ``apt install libaio-dev``; its first run compiles the op, several minutes).

Prints a report and, with ``--out``, writes it. The temporary folders are removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _launch import ROOT, torchrun

GIB = 2**30


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _io() -> tuple[int, int]:
    fields = dict(
        line.split(": ") for line in Path("/proc/self/io").read_text().splitlines() if ": " in line
    )
    return int(fields["read_bytes"]), int(fields["write_bytes"])


class _PeakAnon:
    """The peak of ``RssAnon`` since the last :meth:`reset`, sampled on a thread."""

    def __init__(self) -> None:
        self.peak = _rss_anon()
        self._stop = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, _rss_anon())

    def reset(self) -> None:
        self.peak = _rss_anon()


def worker(args: argparse.Namespace) -> None:
    """One rank of the disk-tier run (``--worker disk``) or of the in-memory floor run."""
    import torch.distributed as dist

    sys.path.insert(0, str(ROOT))
    from examples.train_gpt import GPT, Block
    from shardwrap import Offload, ShardedModule

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    peak = _PeakAnon()
    depth = 2 if args.worker == "memory" else args.depth
    torch.manual_seed(0)
    with torch.device("cpu" if args.worker.startswith("deepspeed") else "meta"):
        model = GPT(
            vocab=256, width=args.width, heads=args.width // 128, depth=depth, context=args.context
        )
    n_params = sum(p.numel() for p in model.parameters())
    start = time.perf_counter()
    if args.worker.startswith("deepspeed"):
        model, opt = _deepspeed(model, args.store if args.worker == "deepspeed-nvme" else None)
    else:
        offload = Offload(device="disk", path=args.store) if args.worker == "disk" else None
        model = ShardedModule(model, auto_wrap=Block, offload=offload)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    built = time.perf_counter() - start
    g = torch.Generator().manual_seed(rank)
    tokens = torch.randint(256, (args.batch, args.context + 1), generator=g)
    steps = []
    for _ in range(args.steps):
        peak.reset()
        read0, written0 = _io()
        t = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])
        if args.worker.startswith("deepspeed"):
            model.backward(loss)
            model.step()
        else:
            loss.backward()
            opt.step()
            opt.zero_grad()
        took = time.perf_counter() - t
        read1, written1 = _io()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        steps.append(
            {
                "step_s": took,
                "loss": mean.item() / dist.get_world_size(),
                "read_bytes": read1 - read0,
                "written_bytes": written1 - written0,
                "peak_rss_anon": peak.peak,
            }
        )
        if rank == 0:
            print(json.dumps(steps[-1]), flush=True)
    root = getattr(model, "_shardwrap_root", None)
    home = root.home if root is not None else None
    result = {
        "rank": rank,
        "n_params": n_params,
        "build_s": built,
        "store_bytes": getattr(home, "nbytes", 0),  # the disk tier's files
        "steps": steps,
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.result).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def _deepspeed(
    model: torch.nn.Module, nvme: str | None
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """DeepSpeed ZeRO-3 with its parameters and optimizer offloaded to host memory, or with
    ``nvme`` to files in that folder (its NVMe path, through libaio), the same AdamW (torch's:
    its own CPU Adam needs a compiler toolchain this machine may lack)."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("MAX_JOBS", "1")
    import deepspeed

    deepspeed.init_distributed("gloo")
    offload: dict = {"device": "cpu"} if nvme is None else {"device": "nvme", "nvme_path": nvme}
    engine, opt, *_ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
        config={
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": offload,
                "offload_param": offload,
            },
            "zero_allow_untested_optimizer": True,
            "zero_force_ds_cpu_optimizer": False,
        },
    )
    return engine, opt


def _bandwidth(folder: Path) -> tuple[float, float]:
    """Sequential write (fsynced) and cold read bandwidth of ``folder``'s disk, bytes/s."""
    path = folder / "bandwidth.bin"
    block = os.urandom(64 * 2**20)
    start = time.perf_counter()
    with open(path, "wb") as f:
        for _ in range(32):
            f.write(block)
        f.flush()
        os.fsync(f.fileno())
    write = 32 * len(block) / (time.perf_counter() - start)
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(64 * 2**20):
            pass
    read = 32 * len(block) / (time.perf_counter() - start)
    path.unlink()
    return write, read


def _launch(args: argparse.Namespace, kind: str, result: Path, store: Path) -> list[dict]:
    torchrun(
        __file__, "--worker", kind, "--result", str(result), "--store", str(store),
        "--width", str(args.width), "--depth", str(args.depth), "--steps", str(args.steps),
        "--batch", str(args.batch), "--context", str(args.context),
        capture=False, check=True,
    )  # fmt: skip
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=2560)
    parser.add_argument("--depth", type=int, default=24)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--out", type=Path)
    parser.add_argument(
        "--deepspeed", action="store_true", help="also DeepSpeed ZeRO-3 offloaded to host memory"
    )
    parser.add_argument(
        "--deepspeed-nvme", action="store_true", help="also DeepSpeed ZeRO-3 offloaded to files"
    )
    parser.add_argument("--worker", choices=["disk", "memory", "deepspeed", "deepspeed-nvme"])
    parser.add_argument("--result")
    parser.add_argument("--store")
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        folder = Path(tmp)
        write_bw, read_bw = _bandwidth(folder)
        free_before = shutil.disk_usage(folder).free
        disk = _launch(args, "disk", folder / "disk.json", folder / "store")
        free_during = free_before - sum(r["store_bytes"] for r in disk)
        memory = _launch(args, "memory", folder / "memory.json", folder / "unused")
        ds = (
            _launch(args, "deepspeed", folder / "ds.json", folder / "unused")
            if args.deepspeed
            else None
        )
        nvme = (
            _launch(args, "deepspeed-nvme", folder / "nvme.json", folder / "nvme")
            if args.deepspeed_nvme
            else None
        )
        free_after = shutil.disk_usage(folder).free
    n_params, small = disk[0]["n_params"], memory[0]["n_params"]
    last = [r["steps"][-1] for r in disk]
    step_s = max(s["step_s"] for s in last)
    moved_read = sum(s["read_bytes"] for s in last)
    moved_written = sum(s["written_bytes"] for s in last)
    compute_floor = (
        statistics.median(
            max(r["steps"][i]["step_s"] for r in memory) for i in range(1, args.steps)
        )
        * n_params
        / small
    )
    io_floor = moved_read / read_bw + moved_written / write_bw
    floor = max(compute_floor, io_floor)
    losses = [s["loss"] for s in disk[0]["steps"]]
    lines = [
        f"# Disk tier: a {n_params / 1e9:.2f}B-parameter GPT on 2 ranks",
        "",
        f"Date {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"GPT width {args.width}, depth {args.depth}, batch {args.batch} x {args.context} "
        "tokens per rank, AdamW (fused), built on the meta device, "
        f"`python benchmarks/offload_disk.py --width {args.width} --depth {args.depth} "
        f"--steps {args.steps}`.",
        "",
        f"- Training state: {n_params * 16 / GIB:.1f} GiB (fp32 parameters, gradients, two AdamW "
        f"moments); store on disk {sum(r['store_bytes'] for r in disk) / GIB:.1f} GiB; free disk "
        f"{free_before / GIB:.1f} GiB before, {free_during / GIB:.1f} GiB during, "
        f"{free_after / GIB:.1f} GiB after.",
        f"- Disk measured: write {write_bw / 1e9:.2f} GB/s (fsynced), cold read "
        f"{read_bw / 1e9:.2f} GB/s.",
        f"- Wrapping (materialising into the store): {max(r['build_s'] for r in disk):.1f} s.",
        f"- Loss by step: {', '.join(f'{v:.4f}' for v in losses)}.",
        "",
        "| step | step time (slowest rank) | read, both ranks | written, both ranks | "
        "peak RssAnon per rank |",
        "|---|---|---|---|---|",
    ]
    for i in range(args.steps):
        rows = [r["steps"][i] for r in disk]
        lines.append(
            f"| {i + 1} | {max(s['step_s'] for s in rows):.1f} s | "
            f"{sum(s['read_bytes'] for s in rows) / GIB:.1f} GiB | "
            f"{sum(s['written_bytes'] for s in rows) / GIB:.1f} GiB | "
            f"{max(s['peak_rss_anon'] for s in rows) / GIB:.2f} GiB |"
        )
    lines += [
        "",
        f"- Compute floor: {compute_floor:.1f} s (depth 2 in memory, "
        f"{small / 1e6:.0f}M parameters, scaled by {n_params / small:.1f}).",
        f"- I/O floor of the last step: {io_floor:.1f} s (its bytes over the measured bandwidths).",
        f"- Last step against the larger floor: {step_s / floor:.2f}x (target 1.3x).",
    ]
    others = [(n, r) for n, r in (("host offload", ds), ("NVMe offload", nvme)) if r is not None]
    if others:
        ours_peak = max(s["peak_rss_anon"] for r in disk for s in r["steps"])
        lines += [
            "",
            "Against DeepSpeed ZeRO-3 with parameters and optimizer offloaded (to host memory; "
            "to files through libaio, its NVMe path), torch's AdamW, the same model, batch and "
            "steps:",
            "",
            "| | last step | peak RssAnon per rank | loss by step |",
            "|---|---|---|---|",
            f"| shardwrap, disk tier | {step_s:.2f} s | {ours_peak / GIB:.2f} GiB | "
            f"{', '.join(f'{v:.4f}' for v in losses)} |",
        ]
        ratios = []
        for name, runs in others:
            last_s = max(r["steps"][-1]["step_s"] for r in runs)
            peak_b = max(s["peak_rss_anon"] for r in runs for s in r["steps"])
            their = ", ".join(f"{s['loss']:.4f}" for s in runs[0]["steps"])
            lines.append(
                f"| DeepSpeed, {name} | {last_s:.2f} s | {peak_b / GIB:.2f} GiB | {their} |"
            )
            ratios.append(
                f"against its {name}: step time {step_s / last_s:.2f}x, memory "
                f"{ours_peak / peak_b:.2f}x"
            )
        lines += ["", "shardwrap " + "; ".join(ratios) + "."]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
