"""Hugging Face ``Trainer`` for sharded models: ``from shardwrap.hf import Trainer``.

A drop-in for ``transformers.Trainer`` (and ``Seq2SeqTrainer``) when the model is a
:class:`shardwrap.ShardedModule`; everything else is the stock Trainer:

    model = ShardedModule(model, auto_wrap=LlamaDecoderLayer)
    trainer = shardwrap.hf.Trainer(model=model, args=args, train_dataset=...)
    trainer.train()                       # torchrun --nproc_per_node=N train.py

What the model itself already takes care of, so that the stock Trainer and a plain
``accelerate`` loop see a sharded model as ready: it is never wrapped in DDP (it reduces its
own gradients), moving it to the device it is on does nothing, ``torch.nn.utils.clip_grad_norm_``
clips by the global norm, and ``generate()`` keeps every rank decoding until all are done;
``accelerator.save_state``/``load_state`` write and read a shardwrap checkpoint
(``integrations/hf_accelerate.py``).

What this class changes is saving and loading, which the stock Trainer does on rank 0 alone:

- ``save_model`` (also the model part of every checkpoint): every rank gathers the full state
  dict to rank 0, which writes it with the model's own ``save_pretrained`` (``from_pretrained``
  loads it; tokenizer, config and training arguments as usual).
- Optimizer state: a shardwrap checkpoint (``checkpoint-N/shardwrap``), every rank writing its
  own shards; the scheduler as usual (``scheduler.pt``).
- Resuming (``train(resume_from_checkpoint=...)``) and ``load_best_model_at_end`` read them
  back, at any world size; a folder holding only ``save_pretrained`` files loads with
  :func:`shardwrap.load_pretrained`. A checkpoint the stock Trainer wrote for the plain model
  (under DDP or on one device: ``model.safetensors``, ``optimizer.pt``) resumes too, its
  optimizer state cut to this rank's pieces.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import transformers

from .checkpoint.full_optimizer import load_full_optimizer_state_dict
from .checkpoint.load import load_checkpoint
from .checkpoint.pretrained import load_pretrained
from .checkpoint.save import save_checkpoint
from .engine.wrap.sharded_module import ShardedModule
from .integrations.hf_accelerate import check_trainer_arguments

__all__ = ["Seq2SeqTrainer", "ShardedTrainerMixin", "Trainer"]

CHECKPOINT = "shardwrap"
SCHEDULER = "scheduler.pt"  # the stock Trainer's name for the scheduler's state
OPTIMIZER = "optimizer.pt"  # the stock Trainer's name for the optimizer's state (DDP, one GPU)
ADAPTER = ("adapter_model.safetensors", "adapter_model.bin")  # a PEFT model's own weights


class ShardedTrainerMixin:
    """Trainer methods for a sharded model; mix in ahead of a ``transformers.Trainer`` class.

    ``class MyTrainer(ShardedTrainerMixin, SomeTrainer)`` for Trainer subclasses of other
    libraries. Every method is called on every rank, as the Trainer calls them.
    """

    _shardwrap_saves = True  # what refuse_stock_trainer looks for
    model: Any
    optimizer: Any
    lr_scheduler: Any
    args: Any
    state: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """The Trainer's own ``__init__``, then a check of its arguments against the model.

        Raises:
            ValueError: ``bf16``, ``fp16`` or ``torch_compile`` that the sharded model would
                ignore (it is not wrapped with that precision or compilation), or
                ``bf16_full_eval``/``fp16_full_eval``; naming the ``ShardedModule`` keyword.
        """
        super().__init__(*args, **kwargs)
        if isinstance(self.model, ShardedModule):
            check_trainer_arguments(self.model._shardwrap_root, self.args)

    def _sharded(self) -> ShardedModule:
        if not isinstance(self.model, ShardedModule):
            raise TypeError(
                f"shardwrap.hf.Trainer trains a ShardedModule, got {type(self.model).__name__}; "
                "wrap the model with shardwrap.ShardedModule first, or use transformers.Trainer."
            )
        return self.model

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Gather the full state dict to rank 0 and write it with ``save_pretrained``, there
        alone: transformers' ``_save`` writes wherever it is called (before 5.23 it took its
        caller for process zero, and another rank's empty dict could overwrite rank 0's)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        full = self._sharded().full_state_dict(rank0_only=True)
        if self.args.should_save:
            self._save(output_dir, state_dict=full)  # type: ignore[attr-defined]

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        save_checkpoint(
            Path(output_dir) / CHECKPOINT,
            self._sharded(),
            self.optimizer,
            step=self.state.global_step,
        )
        if self.args.should_save and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER))

    def _load_model(self, checkpoint: str, trainable: bool) -> None:
        """The model's weights from ``checkpoint``: a shardwrap checkpoint, else a PEFT model's
        adapter (``save_only_model``: the adapter alone), else ``save_pretrained`` files."""
        model = self._sharded()
        folder = Path(checkpoint) / CHECKPOINT
        if folder.is_dir():
            load_checkpoint(folder, model)
        elif hasattr(model, "load_adapter") and any(
            (Path(checkpoint) / n).is_file() for n in ADAPTER
        ):
            model.load_adapter(checkpoint, model.active_adapters[0], is_trainable=trainable)
        else:
            load_pretrained(checkpoint, model)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        self._load_model(resume_from_checkpoint, trainable=True)

    def _load_best_model(self) -> None:
        self._load_model(self.state.best_model_checkpoint, trainable=False)  # as the stock one

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder, stock = Path(checkpoint) / CHECKPOINT, Path(checkpoint) / OPTIMIZER
        if folder.is_dir():
            load_checkpoint(folder, self._sharded(), self.optimizer)
        elif stock.is_file():  # the stock Trainer's checkpoint of a plain model: whole state
            state = torch.load(stock, map_location="cpu", weights_only=True)
            load_full_optimizer_state_dict(self._sharded(), self.optimizer, state)
        scheduler = Path(checkpoint) / SCHEDULER
        if scheduler.is_file() and self.lr_scheduler is not None:
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``evaluate``, its units gathered once for the whole evaluation where
        memory allows (``ShardedModule.keep_gathered()``)."""
        with self._sharded().keep_gathered():
            return super().evaluate(*args, **kwargs)  # type: ignore[misc]

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """The stock ``predict``, its units gathered once where memory allows."""
        with self._sharded().keep_gathered():
            return super().predict(*args, **kwargs)  # type: ignore[misc]


class Trainer(ShardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` for a :class:`shardwrap.ShardedModule` (see the module)."""


class Seq2SeqTrainer(ShardedTrainerMixin, transformers.Seq2SeqTrainer):
    """``transformers.Seq2SeqTrainer`` for a :class:`shardwrap.ShardedModule`.

    With ``predict_with_generate``, ``generate()`` decides ``synced_gpus`` as it does when
    called directly: with the units kept gathered each rank decodes on its own, with no
    collective per token (the stock trainer would ask every rank to decode in step, with one
    per token, as for a model whose forward gathers). A ``synced_gpus`` passed to
    ``evaluate()`` or ``predict()`` is used as given.
    """

    def evaluate(self, *args: Any, **gen_kwargs: Any) -> Any:
        gen_kwargs.setdefault("synced_gpus", None)
        return super().evaluate(*args, **gen_kwargs)

    def predict(self, *args: Any, **gen_kwargs: Any) -> Any:
        gen_kwargs.setdefault("synced_gpus", None)
        return super().predict(*args, **gen_kwargs)
