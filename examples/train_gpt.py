"""Train a small byte-level GPT with shardwrap, on Python's own standard library by default.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py    # CPU, gloo (make demo)
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py    # one node of GPUs, NCCL

Every ``Block`` becomes a shardwrap unit; each rank keeps 1/N of the parameters, gradients
and AdamW state. Each rank trains on its own random windows of the corpus (the ``.py`` files
of the standard library, or any file or folder given with ``--data``, read as bytes), drawn
from the data position the logbook gives, so that a rollback past a loss spike can skip them.

A :class:`shardwrap.logbook.Logbook` keeps ``runs/<name>/``: ``logbook.jsonl``, ``loss.png``,
``system.png`` and ``checkpoints/`` (every ``--save-every`` steps); rerunning with the same
``--name`` (or ``--resume``: the newest run) continues it, at any number of ranks. When
torchrun restarts the ranks (``--max-restarts``), the run is named after torchrun's rendezvous
id, the same for every restart of one launch, so a restarted run resumes itself:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc_per_node=2 \\
        --max-restarts=1 examples/train_gpt.py

``--compress-params int8`` and ``--compress-grads int8`` (or ``int4``) quantize what the
gathers and the gradient reductions send (:class:`shardwrap.Compression`, error feedback on
unless ``--no-error-feedback``); ``benchmarks/compressed_convergence.py`` compares the loss.

At the end the model is exported to ``runs/<name>/model/model.safetensors``, rank 0 prints
the run's summary and a sample drawn with a temperature and top-k.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import re
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

import shardwrap
from shardwrap import Compression, ShardedModule
from shardwrap.logbook import Logbook, summary


class Block(nn.Module):
    """Pre-norm transformer block, the unit that shardwrap wraps."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, C)
        qkv = rearrange(self.qkv(self.ln_1(x)), "b t (n h d) -> n b h t d", n=3, h=self.heads)
        y = F.scaled_dot_product_attention(*qkv, is_causal=True)  # (B, H, T, D)
        x = x + self.proj(rearrange(y, "b h t d -> b t (h d)"))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2 in miniature over bytes; ``forward(idx)`` gives logits, with ``targets`` the loss."""

    def __init__(self, width: int, depth: int, heads: int, context: int, vocab: int = 256) -> None:
        super().__init__()
        self.context = context
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        for name, p in self.named_parameters():  # GPT-2's initialisation
            if name.endswith("bias"):
                nn.init.zeros_(p)
            elif p.ndim == 2:
                deep = name.endswith(("proj.weight", "mlp.2.weight"))
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * depth) if deep else 0.02)

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:  # idx: (B, T) int64
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))  # (B, T, vocab)
        if targets is None:
            return logits
        return F.cross_entropy(rearrange(logits, "b t v -> (b t) v"), targets.flatten())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=16, help="windows per rank and step")
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3, help="peak; linear warmup, cosine decay")
    p.add_argument("--data", type=Path, help="a file or folder; default: the stdlib's .py files")
    p.add_argument(
        "--name",
        help="default: gpt-<time>; under torchrun with --max-restarts, gpt-<rendezvous id>; "
        "with --resume, the newest run",
    )
    p.add_argument("--out-dir", type=Path, default=Path("runs"))
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    p.add_argument("--print-every", type=int, default=25, help="a progress line every N steps")
    p.add_argument("--resume", action="store_true", help="continue the newest run")
    p.add_argument("--sample-bytes", type=int, default=300)
    p.add_argument("--prompt", default="\n\ndef ", help="start of the closing sample")
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--compress-params",
        choices=("int8", "fp8"),
        help="send the parameter gathers quantized (shardwrap.Compression(params=...))",
    )
    p.add_argument(
        "--compress-grads",
        choices=("int8", "int4"),
        help="send the gradient reductions quantized (shardwrap.Compression(grads=...))",
    )
    p.add_argument(
        "--no-error-feedback",
        dest="error_feedback",
        action="store_false",
        help="with --compress-grads, drop the quantization error instead of carrying it to "
        "the next step",
    )
    return p.parse_args(argv)


def compression_of(args: argparse.Namespace) -> Compression:
    """What ``--compress-params``, ``--compress-grads`` and ``--no-error-feedback`` ask for;
    without the first two, nothing is compressed."""
    return Compression(
        params=args.compress_params, grads=args.compress_grads, error_feedback=args.error_feedback
    )


def load_corpus(data: Path | None) -> Tensor:
    """All bytes of the corpus as one uint8 tensor (files in sorted order, read in place)."""
    if data is None:
        stdlib = Path(sysconfig.get_paths()["stdlib"])
        skip = {"site-packages", "dist-packages"}
        files = [f for f in stdlib.rglob("*.py") if not skip & set(f.relative_to(stdlib).parts)]
    elif data.is_dir():
        files = [f for f in data.rglob("*") if f.is_file() and not f.name.startswith(".")]
    else:
        files = [data]
    files.sort()
    corpus = torch.empty(sum(f.stat().st_size for f in files), dtype=torch.uint8)
    view, at = memoryview(corpus.numpy()), 0
    for f in files:
        with open(f, "rb") as fh:
            at += fh.readinto(view[at:])
    return corpus[:at]


def check_restarts(args: argparse.Namespace) -> None:
    """On every rank before any collective: refuse restarts that could not resume the run, and
    warn (rank 0) when torchrun shares its rendezvous store with the ranks, with which torch
    2.13's ``init_process_group`` often fails or hangs after a restart.

    Raises:
        SystemExit: torchrun may restart the ranks, no ``--name`` or ``--resume`` is given, and
            torchrun has no rendezvous id to name the run by (neither ``--standalone`` nor
            ``--rdzv-id``): a restart would begin a new run from step 0.
    """
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0:
        return
    unnamed = args.name is None and not args.resume
    if unnamed and os.environ["TORCHELASTIC_RUN_ID"] == "none":  # torchrun's default id
        raise SystemExit(
            "torchrun may restart this run (--max-restarts) but gives it no rendezvous id to "
            "name it by, so a restart would begin a new run from step 0: pass --name NAME, or "
            "launch torchrun with --standalone or --rdzv-id=JOB_ID"
        )
    first = os.environ["RANK"] == "0" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0"
    if first and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        print(
            "warning: torchrun shares its rendezvous store with the ranks; after a restart "
            "init_process_group then often fails or hangs (torch 2.13). Launch torchrun with "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment",
            file=sys.stderr,
            flush=True,
        )


def run_name(args: argparse.Namespace) -> str:
    """``--name``; else with ``--resume`` the newest run with a checkpoint; else, when torchrun
    may restart the ranks (``--max-restarts`` above 0), ``gpt-<rendezvous id>``: the id is the
    same for every restart of one launch and differs between launches, so a restarted run
    finds its own folder and resumes from its latest checkpoint; else ``gpt-<time>``."""
    if args.name is not None:
        return args.name
    if args.resume:
        runs = [d for d in args.out_dir.glob("*") if (d / "checkpoints" / "latest").is_file()]
        if not runs:
            raise SystemExit(f"--resume: no run under {args.out_dir} has a checkpoint")
        return max(runs, key=lambda d: (d / "checkpoints" / "latest").stat().st_mtime).name
    if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
        return "gpt-" + re.sub(r"[^A-Za-z0-9._-]", "-", os.environ["TORCHELASTIC_RUN_ID"])
    return time.strftime("gpt-%Y%m%d-%H%M%S")


def lr_at(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def sample(
    model: GPT, prompt: bytes, n: int, args: argparse.Namespace, device: torch.device
) -> bytes:
    """Continue ``prompt`` by ``n`` bytes, each drawn from the ``top_k`` likeliest at
    ``temperature``. Every rank must call it alike (each forward gathers the shards), with
    the same seed, so that every rank draws the same bytes."""
    model.eval()
    generator = torch.Generator(device).manual_seed(args.seed)
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(idx[:, -model.context :])[:, -1] / args.temperature  # (1, vocab)
        top, which = logits.topk(args.top_k)
        pick = torch.multinomial(top.softmax(-1), 1, generator=generator)
        idx = torch.cat([idx, which.gather(-1, pick)], dim=1)
    model.train()
    return bytes(idx[0, len(prompt) :].tolist())


def main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    check_restarts(args)
    if "RANK" in os.environ:  # under torchrun
        # A hung rank holds the others in their collective until this timeout (torch's default:
        # 30 minutes with gloo); then they fail (shardwrap.CollectiveFailed) instead of waiting.
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
    else:  # plain `python examples/train_gpt.py`: one rank, the same code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank = dist.get_rank()
    names = [run_name(args) if rank == 0 else ""]
    dist.broadcast_object_list(names, src=0)  # one run folder for all ranks
    out = args.out_dir / names[0]
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    corpus = load_corpus(args.data)
    windows = corpus.unfold(0, args.context + 1, 1)  # (n, T+1), a view

    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(args.width, args.depth, args.heads, args.context)
    decay = {n for n, p in model.named_parameters() if p.ndim >= 2}
    compression = compression_of(args)
    model = ShardedModule(model, auto_wrap=Block, compression=compression)
    device = model.wte.weight.device  # where shardwrap put the shards
    named = list(model.named_parameters())  # shards are 1-D: choose weight decay by name
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.1},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
    )
    if rank == 0:
        print(f"{out}: {len(corpus):,} bytes of corpus, {dist.get_world_size()} ranks, {device}")
        if compression.enabled:
            print(f"{out}: {compression}")
        if int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0")) > 0:
            restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
            most = os.environ["TORCHELASTIC_MAX_RESTARTS"]
            print(f"{out}: torchrun restart {restart} of at most {most}; a restart resumes it")
    every = dict(save_every=args.save_every, print_every=args.print_every)
    with Logbook(out, model, opt, keep_last=args.keep_last, clip=1.0, **every) as book:
        for step in book.steps(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            draw = torch.Generator().manual_seed(
                args.seed * 1_000_003 + book.position * 1009 + rank
            )
            starts = torch.randint(len(windows), (args.batch,), generator=draw)
            batch = windows[starts].to(device, torch.long)  # (B, T+1)
            loss = model(batch[:, :-1], batch[:, 1:])
            loss.backward()
            book.step(loss, tokens=batch[:, 1:].numel(), samples=starts.tolist())
    shardwrap.export(out / "model", model)  # one consolidated model.safetensors
    text = sample(model, args.prompt.encode(), args.sample_bytes, args, device)
    if rank == 0:
        print(summary(out))
        print(f"\nsample (temperature {args.temperature}, top-{args.top_k}):")
        print(args.prompt + text.decode(errors="replace"))
        print(f"\nwrote {out}/ (python -m shardwrap.logbook {out} to summarise it again)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
