"""An ``accelerate`` training loop on a sharded Llama and on the same model under DDP.

Launched by tests/e2e/test_hf_trainer.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/hf_accelerate.py OUT.json WORKDIR

The loop is the one ``accelerate`` documents, unchanged between the two modes: ``prepare``,
gradient accumulation over 2 micro-batches (``accumulate``), ``backward``, ``clip_grad_norm_``
at norm 1, a scheduler, an evaluation after every step with ``gather_for_metrics``. ``ddp``
prepares the plain model (accelerate wraps it in DDP); ``shardwrap`` prepares a
``ShardedModule``, saves a shardwrap checkpoint at step 2, and then a fresh sharded model
resumes from it. Both then ``generate()`` with a different length on each rank. Rank 0 writes
the per-step losses, gradient norms and evaluation losses, and the generated tokens.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shardwrap
from shardwrap import ShardedModule
from tests.support.models import tiny_llama_config

LENGTH, STEPS, MICRO = 12, 4, 2


def _rows(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(2, 90, (n, 1), generator=g)
    stride = torch.randint(1, 4, (n, 1), generator=g)
    return (start + stride * torch.arange(LENGTH)) % 97


def _setup(mode: str, accelerator: Accelerator) -> tuple[Any, ...]:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    if mode == "shardwrap":
        model = ShardedModule(model, auto_wrap=LlamaDecoderLayer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    train = torch.utils.data.DataLoader(_rows(64, 1), batch_size=2)
    evaluate = torch.utils.data.DataLoader(_rows(8, 2), batch_size=2)
    world = accelerator.num_processes
    scheduler = transformers.get_linear_schedule_with_warmup(optimizer, world, STEPS * world)
    return accelerator.prepare(model, optimizer, train, evaluate, scheduler)


def _loop(
    accelerator: Accelerator, parts: tuple[Any, ...], start: int, save_at: Path | None
) -> list[dict[str, float]]:
    model, optimizer, train, evaluate, scheduler = parts
    logs, step = [], start
    model.train()
    for i, batch in enumerate(train):
        if i < start * MICRO:
            continue
        with accelerator.accumulate(model):
            loss = model(input_ids=batch, labels=batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                norm = accelerator.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        if not accelerator.sync_gradients:
            continue
        step += 1
        model.eval()
        with torch.no_grad():
            losses = [
                accelerator.gather_for_metrics(model(input_ids=b, labels=b).loss[None])
                for b in evaluate
            ]
        model.train()
        train_loss = accelerator.gather(loss.detach()[None]).mean().item()
        logs.append(
            {
                "step": step,
                "loss": train_loss,
                "grad_norm": float(norm),
                "eval_loss": torch.cat(losses).mean().item(),
            }
        )
        if save_at is not None and step == 2:
            shardwrap.save_checkpoint(
                save_at, model, optimizer.optimizer, step=step, scheduler=scheduler.state_dict()
            )
        if step == STEPS:
            break
    return logs


def _generate(model: Any) -> list[Any]:
    model.eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        out = model.generate(
            prompt, max_new_tokens=3 + 3 * dist.get_rank(), do_sample=False, pad_token_id=0
        )
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out[0].tolist())
    return gathered


def main(out_path: str, work: str) -> None:
    transformers.logging.set_verbosity_error()
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    results: dict[str, Any] = {}
    for mode in ("ddp", "shardwrap"):
        parts = _setup(mode, accelerator)
        save_at = Path(work) / "step-2" if mode == "shardwrap" else None
        results[mode] = {
            "logs": _loop(accelerator, parts, 0, save_at),
            "generated": _generate(accelerator.unwrap_model(parts[0])),
            "prepared_as": type(parts[0]).__name__,
        }
    resumed = _setup("shardwrap", accelerator)
    extra = shardwrap.load_checkpoint(Path(work) / "step-2", resumed[0], resumed[1].optimizer)
    resumed[4].load_state_dict(extra["scheduler"])
    results["shardwrap"]["resumed_logs"] = _loop(accelerator, resumed, extra["step"], None)
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
