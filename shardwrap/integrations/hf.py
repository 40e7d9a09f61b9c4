"""What users of Hugging Face ``transformers`` models call around training, on a sharded model.

A wrapped ``transformers`` model's class gains :class:`HuggingFaceHabits` ahead of its own:

- ``save_pretrained(dir)`` writes what :func:`shardwrap.export` writes (every rank calls it,
  rank 0 writes), so ``from_pretrained(dir)`` loads the whole model.
- ``generate()`` gathers every unit once for the call where the model fits, and each rank
  then decodes on its own; otherwise it keeps every rank decoding until all are done
  (``synced_gpus``): each decoding step gathers parameters, so a rank that stopped early
  would leave the others waiting.
- Hugging Face's own activation checkpointing (``gradient_checkpointing_enable()``, what
  ``Trainer(gradient_checkpointing=True)`` turns on) recomputes a layer's ``forward`` in
  backward; the recomputation is shown the full parameters, reusing the unit's backward
  gather, exactly as shardwrap's ``checkpoint_activations`` does.

The engine does not import this module: importing it registers the habits, the layers' own
checkpointing and the refusal of the stock ``Trainer`` with the engine
(``engine/wrap/extensions.py``); ``shardwrap/__init__.py`` imports it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn

from ..checkpoint.export import write_export
from ..comm.collectives import all_reduce
from ..engine.optim.callers import caller_frame
from ..engine.optim.whole_params import declare_optimizer_name
from ..engine.shards.unit import Unit
from ..engine.step.inference import decoding_alone
from ..engine.step.recompute import guard_recompute
from ..engine.step.root import Root
from ..engine.wrap import extensions

__all__ = [
    "HuggingFaceHabits",
    "any_rank_decoding",
    "checkpoint_hf_layer",
    "is_transformers_model",
    "refuse_stock_trainer",
    "synced_decoding",
]

# transformers' Adafactor (``TrainingArguments(optim="adafactor")``) factors the second moment
# into row and column means and scales by the parameter's RMS, as torch's does: stepped whole.
declare_optimizer_name("transformers.optimization.Adafactor", reads_shapes=True)

_TRAINER_MODULE = "transformers.trainer"

_GUARDED = "_shardwrap_guarded"

# save_pretrained's options and the value that means "not used"; export writes safetensors.
_SAVE_DEFAULTS: dict[str, Any] = {
    "push_to_hub": False,
    "variant": None,
    "token": None,
    "distributed_checkpoint": False,
    "safe_serialization": True,
    "save_peft_format": True,
    "save_original_format": True,
}
# save_pretrained's options that transformers takes and does not use: it writes safetensors
# itself (``save_function=accelerator.save``, the line accelerate's examples end with).
_UNUSED_OPTIONS = ("save_function",)


def refuse_stock_trainer() -> None:
    """Raise if a ``transformers.Trainer`` without shardwrap's saving is making this call.

    That Trainer saves checkpoints on rank 0 alone, which a sharded model cannot do: its first
    checkpoint would wait for the other ranks for good. It moves the model to its device
    while being built, so the mistake surfaces then, before any training.

    HACK: the Trainer hands nothing to the model that would say who calls; the callers'
    frames do (a few, read per save, and per move only while ``transformers.trainer`` is
    imported: see :func:`_refuse_stock_trainer_moving`).

    Raises:
        TypeError: naming ``shardwrap.hf.Trainer``.
    """
    frame = caller_frame(lambda f: _is_stock_trainer(type(f.f_locals.get("self"))), 16, skip=1)
    if frame is not None:
        raise TypeError(
            f"{type(frame.f_locals['self']).__name__} (transformers) saves the model on rank 0 "
            "alone, and a sharded model holds a piece on every rank: its first checkpoint would "
            "wait for good. Use shardwrap.hf.Trainer (or shardwrap.hf.Seq2SeqTrainer), or mix "
            "shardwrap.hf.ShardedTrainerMixin into your Trainer class ahead of it."
        )


def _refuse_stock_trainer_moving(model: nn.Module) -> None:
    """The move check: a Trainer can only be building (and moving) a Hugging Face model when
    its class has been imported, so no caller frame is read before then."""
    if isinstance(model, HuggingFaceHabits) and _TRAINER_MODULE in sys.modules:
        refuse_stock_trainer()


def _habits(cls: type) -> tuple[type, ...]:
    return (HuggingFaceHabits,) if is_transformers_model(cls) else ()


def _is_stock_trainer(cls: type) -> bool:
    return not getattr(cls, "_shardwrap_saves", False) and any(
        c.__name__ == "Trainer" and c.__module__ == "transformers.trainer" for c in cls.__mro__
    )


def is_transformers_model(cls: type) -> bool:
    """Whether ``cls`` is a ``transformers`` ``PreTrainedModel`` (without importing it)."""
    return any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in cls.__mro__
    )


def _is_checkpointing_layer(module: nn.Module) -> bool:
    return any(c.__name__ == "GradientCheckpointingLayer" for c in type(module).__mro__)


def _owning_units(root: Root, model: nn.Module) -> dict[int, Unit]:
    """Each module's unit: the innermost unit whose module encloses it."""
    unit_of = {id(u.module): u for u in root.units}
    owners: dict[int, Unit] = {}

    def visit(module: nn.Module, owner: Unit) -> None:
        owner = unit_of.get(id(module), owner)
        owners[id(module)] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, root.units[0])
    return owners


def _guarded(root: Root, unit: Unit, checkpoint: Callable[..., Any]) -> Callable[..., Any]:
    """``checkpoint`` (Hugging Face's ``_gradient_checkpointing_func``) whose recomputation
    sees ``unit``'s full parameters."""

    @functools.wraps(checkpoint)
    def run(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return checkpoint(guard_recompute(root, unit, function), *args, **kwargs)

    setattr(run, _GUARDED, True)
    return run


def guard_hf_checkpointing(root: Root, model: nn.Module) -> None:
    """Guard every checkpointing function Hugging Face installed on ``model``'s modules.

    Raises:
        ValueError: a layer that checkpoints itself encloses a unit: its recomputation
            would call that unit again in backward. Wrap by the layer class instead.
    """
    owners = _owning_units(root, model)
    units = {id(u.module) for u in root.units}
    for module in model.modules():
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        if checkpoint is None or getattr(checkpoint, _GUARDED, False):
            continue
        if _is_checkpointing_layer(module) and getattr(module, "gradient_checkpointing", False):
            inner = [
                type(m).__name__ for m in module.modules() if m is not module and id(m) in units
            ]
            if inner:
                raise ValueError(
                    f"gradient checkpointing: {type(module).__name__} recomputes its forward in "
                    f"backward but encloses sharded units ({sorted(set(inner))}). Wrap by the "
                    f"layer class (auto_wrap={type(module).__name__}), or use "
                    "ShardedModule(..., checkpoint_activations=True) instead."
                )
        module._gradient_checkpointing_func = _guarded(root, owners[id(module)], checkpoint)


def checkpoint_hf_layer(root: Root, unit: Unit) -> bool:
    """Checkpoint ``unit`` the way its ``transformers`` layer checkpoints itself, if it is one.

    Hugging Face's layers drop their key-value cache arguments when they checkpoint (the
    recomputation would update the cache a second time); going through the layer's own path
    keeps that, guarded as :func:`guard_hf_checkpointing` guards it.

    Returns:
        Whether ``unit`` is such a layer (and is now checkpointed).
    """
    module = unit.module
    if not _is_checkpointing_layer(module):
        return False
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)
    module._gradient_checkpointing_func = _guarded(root, unit, checkpoint)
    module.gradient_checkpointing = True
    return True


def any_rank_decoding(root: Root, this_peer_finished: bool) -> bool:
    """Whether any rank of the model still decodes: one small all-reduce over the model's own
    ranks (not the default group, which may hold other models' ranks)."""
    mesh = root.mesh
    unfinished = torch.tensor([0.0 if this_peer_finished else 1.0], device=mesh.control_device)
    all_reduce(unfinished, mesh.control, dist.ReduceOp.SUM, root.stats).wait()
    return unfinished.item() > 0


def synced_decoding(root: Root, synced_gpus: bool | None) -> bool | None:
    """``generate``'s ``synced_gpus`` on a sharded model: true on more than one rank.

    Raises:
        ValueError: ``synced_gpus=False`` on more than one rank: a rank that stopped early
            would leave the others waiting in the next gather for good.
    """
    if root.mesh.world_size == 1:
        return synced_gpus
    if synced_gpus is False:
        raise ValueError(
            "generate(synced_gpus=False) on a sharded model: every decoding step "
            "gathers parameters, so all ranks must take the same number of steps. "
            "Leave synced_gpus unset (it defaults to True on a sharded model)."
        )
    return True


class HuggingFaceHabits:
    """Methods of a wrapped ``transformers`` model that differ from the unwrapped model's."""

    _shardwrap_root: Root
    # transformers' mark for a model whose ranks must run forwards in step: generate() and
    # Seq2SeqTrainer default to synced decoding, and LayerDrop skips no layer on one rank only.
    _is_fsdp_managed_module = True

    def save_pretrained(
        self,
        save_directory: str | Path,
        is_main_process: bool = True,
        state_dict: dict[str, Any] | None = None,
        max_shard_size: int | str = "50GB",
        **kwargs: Any,
    ) -> None:
        """Write the whole model as ``from_pretrained`` reads it. Call on every rank.

        1. Without ``state_dict``: as :func:`shardwrap.export` (rank 0 writes, one unit in
           memory at a time; the files already in the folder, a tokenizer's say, stay, but
           for stale weight files of a previous save). ``is_main_process`` is ignored:
           every rank takes part in gathering; ``save_function`` too, as transformers
           ignores it (``save_function=accelerator.save``).
        2. With ``state_dict=model.full_state_dict(rank0_only=True)``: the model class's own
           ``save_pretrained``, with every option it has (called where that dict is full).

        Raises:
            ValueError: an option export does not offer (naming case 2), a ``state_dict``
                holding shards (naming ``full_state_dict``), or (case 1) a folder holding a
                shardwrap checkpoint, checkpoints or a Logbook's run.
            OSError: (case 1) a full disk, naming the bytes needed and free.
        """
        refuse_stock_trainer()
        if state_dict is not None:
            self._check_full(state_dict)
            return super().save_pretrained(  # type: ignore[misc]
                save_directory,
                is_main_process=is_main_process,
                state_dict=state_dict,
                max_shard_size=max_shard_size,
                **kwargs,
            )
        unknown = [k for k in kwargs if k not in _SAVE_DEFAULTS and k not in _UNUSED_OPTIONS]
        used = [k for k, v in kwargs.items() if k in _SAVE_DEFAULTS and v != _SAVE_DEFAULTS[k]]
        if unknown or used:
            raise ValueError(
                f"save_pretrained on a sharded model writes what shardwrap.export writes, "
                f"without {sorted(unknown + used)}. For every save_pretrained option, pass "
                "state_dict=model.full_state_dict(rank0_only=True) (on every rank; rank 0 "
                "writes)."
            )
        write_export(save_directory, self, max_shard_size, "save_pretrained")  # type: ignore[arg-type]

    def _check_full(self, state_dict: dict[str, Any]) -> None:
        own = nn.Module.state_dict(self, keep_vars=True)  # type: ignore[arg-type]
        index = self._shardwrap_root.param_of
        shards = [
            k
            for k, v in state_dict.items()
            if id(own.get(k)) in index and tuple(v.shape) != index[id(own[k])].shape
        ]
        if shards:
            raise ValueError(
                f"save_pretrained(state_dict=...): {shards[:3]} are not full-size (the sharded "
                "model's state_dict() holds this rank's shards). Pass "
                "state_dict=model.full_state_dict(rank0_only=True), or no state_dict."
            )

    def generate(self, *args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        """``generate`` with its units gathered once for the whole call where memory allows
        (``keep_gathered()``); then each rank decodes on its own, with no collective per
        token (``engine/step/inference.py``: ``decoding_alone``). Where the units are not kept
        gathered, every rank decodes until all are done (``synced_gpus=True``).

        Raises:
            ValueError: ``synced_gpus=False`` on more than one rank: a rank that stopped
                early would leave the others waiting in the next gather for good.
        """
        root = self._shardwrap_root
        synced = synced_decoding(root, synced_gpus)
        with self.keep_gathered(), decoding_alone(root) as alone:  # type: ignore[attr-defined]
            synced = False if alone and synced_gpus is None else synced
            return super().generate(*args, synced_gpus=synced, **kwargs)  # type: ignore[misc]

    def _has_unfinished_sequences(
        self, this_peer_finished: bool, synced_gpus: bool, device: torch.device
    ) -> bool:
        """Whether any rank of the model still decodes (see :func:`any_rank_decoding`)."""
        if not synced_gpus:
            return super()._has_unfinished_sequences(  # type: ignore[misc]
                this_peer_finished, synced_gpus, device
            )
        return any_rank_decoding(self._shardwrap_root, this_peer_finished)

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> Any:
        """Refused on a sharded model: it would read this rank's piece of the embedding as the
        whole table and swap the piece's storage, breaking the flat shard without a word.

        Raises:
            ValueError: naming the order that works (resize, then wrap).
        """
        raise ValueError(
            "resize_token_embeddings on a sharded model: a resize changes the flat layout every "
            "rank shares. Resize the unwrapped model, then wrap it: "
            "model.resize_token_embeddings(n); model = ShardedModule(model, ...)."
        )

    def _set_gradient_checkpointing(self, *args: Any, **kwargs: Any) -> Any:
        """Hugging Face's switch for its activation checkpointing, then the guards."""
        result = super()._set_gradient_checkpointing(*args, **kwargs)  # type: ignore[misc]
        guard_hf_checkpointing(self._shardwrap_root, self)  # type: ignore[arg-type]
        return result


extensions.register_class_habits(_habits)
extensions.register_unit_checkpointer(checkpoint_hf_layer)
extensions.register_move_check(_refuse_stock_trainer_moving)
