"""The loop of transformers' ``run_clm_no_trainer.py`` on a sharded Llama, to its last line.

Launched by tests/e2e/test_from_ddp.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/accelerate_no_trainer.py OUT

As the example has it: ``Accelerator(gradient_accumulation_steps=...)`` (no ``cpu=True``: the
test sets ``ACCELERATE_USE_CPU=1`` in the environment, or leaves it out), ``prepare``,
``accumulate``, ``backward``, an evaluation with ``gather_for_metrics``, then
``unwrap_model(model).save_pretrained(OUT/model, is_main_process=..., save_function=
accelerator.save)``. The master rank also writes ``accelerator.get_state_dict(model)`` (the
trained model, whole) to ``OUT/trained.pt``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"

import torch
import transformers
from accelerate import Accelerator
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardwrap import ShardedModule
from tests.support.models import tiny_llama_config

out = Path(sys.argv[1])
accelerator = Accelerator(gradient_accumulation_steps=2)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(tiny_llama_config())
model = ShardedModule(model, auto_wrap=LlamaDecoderLayer)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
g = torch.Generator().manual_seed(1)
rows = [{"input_ids": r, "labels": r} for r in torch.randint(2, 90, (32, 12), generator=g)]
train_dataloader = torch.utils.data.DataLoader(rows[:24], batch_size=2)
eval_dataloader = torch.utils.data.DataLoader(rows[24:], batch_size=2)
lr_scheduler = transformers.get_scheduler("linear", optimizer, 0, 6)
model, optimizer, train_dataloader, eval_dataloader, lr_scheduler = accelerator.prepare(
    model, optimizer, train_dataloader, eval_dataloader, lr_scheduler
)

model.train()
for batch in train_dataloader:
    with accelerator.accumulate(model):
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        lr_scheduler.step()
        optimizer.zero_grad()

model.eval()
losses = []
for batch in eval_dataloader:
    with torch.no_grad():
        loss = model(**batch).loss
    losses.append(accelerator.gather_for_metrics(loss.repeat(2)))
accelerator.print(f"eval loss {torch.cat(losses).mean().item():.4f}")

accelerator.wait_for_everyone()
unwrapped_model = accelerator.unwrap_model(model)
unwrapped_model.save_pretrained(
    out / "model", is_main_process=accelerator.is_main_process, save_function=accelerator.save
)
trained = accelerator.get_state_dict(model)
if accelerator.is_main_process:
    torch.save(trained, out / "trained.pt")
