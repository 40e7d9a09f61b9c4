"""What checking checksums costs a load: the 101M GPT's checkpoint with AdamW state.

    python benchmarks/load_verify.py [--rounds 3] [--out benchmarks/results/load_verify/FILE.md]

Saves the checkpoint (world size 1: 1.2 GB, parameters and two AdamW moments) under a
temporary folder, then times ``load_checkpoint`` in fresh processes, alternating loads that
check every stored tensor and file against its recorded checksum (as shipped) with loads that
skip the checks (the checking functions replaced by no-ops), each both cold (the files
evicted from the page cache first, as after a restart) and warm (just read). Prints, and with
``--out`` writes, the medians and the ratio. The folder is removed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from _launch import ROOT, python

CONFIG = dict(vocab=256, width=1024, heads=16, depth=8, context=64)


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    sys.path.insert(0, str(ROOT))
    from examples.train_gpt import GPT, Block
    from shardwrap import ShardedModule

    torch.manual_seed(0)
    model = ShardedModule(GPT(**CONFIG), auto_wrap=Block)
    opt = torch.optim.AdamW(model.parameters())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    opt.zero_grad()
    return model, opt


def save(folder: Path) -> None:
    from shardwrap import save_checkpoint

    model, opt = _model()
    save_checkpoint(folder, model, opt, step=1)


def load(folder: Path, check: bool) -> float:
    import shardwrap.checkpoint.load as loading
    from shardwrap import load_checkpoint

    if not check:
        loading._Loader._verify = lambda self, file, keys: None  # type: ignore[method-assign]
        loading._Loader._verify_file = lambda self, file, data: None  # type: ignore[method-assign]
        loading.tensor_checksum = lambda t: None  # type: ignore[assignment]
    model, opt = _model()
    start = time.perf_counter()
    load_checkpoint(folder, model, opt)
    return time.perf_counter() - start


def _evict(folder: Path) -> None:
    for path in folder.iterdir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _child(*args: str) -> str:
    return python(__file__, *args).stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        what, folder = args.child
        if what == "save":
            save(Path(folder))
        else:
            print(json.dumps(load(Path(folder), check=what == "check")))
        return
    times: dict[tuple[str, str], list[float]] = {}
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        folder = Path(tmp) / "ckpt"
        _child("--child", "save", str(folder))
        size = sum(p.stat().st_size for p in folder.iterdir())
        for _ in range(args.rounds):
            for cache in ("cold", "warm"):
                for mode in ("check", "skip"):
                    if cache == "cold":
                        _evict(folder)
                    took = json.loads(_child("--child", mode, str(folder)))
                    times.setdefault((cache, mode), []).append(took)
    lines = [
        "# Checksum checks on load: the 101M GPT checkpoint",
        "",
        f"Date {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {os.cpu_count()} CPUs, one process (world size 1), "
        f"checkpoint {size / 1e9:.2f} GB (parameters and AdamW moments, fp32), "
        f"{args.rounds} rounds; medians of `load_checkpoint` wall time.",
        "",
        "| page cache | checks skipped | checks on (as shipped) | added |",
        "|---|---|---|---|",
    ]
    for cache in ("cold", "warm"):
        skip = statistics.median(times[(cache, "skip")])
        check = statistics.median(times[(cache, "check")])
        lines.append(
            f"| {cache} | {skip:.3f} s | {check:.3f} s | {100 * (check / skip - 1):+.0f}% |"
        )
    lines += ["", f"All times (s): {json.dumps({f'{c}/{m}': v for (c, m), v in times.items()})}"]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
