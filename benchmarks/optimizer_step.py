"""One optimizer step on one CPU thread, set against the memory bandwidth that bounds it.

    python benchmarks/optimizer_step.py [--numel 100_000_000] [--tensors 100] [--repeats 3]
        [--out FILE] [--note TEXT]

An elementwise optimizer step reads and writes every byte of its state once, so its floor is
the bytes it moves over the memory bandwidth. Measured here, on one thread:

1. The bandwidth: the best of ten copies of a 400 MB fp32 tensor (``dst.copy_(src)``) and
   of ten in-place additions of one to another (``a.add_(b)``), before the steps and again
   after them, counting the bytes read and the bytes written. The addition is the floor:
   like an optimizer step it writes only what it reads, while a copy also reads the
   destination's lines before writing them (traffic its 2 counted bytes per element omit).
2. The step over ``--numel`` fp32 elements split into ``--tensors`` parameters, gradients set,
   state made by a first step: AdamW (reads the parameter, gradient and both moments, writes
   the parameter and both moments: 28 bytes per element) and SGD with momentum (reads the
   parameter, gradient and momentum, writes the parameter and momentum: 20 bytes), each with
   torch's per-tensor loop (``foreach=False``), multi-tensor path (``foreach=True``) and fused
   kernel (``fused=True``); and AdamW with default options over the disk tier's shard
   parameters (state in store files, page cache warm), the step users of the disk tier get.
3. Each step as bytes moved per element and as a ratio to the bandwidth floor; the best of
   ``--repeats`` steps.

Prints a report (with its command line and ``--note``, e.g. what else the machine was doing)
and, with ``--out``, writes it. The store's files are removed at the end. About 25 s.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from _launch import ROOT

COPY_NUMEL = 100_000_000
BYTES_PER_ELEMENT = {"AdamW": 7 * 4, "SGD": 5 * 4}  # fp32 tensors read + written per element


def _best(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def bandwidth(repeats: int) -> tuple[float, float]:
    """Bytes per second one thread moves (read plus written): copying a tensor
    (``dst.copy_(src)``: 2 per element) and adding one in place (``a.add_(b)``: 3)."""
    a, b = torch.rand(COPY_NUMEL), torch.rand(COPY_NUMEL)
    dst = torch.empty_like(a)
    dst.copy_(a)  # touch every page first
    copy = 2 * a.nbytes / _best(lambda: dst.copy_(a), repeats)
    add = 3 * a.nbytes / _best(lambda: a.add_(b), repeats)
    return copy, add


def _make(kind: str, params: list[torch.Tensor], choice: dict[str, bool]) -> torch.optim.Optimizer:
    if kind == "AdamW":
        return torch.optim.AdamW(params, lr=1e-3, **choice)
    return torch.optim.SGD(params, lr=1e-3, momentum=0.9, **choice)


def step_time(
    kind: str, params: list[torch.Tensor], choice: dict[str, bool], repeats: int
) -> tuple[float, bool]:
    """Seconds of the best of ``repeats`` steps, after a first step has made the state, and
    whether the steps took the fused kernel."""
    opt = _make(kind, params, choice)
    opt.step()
    took = _best(opt.step, repeats)
    return took, bool(opt.param_groups[0]["fused"])


def _cpu() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def _params(numel: int, tensors: int) -> list[torch.Tensor]:
    sizes = [numel // tensors + (i < numel % tensors) for i in range(tensors)]
    params = [torch.nn.Parameter(torch.rand(n)) for n in sizes]
    for p in params:
        p.grad = torch.rand_like(p)
    return params


def _stored_params(numel: int, tensors: int, folder: Path) -> tuple[list[torch.Tensor], object]:
    """Shard parameters of the disk tier over one store file, gradients set."""
    sys.path.insert(0, str(ROOT))
    from shardwrap.tiers.home import DiskHome

    store = DiskHome(torch.device("cpu"), folder, 0)
    flat = store.tensor(numel, torch.float32, "shard")
    flat.copy_(torch.rand(numel))
    params, at = [], 0
    for n in (numel // tensors + (i < numel % tensors) for i in range(tensors)):
        p = store.shard_param(flat[at : at + n], True)
        p.grad = torch.rand(n)
        params.append(p)
        at += n
    return params, store


def _arguments(args: argparse.Namespace) -> list[str]:
    """The command line's measuring arguments (the note is printed on its own)."""
    out = ["--numel", str(args.numel), "--tensors", str(args.tensors)]
    out += ["--repeats", str(args.repeats)]
    return out + (["--out", str(args.out)] if args.out else [])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--numel", type=int, default=100_000_000)
    parser.add_argument("--tensors", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--note", default="", help="a line for the report")
    args = parser.parse_args()
    torch.set_num_threads(1)
    copy_bw, bw = bandwidth(10)
    rows: list[tuple[str, str, float]] = []
    params = _params(args.numel, args.tensors)
    choices = {"loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}
    for kind in ("AdamW", "SGD"):
        for name, choice in choices.items():
            rows.append((kind, name, step_time(kind, params, choice, args.repeats)[0]))
    del params
    with tempfile.TemporaryDirectory(dir=os.environ.get("TMPDIR", "/tmp")) as tmp:
        stored, store = _stored_params(args.numel, args.tensors, Path(tmp))
        took, fused = step_time("AdamW", stored, {}, args.repeats)
        rows.append(("AdamW", f"disk tier, default options (fused: {fused})", took))
        del stored
        store.close()  # type: ignore[attr-defined]
    copy_bw, bw = (max(pair) for pair in zip((copy_bw, bw), bandwidth(10)))

    lines = [
        "# One optimizer step on one CPU thread against the memory bandwidth",
        "",
        f"Date {time.strftime('%Y-%m-%d')}, torch {torch.__version__}, Python "
        f"{platform.python_version()}, {_cpu()}, "
        f"{os.cpu_count()} CPUs, one thread; {args.numel:,} fp32 elements in {args.tensors} "
        f"parameters; best of {args.repeats} steps after the first.",
        "",
        f"Command: `OMP_NUM_THREADS=1 python benchmarks/{Path(__file__).name} "
        f"{shlex.join(_arguments(args))}`",
        "",
        *([args.note, ""] if args.note else []),
        f"Memory bandwidth, one thread, bytes read + written over {4 * COPY_NUMEL / 1e6:.0f} "
        f"MB tensors: in-place add (`a.add_(b)`, the floor below) **{bw / 1e9:.1f} GB/s**; "
        f"copy (`dst.copy_(src)`) {copy_bw / 1e9:.1f} GB/s.",
        "",
        "| optimizer | path | step | bytes moved per element | effective GB/s | "
        "bandwidth floor | step / floor |",
        "|---|---|---|---|---|---|---|",
    ]
    for kind, name, took in rows:
        moved = BYTES_PER_ELEMENT[kind] * args.numel
        floor = moved / bw
        lines.append(
            f"| {kind} | {name} | {took * 1e3:.0f} ms | {BYTES_PER_ELEMENT[kind]} | "
            f"{moved / took / 1e9:.1f} | {floor * 1e3:.0f} ms | {took / floor:.2f}x |"
        )
    lines += [
        "",
        "AdamW moves 28 bytes per element (reads parameter, gradient, two moments; writes "
        "parameter, two moments), SGD with momentum 20 (reads parameter, gradient, momentum; "
        "writes parameter, momentum). The disk tier's row is AdamW built with no options over "
        "the shard parameters, which shardwrap steps with the fused kernel.",
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        args.out.write_text(report)


if __name__ == "__main__":
    main()
