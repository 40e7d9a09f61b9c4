"""An optimizer over shard parameters is adopted before its first state dict, stepped or not.

Design note. shardwrap adopts an optimizer (``pieces.adopt_optimizer``: its ``state_dict()``
marks this rank's pieces, its ``load_state_dict()`` cuts whole state to them) where it first
sees it: its first step, or a save or load through shardwrap. An optimizer whose constructor
makes its state (Adagrad's ``sum``), saved before any step through
``torch.distributed.checkpoint``'s ``get_optimizer_state_dict`` (which steps an optimizer
only when it has no state) or ``optimizer.state_dict()``, would hand out plain tensors of this
rank's pieces' shapes, written as if whole. So torch's ``Optimizer.state_dict`` and
``load_state_dict`` are wrapped, once in the process, to adopt an optimizer that holds shard
parameters before they run (one look at its parameters per call until it is adopted; an
optimizer over none costs one dictionary lookup after its first call).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer

__all__ = ["adopt_before_state_dicts"]

_patched = False


def adopt_before_state_dicts(adopt: Callable[[Optimizer], Any]) -> None:
    """Wrap ``Optimizer.state_dict`` and ``load_state_dict`` to call ``adopt(optimizer)``
    first (it classifies and adopts an optimizer over shard parameters, once)."""
    global _patched
    if _patched:
        return
    _patched = True
    for name in ("state_dict", "load_state_dict"):
        original = getattr(Optimizer, name)

        def adopting(self: Optimizer, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
            adopt(self)
            return _original(self, *args, **kwargs)

        setattr(Optimizer, name, functools.wraps(original)(adopting))
