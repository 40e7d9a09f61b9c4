"""Train a small byte-level GPT with shardwrap, on Python's own standard library by default.

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py    # CPU, gloo (make demo)
    torchrun --standalone --nproc_per_node=8 examples/train_gpt.py    # one node of GPUs, NCCL

Every ``Block`` becomes a shardwrap unit; each rank keeps 1/N of the parameters, gradients
and AdamW state. Each rank trains on its own random windows of the corpus (the ``.py`` files
of the standard library, or any file or folder given with ``--data``, read as bytes). Rank 0
shows a progress bar, then a table of throughput and memory and a greedy sample, and writes
``runs/<name>/``: ``metrics.jsonl`` (one line per step), ``loss.png`` and ``summary.json``.

Every ``--save-every`` steps all ranks save a sharded checkpoint to ``runs/<name>/checkpoints/``
(the newest ``--keep-last`` kept); ``--resume`` continues a run from its latest one, at any
number of ranks. The final model is exported to ``runs/<name>/model/model.safetensors``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn
from tqdm import tqdm

import shardwrap
from shardwrap import ShardedModule


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
    p.add_argument("--name", help="default: gpt-<time>; with --resume, the newest run")
    p.add_argument("--out-dir", type=Path, default=Path("runs"))
    p.add_argument("--save-every", type=int, default=100, help="checkpoint every N steps; 0: never")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints kept")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--sample-bytes", type=int, default=200)
    p.add_argument("--prompt", default="\n\ndef ", help="start of the greedy sample")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


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


def run_name(args: argparse.Namespace) -> str:
    """``--name``, else the newest run with a checkpoint (``--resume``), else a fresh name."""
    if args.name is not None:
        return args.name
    if args.resume:
        runs = [d for d in args.out_dir.glob("*") if (d / "checkpoints" / "latest").is_file()]
        if not runs:
            raise SystemExit(f"--resume: no run under {args.out_dir} has a checkpoint")
        return max(runs, key=lambda d: (d / "checkpoints" / "latest").stat().st_mtime).name
    return time.strftime("gpt-%Y%m%d-%H%M%S")


def peak_rss_bytes() -> int:
    """This process's resident-set high-water mark (``ru_maxrss`` is KiB on Linux)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def lr_at(step: int, args: argparse.Namespace) -> float:
    warmup = max(1, args.steps // 20)
    if step < warmup:
        return args.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, args.steps - warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def generate(model: GPT, prompt: bytes, n: int, device: torch.device) -> bytes:
    """Greedy continuation. Every rank must call it alike: each forward gathers the shards."""
    model.eval()
    idx = torch.tensor([list(prompt)], dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(idx[:, -model.context :])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    return bytes(idx[0, len(prompt) :].tolist())


def main(args: argparse.Namespace) -> None:
    cuda = torch.cuda.is_available()
    backend = "nccl" if cuda else "gloo"
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group(backend)
    else:  # plain `python examples/train_gpt.py`: one rank, the same code path
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    names = [run_name(args) if rank == 0 else ""]
    dist.broadcast_object_list(names, src=0)  # one run folder for all ranks
    args.name = names[0]
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    corpus = load_corpus(args.data)
    windows = corpus.unfold(0, args.context + 1, 1)  # (n, T+1), a view
    rng = torch.Generator().manual_seed(args.seed * 1_000_003 + rank)  # own windows per rank

    rss_before = peak_rss_bytes()
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    model = GPT(args.width, args.depth, args.heads, args.context)
    n_params = sum(p.numel() for p in model.parameters())
    decay = {n for n, p in model.named_parameters() if p.ndim >= 2}
    model = ShardedModule(model, auto_wrap=Block)
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

    out = args.out_dir / args.name
    checkpoints = out / "checkpoints"
    first_step = 0
    losses: list[float] = []
    if args.resume:  # any world size: each rank reads the pieces its shards need
        extra = shardwrap.load_checkpoint(checkpoints, model, opt)
        first_step, losses = extra["step"], extra["losses"]
        rng.set_state(extra["rng"])
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        previous = out / "metrics.jsonl"
        kept = previous.read_text().splitlines()[:first_step] if previous.is_file() else []
        metrics = open(previous, "w")
        metrics.writelines(line + "\n" for line in kept)
        print(f"{n_params:,} parameters; {len(corpus):,} bytes of corpus; {world} ranks, {device}")
        if args.resume:
            print(f"resumed from step {first_step} ({shardwrap.latest_checkpoint(checkpoints)})")
    tokens_per_step = world * args.batch * args.context
    bar = tqdm(
        range(first_step, args.steps),
        initial=first_step,
        total=args.steps,
        disable=rank != 0,
        unit="step",
        dynamic_ncols=True,
    )
    start = last = time.perf_counter()
    for step in bar:
        lr = lr_at(step, args)
        for group in opt.param_groups:
            group["lr"] = lr
        starts = torch.randint(len(windows), (args.batch,), generator=rng)
        batch = windows[starts].to(device, torch.long)  # (B, T+1)
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        losses.append(loss.item() / world)
        now = time.perf_counter()
        tokens_per_s, last = tokens_per_step / (now - last), now
        if rank == 0:
            record = dict(step=step + 1, loss=losses[-1], lr=lr, tokens_per_s=tokens_per_s)
            metrics.write(json.dumps({**record, "elapsed": now - start}) + "\n")
            metrics.flush()
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{tokens_per_s:,.0f}")
        done = step + 1
        if args.save_every and (done % args.save_every == 0 or done == args.steps):
            shardwrap.save_checkpoint(
                checkpoints / f"step-{done:06d}",
                model,
                opt,
                keep_last=args.keep_last,
                step=done,
                losses=losses,
                rng=rng.get_state(),
            )
            last = time.perf_counter()  # the save does not count against the next step
    bar.close()
    train_s = time.perf_counter() - start
    shardwrap.export(out / "model", model)  # one consolidated model.safetensors

    # This rank's shards of parameters, gradients (as large, while they exist) and AdamW state.
    held = sum(t.nbytes for _, p in named for t in [p, p, *opt.state[p].values()] if t.ndim > 0)
    if cuda:
        memory = {"peak allocated": torch.cuda.max_memory_allocated(device)}
    else:
        peak = peak_rss_bytes()
        memory = {"peak RSS": peak, "RSS before model": rss_before}
        memory["peak RSS - RSS before model"] = peak - rss_before
    per_rank: list[dict] = [{}] * world
    dist.all_gather_object(per_rank, {"params+grads+AdamW held": held, **memory})
    sample = generate(model, args.prompt.encode(), args.sample_bytes, device)

    if rank == 0:
        metrics.close()
        summary = {
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            "world_size": world,
            "device": device.type,
            "parameters": n_params,
            "loss_first": losses[0],
            "loss_last10": sum(losses[-10:]) / len(losses[-10:]),
            "tokens_per_s": tokens_per_step * (args.steps - first_step) / train_s,
            "train_seconds": train_s,
            "unsharded_bytes_computed": 16 * n_params,
            "per_rank_bytes": per_rank,
            "sample": sample.decode(errors="replace"),
        }
        (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        plot_loss(losses, out / "loss.png")
        print_report(summary, args.prompt, out)
    dist.destroy_process_group()


def plot_loss(losses: list[float], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set(xlabel="step", ylabel="loss (nats per byte)", title=path.parent.name)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def print_report(s: dict, prompt: str, out: Path) -> None:
    mib = 2.0**20
    loss = f"{s['loss_first']:.3f} -> {s['loss_last10']:.3f} nats/byte"
    rows = [
        ("parameters", f"{s['parameters']:,}"),
        ("loss: first step -> mean of last 10", loss),
        (f"tokens/s, all {s['world_size']} ranks", f"{s['tokens_per_s']:,.0f}"),
        ("training time", f"{s['train_seconds']:.0f} s"),
        ("unsharded params+grads+AdamW", f"{s['unsharded_bytes_computed'] / mib:.1f} MiB"),
    ]
    for r, measured in enumerate(s["per_rank_bytes"]):
        rows += [(f"rank {r}: {k}", f"{v / mib:.1f} MiB") for k, v in measured.items()]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"  {k:<{width}}  {v}" for k, v in rows))
    print("  (unsharded: computed at 16 B/param, not measured; 'held': this rank's shards)")
    print(f"\ngreedy sample:\n{prompt}{s['sample']}\n\nwrote {out}/")


if __name__ == "__main__":
    main(parse_args())
