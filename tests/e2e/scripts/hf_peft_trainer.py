"""The Hugging Face Trainer on a PEFT LoRA Llama: under DDP, and sharded at stages 2 and 3.

Launched by tests/e2e/test_hf_trainer.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/hf_peft_trainer.py OUT.json WORKDIR

For each of ``ddp`` (stock ``transformers.Trainer``, which wraps the plain PEFT model in DDP:
the plain model trained on the global batch) and ``stage2``/``stage3``
(``shardwrap.hf.Trainer`` on ``ShardedModule(get_peft_model(llama, lora))``), in this one
launch: train 4 AdamW steps, each rank its half of the global batch; ``save_model``; then on
rank 0 load the saved adapter with ``PeftModel.from_pretrained`` onto a fresh base model.
Rank 0 writes the logged losses, the keys of the adapter file, the trained model's logits on
a fixed batch (every rank computes them), the loaded adapter's and the untrained base model's
logits on that batch.
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
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

import shardwrap.hf
from shardwrap import ShardedModule
from tests.support.launch import end_ranks
from tests.support.models import hf_ids, tiny_llama_config

LENGTH = 10


class Rows(torch.utils.data.Dataset):
    """Token rows; labels are the inputs."""

    def __init__(self, rows: int) -> None:
        self.ids = hf_ids(7, rows, LENGTH)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class Losses(transformers.TrainerCallback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def _base() -> transformers.LlamaForCausalLM:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def _logits(model: torch.nn.Module) -> list[list[list[float]]]:
    model.eval()
    with torch.no_grad():
        return model(input_ids=hf_ids(99, 2, LENGTH)).logits.tolist()


def run(mode: str, work: Path) -> dict[str, Any]:
    out = work / mode
    lora = LoraConfig(
        task_type="CAUSAL_LM",
        r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        target_modules=["q_proj", "v_proj"],
    )
    model = get_peft_model(_base(), lora)
    if mode != "ddp":
        model = ShardedModule(model, auto_wrap=LlamaDecoderLayer, stage=int(mode[-1]))
    cls = transformers.Trainer if mode == "ddp" else shardwrap.hf.Trainer
    losses = Losses()
    args = transformers.TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        ddp_backend="gloo",
        per_device_train_batch_size=2,
        max_steps=4,
        learning_rate=1e-2,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    trainer = cls(model=model, args=args, train_dataset=Rows(32), callbacks=[losses])
    trainer.train()
    trainer.save_model(str(out / "final"))
    trained = _logits(trainer.model)
    dist.barrier()
    result: dict[str, Any] = {"losses": losses.losses, "trained_logits": trained}
    if dist.get_rank() == 0:
        result["adapter_keys"] = sorted(load_file(out / "final" / "adapter_model.safetensors"))
        result["loaded_logits"] = _logits(PeftModel.from_pretrained(_base(), out / "final"))
        result["base_logits"] = _logits(_base())
    return result


def main(out_path: str, work: str) -> None:
    transformers.logging.set_verbosity_error()
    dist.init_process_group("gloo")
    results = {mode: run(mode, Path(work)) for mode in ("ddp", "stage2", "stage3")}
    if dist.get_rank() == 0:
        Path(out_path).write_text(json.dumps(results))
    end_ranks()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
