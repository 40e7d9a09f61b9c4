"""What users of ``peft`` call on a sharded PEFT model (LoRA and the other adapter methods).

The order of wrapping is ``get_peft_model(model, config)`` first, then
``ShardedModule(peft_model, auto_wrap=...)``: adapters and the frozen base weights then sit in
separate flat groups of each unit (groups are keyed by dtype and ``requires_grad``), so only the
adapters get gradients and optimizer state. The reverse order would graft unsharded adapters
into a sharded model, whose gradients no rank would average; it is refused.

A wrapped ``PeftModel``'s class gains :class:`PeftHabits` ahead of its own:

- ``get_nb_trainable_parameters()`` (and so ``print_trainable_parameters()``) counts whole
  parameters, not this rank's pieces.

The engine does not import this module (nor ``peft``): ``shardwrap/__init__.py`` imports it,
and it registers the habits with the engine (``engine/extensions.py``).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..engine import extensions
from ..engine.root import Root

__all__ = ["PeftHabits", "is_peft_model"]


def is_peft_model(cls: type) -> bool:
    """Whether ``cls`` is a ``peft`` ``PeftModel`` (without importing ``peft``)."""
    return any(c.__name__ == "PeftModel" and c.__module__ == "peft.peft_model" for c in cls.__mro__)


def _habits(cls: type) -> tuple[type, ...]:
    return (PeftHabits,) if is_peft_model(cls) else (RefusesAdapters,)


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

    def get_nb_trainable_parameters(self) -> tuple[int, int]:
        """Trainable and all parameters, counted whole (not this rank's pieces)."""
        index = self._shardwrap_root.param_of
        trainable = total = 0
        for p in nn.Module.parameters(self):  # type: ignore[arg-type]
            n = math.prod(index[id(p)].shape) if id(p) in index else p.numel()
            total += n
            trainable += n if p.requires_grad else 0
        return trainable, total


extensions.register_class_habits(_habits)
