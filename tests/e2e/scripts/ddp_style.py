"""A DDP training script in the shape of nanoGPT's ``train.py``; one line picks the wrapper.

Launched by tests/e2e/test_from_ddp.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/ddp_style.py OUT WRAP [FIXES]

``WRAP`` is ``ddp`` or ``shardwrap``: the wrap line, the only line that differs. The rest keeps
DDP's habits: a seed per rank (``1337 + rank``) before the model is built, ``raw_model =
model.module``, gradient accumulation with ``model.require_backward_grad_sync``, gradient
clipping, and every ``eval_interval`` iterations an evaluation and a save of
``raw_model.state_dict()`` and ``optimizer.state_dict()`` to ``OUT/ckpt.pt``, both on the master
rank alone. ``FIXES``, comma-separated, makes the changes docs/ddp.md asks for: ``eval``
evaluates on every rank and averages the losses over ranks (every rank then decides alike
whether to save), ``save`` saves ``model.full_state_dict(rank0_only=True)`` and
``shardwrap.full_optimizer_state_dict(...)`` from every rank (rank 0 writes). The data are
windows of a fixed token stream drawn with a generator per rank, and evaluation draws from
generators of its own, so where a rank evaluates does not change what it trains on.

The master rank writes ``OUT/result.json``: each iteration's loss (of its last micro-batch, as
nanoGPT logs it), whether ``raw_model`` is ``model``, and, for shardwrap, the reduce-scatter
calls of each micro-batch's backward.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import shardwrap
from shardwrap import ShardedModule
from tests.support.launch import end_ranks
from tests.support.models import GPT, Block

out_dir, wrap = Path(sys.argv[1]), sys.argv[2]
fixes = set(sys.argv[3].split(",")) if len(sys.argv) > 3 else set()

batch_size, block_size, vocab = 4, 16, 67
gradient_accumulation_steps = 2  # per rank
max_iters, eval_interval, eval_iters = 6, 3, 2
learning_rate, weight_decay, grad_clip = 3e-3, 0.1, 1.0
always_save_checkpoint = True

ddp = int(os.environ.get("RANK", -1)) != -1
if ddp:
    dist.init_process_group(backend="gloo")
    ddp_rank = int(os.environ["RANK"])
    ddp_world_size = int(os.environ["WORLD_SIZE"])
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
torch.manual_seed(1337 + seed_offset)

data = torch.randint(vocab, (4096,), generator=torch.Generator().manual_seed(0))
training = torch.Generator().manual_seed(1337 + seed_offset)


def get_batch(split: str, generator: torch.Generator = training) -> tuple[torch.Tensor, ...]:
    source = data[:3072] if split == "train" else data[3072:]
    ix = torch.randint(len(source) - block_size, (batch_size,), generator=generator)
    x = torch.stack([source[i : i + block_size] for i in ix])
    y = torch.stack([source[i + 1 : i + 1 + block_size] for i in ix])
    return x, y


model = GPT(vocab=vocab, width=36, heads=3, depth=2, context=block_size, tied=True)
if ddp:
    model = DDP(model) if wrap == "ddp" else ShardedModule(model, auto_wrap=Block)
raw_model = model.module if ddp else model

decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
optimizer = torch.optim.AdamW(
    [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
    lr=learning_rate,
    betas=(0.9, 0.95),
)


@torch.no_grad()
def estimate_loss() -> dict[str, float]:
    out = {}
    model.eval()
    for split in ["train", "val"]:
        evaluating = torch.Generator().manual_seed(7 + seed_offset)
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, evaluating)
            loss = model(X, Y)
            losses[k] = loss.item()
        mean = losses.mean()
        if "eval" in fixes:  # every rank decides on the same numbers
            dist.all_reduce(mean)
            mean /= ddp_world_size
        out[split] = mean.item()
    model.train()
    return out


def reductions() -> int:
    stats = getattr(model, "comm_stats", None)
    return stats.calls.get("reduce_scatter", 0) if stats is not None else 0


iter_num, best_val_loss = 0, 1e9
result: dict = {"losses": [], "reduced": [], "raw_model_is_model": raw_model is model}
X, Y = get_batch("train")
while True:
    if iter_num % eval_interval == 0 and (master_process or "eval" in fixes):
        losses = estimate_loss()
        if master_process:
            print(f"step {iter_num}: train loss {losses['train']:.4f}, val {losses['val']:.4f}")
        if losses["val"] < best_val_loss or always_save_checkpoint:
            best_val_loss = losses["val"]
            if iter_num > 0:
                if "save" in fixes:
                    checkpoint = {
                        "model": model.full_state_dict(rank0_only=True),
                        "optimizer": shardwrap.full_optimizer_state_dict(
                            model, optimizer, rank0_only=True
                        ),
                    }
                else:
                    checkpoint = {
                        "model": raw_model.state_dict(),
                        "optimizer": optimizer.state_dict(),
                    }
                checkpoint.update(iter_num=iter_num, best_val_loss=best_val_loss)
                if master_process:
                    torch.save(checkpoint, out_dir / "ckpt.pt")
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        before = reductions()
        loss = model(X, Y) / gradient_accumulation_steps
        X, Y = get_batch("train")
        loss.backward()
        result["reduced"].append(reductions() - before)
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    result["losses"].append(loss.item() * gradient_accumulation_steps)
    iter_num += 1
    if iter_num > max_iters:
        break

if master_process:
    (out_dir / "result.json").write_text(json.dumps(result))
if ddp:
    del model  # nothing then holds the group; see end_ranks
    end_ranks()
