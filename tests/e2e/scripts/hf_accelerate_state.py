"""accelerate's ``save_state``, ``load_state`` and ``get_state_dict`` on a sharded Llama.

Launched by tests/e2e/test_hf_trainer.py:

    torchrun --standalone --nproc_per_node=2 \
        tests/e2e/scripts/hf_accelerate_state.py OUT.json WORKDIR

First, on every rank, ``shardwrap.hf.Trainer`` with ``TrainingArguments(bf16=True)`` on a
float32 sharded model is built, and the error is recorded (it must come before any
collective, or the ranks would hang here). Then, at stages 2 and 3, an ``accelerate`` loop
(SGD with momentum, a linear scheduler, each rank its slice of the global batch) trains a
sharded model alongside the plain model stepping on the whole global batch, 2 steps;
``save_state``; 2 steps more; ``load_state`` and the same 2 steps again. Rank 0 writes, per
stage: the largest difference to the plain model after steps 2 and 4, whether the parameters
after the reload equal those saved at step 2 and those after the repeated steps equal the
first step 4 (exactly), the learning rates, the files written, and whether
``get_state_dict`` holds every key at full shape on each rank and equals ``full_state_dict``.
"""

from __future__ import annotations

import copy
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

import shardwrap.hf
from shardwrap import ShardedModule
from tests.support.models import tiny_llama_config

LENGTH, GLOBAL_BATCH = 12, 4


def _batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    start = torch.randint(2, 90, (GLOBAL_BATCH, 1), generator=g)
    return (start + torch.arange(LENGTH)) % 97


def _refused_trainer(work: Path) -> str:
    torch.manual_seed(0)
    model = ShardedModule(
        transformers.LlamaForCausalLM(tiny_llama_config()), auto_wrap=LlamaDecoderLayer
    )
    args = transformers.TrainingArguments(
        output_dir=str(work / "trainer"), use_cpu=True, bf16=True, report_to=[]
    )
    try:
        shardwrap.hf.Trainer(model=model, args=args)
    except ValueError as error:
        return str(error)
    return "no error"


class Steps:
    """A sharded model and the plain one, stepping alike; the sharded one through accelerate."""

    def __init__(self, accelerator: Accelerator, stage: int) -> None:
        torch.manual_seed(0)
        plain = transformers.LlamaForCausalLM(tiny_llama_config())
        self.plain = plain
        self.plain_opt = torch.optim.SGD(plain.parameters(), lr=0.5, momentum=0.9)
        self.plain_sched = torch.optim.lr_scheduler.LinearLR(self.plain_opt, 1.0, 0.1, 6)
        model = ShardedModule(copy.deepcopy(plain), auto_wrap=LlamaDecoderLayer, stage=stage)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
        scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, 6)
        self.accelerator = accelerator
        self.model, self.optimizer, self.scheduler = accelerator.prepare(
            model, optimizer, scheduler
        )

    def sharded(self, step: int) -> None:
        rank, world = dist.get_rank(), dist.get_world_size()
        ids = _batch(step).chunk(world)[rank]
        loss = self.model(input_ids=ids, labels=ids).loss
        self.accelerator.backward(loss)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()

    def plain_step(self, step: int) -> None:
        ids = _batch(step)
        world = dist.get_world_size()
        for part in ids.chunk(world):  # the mean of the ranks' mean losses
            (self.plain(input_ids=part, labels=part).loss / world).backward()
        self.plain_opt.step()
        for _ in range(world):  # accelerate steps a scheduler once per process and step
            self.plain_sched.step()
        self.plain_opt.zero_grad()

    def full(self) -> dict[str, torch.Tensor]:
        return self.model.full_state_dict()

    def off_plain(self) -> float:
        plain = self.plain.state_dict()
        return max((v - plain[k]).abs().max().item() for k, v in self.full().items())


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def run(accelerator: Accelerator, stage: int, work: Path) -> dict[str, Any]:
    folder = work / f"state-stage{stage}"
    steps = Steps(accelerator, stage)
    for step in (1, 2):
        steps.sharded(step)
        steps.plain_step(step)
    off_at_2 = steps.off_plain()
    accelerator.save_state(str(folder))
    saved, lr_saved = steps.full(), steps.scheduler.get_last_lr()
    for step in (3, 4):
        steps.sharded(step)
        steps.plain_step(step)
    first_4, off_at_4 = steps.full(), steps.off_plain()

    state = accelerator.get_state_dict(steps.model)
    shapes = {k: list(v.shape) for k, v in steps.plain.state_dict().items()}
    full_shapes = {k: list(v.shape) for k, v in state.items()} == shapes
    get_state_equal = _equal(state, first_4)

    accelerator.load_state(str(folder))
    reloaded, lr_loaded = steps.full(), steps.scheduler.get_last_lr()
    for step in (3, 4):
        steps.sharded(step)
    again_4 = steps.full()
    checks = [full_shapes, get_state_equal, _equal(reloaded, saved), _equal(again_4, first_4)]
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, checks)
    return {
        "off_plain": [off_at_2, off_at_4],
        "checks_per_rank": everyone,  # full shapes, == full_state_dict, reload, repeat
        "lr": [lr_saved, lr_loaded],
        "files": sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()),
    }


def main(out_path: str, work: str) -> None:
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    refused = _refused_trainer(Path(work))
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)  # the Trainer's state had bf16
    accelerator = Accelerator(cpu=True)
    results: dict[str, Any] = {"refused": refused}
    for stage in (2, 3):
        results[f"stage{stage}"] = run(accelerator, stage, Path(work))
        accelerator.free_memory()
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
