"""What users of ``peft`` call on a sharded PEFT model (LoRA and the other adapter methods).

The order of wrapping is ``get_peft_model(model, config)`` first, then
``ShardedModule(peft_model, auto_wrap=...)``: adapters and the frozen base weights then sit in
separate flat groups of each unit (groups are keyed by dtype and ``requires_grad``), so only the
adapters get gradients and optimizer state. The reverse order would graft unsharded adapters
into a sharded model, whose gradients no rank would average; it is refused.

Several adapters: every adapter must be added before wrapping. All adapters' parameters are
sharded with the trainable ones (:func:`adapter_names`), so ``set_adapter(name)`` on the sharded
model switches the adapter that trains as well as the one that runs; a parameter frozen at the
moment (an inactive adapter) gets no gradient (``FlatGroup.accumulate``).

A wrapped ``PeftModel``'s class gains :class:`PeftHabits` ahead of its own:

- ``save_pretrained(dir)`` gathers only what the adapter file holds (rank 0 writes), so
  ``PeftModel.from_pretrained(base, dir)`` loads it;
- ``merge_and_unload()`` returns the whole base model with the adapters merged, unsharded;
- ``generate()`` keeps every rank decoding until all are done, as on a sharded
  ``transformers`` model (``integrations/hf.py``);
- ``get_nb_trainable_parameters()`` (and so ``print_trainable_parameters()``) counts whole
  parameters, not this rank's pieces;
- ``add_adapter``, ``load_adapter`` of a new adapter and ``delete_adapter`` are refused (the
  adapters are sharded when the model is wrapped; ``load_adapter`` into an adapter the model
  has loads its weights, each rank cutting its pieces), and so are ``merge_adapter`` and
  ``unmerge_adapter`` (they write the adapters' product into the base weights in place, which
  are pieces here).

The engine does not import this module (nor ``peft``): ``shardwrap/__init__.py`` imports it,
and it registers the habits with the engine (``engine/wrap/extensions.py``).
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.step.inference import decoding_alone
from ..engine.step.root import Root
from ..engine.wrap import extensions
from ..engine.wrap.sharded_module import ShardedModule
from .hf import any_rank_decoding, is_transformers_model, synced_decoding

__all__ = ["PeftHabits", "adapter_names", "is_peft_model"]


def is_peft_model(cls: type) -> bool:
    """Whether ``cls`` is a ``peft`` ``PeftModel`` (without importing ``peft``)."""
    return any(c.__name__ == "PeftModel" and c.__module__ == "peft.peft_model" for c in cls.__mro__)


def _habits(cls: type) -> tuple[type, ...]:
    return (PeftHabits,) if is_peft_model(cls) else (RefusesAdapters,)


def adapter_names(model: nn.Module) -> set[str]:
    """The parameters of every adapter of a PEFT model, by name: ``set_adapter`` makes the
    adapter it activates trainable and freezes the others, so each may train after wrapping
    (the adapters' own layers, and the copies of ``modules_to_save``)."""
    if not is_peft_model(type(model)):
        return set()
    names = set()
    for prefix, module in model.named_modules():
        kinds = getattr(type(module), "adapter_layer_names", ())  # peft's tuner layers
        if type(module).__name__ == "ModulesToSaveWrapper":
            kinds = ("modules_to_save",)
        for kind in kinds:
            part = getattr(module, kind, None)
            if isinstance(part, nn.Module):
                names.update(f"{prefix}.{kind}.{n}" for n, _ in part.named_parameters())
    return names


def _full_params(root: Root, wanted: set[int]) -> dict[int, Tensor]:
    """The whole value (CPU) of each shard parameter in ``wanted``, on rank 0 (others: empty).

    Gathers only the flat groups that hold one of them, one at a time. Every rank calls it
    with the same ``wanted`` (the same parameters, by name).
    """
    root.settle()
    root.check_state()
    root.schedule.enter("save_pretrained")
    keep = root.mesh.rank == 0
    full: dict[int, Tensor] = {}
    for unit in root.units:
        for g in unit.groups:
            if not any(id(p) in wanted for p in g.shard_params):
                continue
            with unit.readable(g) as views:
                if keep:
                    for p, view in zip(g.shard_params, views):
                        if id(p) in wanted:
                            full[id(p)] = view.to("cpu", copy=True)
    return full


def _original_class(cls: type) -> type:
    """The ``peft`` class a sharded model's class was made from."""
    return next(c for c in cls.__mro__ if is_peft_model(c) and not issubclass(c, ShardedModule))


class RefusesAdapters:
    """Refuses adapters grafted into a model that is already sharded.

    ``peft`` (``get_peft_model``, ``inject_adapter_in_model``, ``transformers``'
    ``add_adapter``) records its configuration on the model it changed as it finishes.
    """

    @property
    def peft_config(self) -> Any:
        raise AttributeError("peft_config")

    @peft_config.setter
    def peft_config(self, value: Any) -> None:
        raise TypeError(
            "peft added adapters to a model that is already sharded: their parameters are "
            "not sharded, and no rank would average their gradients. Build the PEFT model "
            "first and shard it: ShardedModule(get_peft_model(model, config), auto_wrap=...) "
            "(this model now holds the unsharded adapters: build it again)."
        )


class PeftHabits:
    """Methods of a wrapped ``PeftModel`` that differ from the unwrapped model's."""

    _shardwrap_root: Root

    def save_pretrained(
        self, save_directory: str | Path, is_main_process: bool = True, **kwargs: Any
    ) -> None:
        """Write the adapters as ``PeftModel.from_pretrained`` reads them. Call on every rank.

        Gathers only the parameters the adapter file holds (the adapters, and any
        ``modules_to_save``), one flat group at a time; rank 0 writes. Every other option is
        ``PeftModel.save_pretrained``'s. A ``state_dict`` passed in is written as it is (it
        must hold whole tensors: ``full_state_dict(rank0_only=True)``).
        """
        root = self._shardwrap_root
        if "state_dict" in kwargs:
            return super().save_pretrained(  # type: ignore[misc]
                save_directory, is_main_process=is_main_process, **kwargs
            )
        from peft.utils import get_peft_model_state_dict

        own = nn.Module.state_dict(self, keep_vars=True)  # type: ignore[arg-type]
        names = kwargs.get("selected_adapters") or list(self.peft_config)  # type: ignore[attr-defined]
        wanted = {
            id(v)
            for name in names
            for v in get_peft_model_state_dict(self, state_dict=own, adapter_name=name).values()
            if id(v) in root.param_of
        }
        full = _full_params(root, wanted)
        rank0 = root.mesh.rank == 0
        state = {
            k: full[id(v)] if id(v) in full else v.detach().to("cpu", copy=True)
            for k, v in own.items()
            if id(v) in wanted or id(v) not in root.param_of
        }
        return super().save_pretrained(  # type: ignore[misc]
            save_directory, is_main_process=is_main_process and rank0, state_dict=state, **kwargs
        )

    def add_adapter(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see :meth:`_refuse_new_adapters`."""
        self._refuse_new_adapters("add_adapter")

    def load_adapter(self, model_id: Any, adapter_name: str, *args: Any, **kwargs: Any) -> Any:
        """Loads saved weights into an adapter the model already has (the Trainer's
        ``load_best_model_at_end`` and resume of an adapter-only checkpoint), each rank cutting
        its pieces; a new adapter is refused: see :meth:`_refuse_new_adapters`."""
        if adapter_name not in self.peft_config:
            self._refuse_new_adapters("load_adapter of a new adapter")
        return super().load_adapter(model_id, adapter_name, *args, **kwargs)  # type: ignore[misc]

    def delete_adapter(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see :meth:`_refuse_new_adapters`."""
        self._refuse_new_adapters("delete_adapter")

    def merge_adapter(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see :meth:`_refuse_merging_in_place`."""
        self._refuse_merging_in_place("merge_adapter")

    def unmerge_adapter(self, *args: Any, **kwargs: Any) -> None:
        """Refused: see :meth:`_refuse_merging_in_place`."""
        self._refuse_merging_in_place("unmerge_adapter")

    def _refuse_merging_in_place(self, method: str) -> None:
        """Merging in place adds each adapter's product ``B @ A`` into its base weight: on a
        sharded model ``A``, ``B`` and the weight are this rank's pieces (torch failed on
        their shapes).

        Raises:
            TypeError: naming what to call instead.
        """
        raise TypeError(
            f"{method} on a sharded PEFT model: it merges the adapters into the base weights in "
            "place, and here the adapters and the weights are this rank's pieces. Nothing was "
            "changed. Call merge_and_unload() on every rank (the base model, whole and "
            "unsharded, with the adapters merged), or run without the adapters inside "
            "`with model.disable_adapter():`."
        )

    def _refuse_new_adapters(self, method: str) -> None:
        """Adapters added to (or removed from) a sharded model would not be sharded (or would
        leave their pieces in the flat groups).

        Raises:
            TypeError: naming the order that works.
        """
        raise TypeError(
            f"{method} on a sharded PEFT model: adapters are sharded when the model is "
            "wrapped, so the set of adapters is fixed then. Add or load every adapter first "
            "(get_peft_model(model, config, adapter_name=...), then add_adapter or "
            "load_adapter for the others), then wrap with ShardedModule; set_adapter(name) "
            "on the sharded model switches the active (and trained) one."
        )

    def merge_and_unload(self, *args: Any, **kwargs: Any) -> nn.Module:
        """The base model with the adapters merged in: whole, unsharded, on the CPU, on every
        rank. Call on every rank.

        The sharded model stays as it was, adapters apart and training-ready: merging into
        the shards would leave a sharded model whose adapter groups no module holds. The
        result is the unwrapped PEFT model, built on the CPU and given :meth:`full_state_dict`,
        whose own ``merge_and_unload(*args, **kwargs)`` then merges: CPU memory of the whole
        model per rank.
        ``merged.save_pretrained(dir)`` on rank 0 writes it.

        Raises:
            TypeError: a base model that is not a ``transformers`` model (it cannot be built
                again from its configuration); naming what to do instead.
        """
        base = self.get_base_model()  # type: ignore[attr-defined]
        if not is_transformers_model(type(base)):
            raise TypeError(
                f"merge_and_unload on a sharded model rebuilds the base model from its "
                f"configuration, which {type(base).__name__} (not a transformers model) has "
                "not. Save the adapters (model.save_pretrained(dir), every rank), load them "
                "onto the unwrapped base model and merge there."
            )
        full = self.full_state_dict()  # type: ignore[attr-defined]
        configs = self.peft_config  # type: ignore[attr-defined]
        first, *others = list(configs)
        # Built for real on the CPU (its initial weights replaced below): a model built on the
        # meta device would leave the tensors it computes at init, rotary tables say, unbuilt.
        plain = _original_class(type(self))(
            type(base)(copy.deepcopy(base.config)), copy.deepcopy(configs[first]), first
        )
        for name in others:
            plain.add_adapter(name, copy.deepcopy(configs[name]))
        plain.load_state_dict(full, strict=True, assign=True)
        plain.get_base_model().tie_weights()
        plain.set_adapter(self.active_adapter)  # type: ignore[attr-defined]
        return plain.merge_and_unload(*args, **kwargs)

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """Trainable and all parameters, counted whole (not this rank's pieces)."""
        index = self._shardwrap_root.param_of
        trainable = total = 0
        for p in nn.Module.parameters(self):  # type: ignore[arg-type]
            n = math.prod(index[id(p)].shape) if id(p) in index else p.numel()
            total += n
            trainable += n if p.requires_grad else 0
        return trainable, total

    def generate(self, *args: Any, synced_gpus: bool | None = None, **kwargs: Any) -> Any:
        """``generate`` as a sharded ``transformers`` model's: its units gathered once for the
        whole call where memory allows, each rank then decoding on its own; otherwise every
        rank decoding until all are done.

        The ``transformers`` model inside decodes: its check of whether any rank still
        decodes asks this model's ranks.

        Raises:
            ValueError: ``synced_gpus=False`` on more than one rank (see ``HuggingFaceHabits``).
        """
        root = self._shardwrap_root
        synced = synced_decoding(root, synced_gpus)
        base = self.get_base_model()  # type: ignore[attr-defined]
        own = getattr(super(), "generate", None) or base.generate

        def unfinished(this_peer_finished: bool, synced: bool, device: torch.device) -> bool:
            if not synced:
                return type(base)._has_unfinished_sequences(
                    base, this_peer_finished, synced, device
                )
            return any_rank_decoding(root, this_peer_finished)

        base._has_unfinished_sequences = unfinished
        try:
            with self.keep_gathered(), decoding_alone(root) as alone:  # type: ignore[attr-defined]
                synced = False if alone and synced_gpus is None else synced
                return own(*args, synced_gpus=synced, **kwargs)
        finally:
            del base._has_unfinished_sequences


extensions.register_class_habits(_habits)
extensions.register_may_train(adapter_names)
