"""The Hugging Face Trainer on a sharded GPT-2 and on the same model under DDP; write both.

Launched by tests/e2e/test_hf_trainer.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/hf_trainer.py OUT.json WORKDIR

For each of ``ddp`` (stock ``transformers.Trainer``, which wraps the plain model in DDP) and
``shardwrap`` (``shardwrap.hf.Trainer`` on a ``ShardedModule``), in this one launch: train
4 steps with gradient clipping at norm 1, a checkpoint and an evaluation every 2 steps; resume
a fresh model from ``checkpoint-2`` and train to step 4 again (and a sharded one from the DDP
run's ``checkpoint-2``); ``generate()`` with a
different length on each rank; ``save_model`` and reload the result with ``from_pretrained``.
Rank 0 writes the logged losses, gradient norms, evaluation losses, generated tokens and
whether the reloaded weights equal the trained ones.
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
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import shardwrap.hf
from shardwrap import ShardedModule
from tests.support.launch import end_ranks
from tests.support.models import tiny_gpt2_config

LENGTH = 12


class Windows(torch.utils.data.Dataset):
    """Token rows following a pattern the model can learn; labels are the inputs."""

    def __init__(self, rows: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        start = torch.randint(2, 90, (rows, 1), generator=g)
        stride = torch.randint(1, 4, (rows, 1), generator=g)
        self.ids = (start + stride * torch.arange(LENGTH)) % 97

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Logs(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.train: list[dict[str, float]] = []
        self.eval: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        logs = logs or {}
        if "loss" in logs:
            self.train.append({"step": state.global_step, **logs})
        if "eval_loss" in logs:
            self.eval.append(logs["eval_loss"])


def _arguments(out: Path) -> transformers.TrainingArguments:
    return transformers.TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=2,
        per_device_eval_batch_size=2,
        max_steps=4,
        learning_rate=3e-3,
        lr_scheduler_type="linear",
        warmup_steps=1,
        max_grad_norm=1.0,
        save_strategy="steps",
        save_steps=2,
        eval_strategy="steps",
        eval_steps=2,
        logging_steps=1,
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )


def _model(mode: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config(pad_token_id=0))
    return ShardedModule(model, auto_wrap=GPT2Block) if mode == "shardwrap" else model


def _trainer(mode: str, out: Path, logs: Logs) -> transformers.Trainer:
    cls = shardwrap.hf.Trainer if mode == "shardwrap" else transformers.Trainer
    return cls(
        model=_model(mode),
        args=_arguments(out),
        train_dataset=Windows(64, 1),
        eval_dataset=Windows(8, 2),
        callbacks=[logs],
    )


def run(mode: str, work: Path) -> dict[str, Any]:
    rank = dist.get_rank()
    out = work / mode
    logs = Logs()
    trainer = _trainer(mode, out, logs)
    trainer.train()
    model = trainer.model
    model.eval()
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        tokens = model.generate(
            prompt, max_new_tokens=3 + 3 * rank, do_sample=False, pad_token_id=0
        )[0].tolist()
    generated: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(generated, tokens)
    trainer.save_model(str(out / "final"))
    full = model.full_state_dict(rank0_only=True) if mode == "shardwrap" else model.state_dict()
    reload_equal = None
    if rank == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(out / "final").state_dict()
        reload_equal = all(torch.equal(loaded[k], v) for k, v in full.items())

    resumed = Logs()
    again = _trainer(mode, out, resumed)
    again.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    dist.barrier()
    return {
        "train": logs.train,
        "eval": logs.eval,
        "generated": generated,
        "reload_equal": reload_equal,
        "resumed_train": resumed.train,
        "resumed_eval": resumed.eval,
        "wrapped_in": type(trainer.model_wrapped).__name__,
        "checkpoint_files": sorted(
            str(p.relative_to(out)) for p in (out / "checkpoint-2").rglob("*") if p.is_file()
        ),
    }


def main(out_path: str, work: str) -> None:
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    results = {mode: run(mode, Path(work)) for mode in ("ddp", "shardwrap")}
    from_ddp = Logs()  # a run moved from DDP: the stock Trainer's checkpoint, optimizer.pt too
    again = _trainer("shardwrap", Path(work) / "from_ddp", from_ddp)
    again.train(resume_from_checkpoint=str(Path(work) / "ddp" / "checkpoint-2"))
    results["shardwrap"]["from_ddp_train"] = from_ddp.train
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results, indent=1))
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
