"""Recomputing a unit's activations in backward, and compiling a unit's ``forward``.

Both wrap a unit's ``forward`` inside the sharding hooks, so the hooks stay outside every
checkpointed piece and every compiled graph.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
import torch.utils.checkpoint
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)

from ..shards.unit import Unit
from .own_calls import OwnCalls

__all__ = [
    "Regathers",
    "apart_from_replay",
    "compile_unit",
    "guard_recompute",
    "recompute_activations",
]

# The dispatch modes of a selective checkpoint: recording its region's ops, and replaying them.
_SELECTIVE_CHECKPOINT_MODES = (
    torch.utils.checkpoint._CachingTorchDispatchMode,
    torch.utils.checkpoint._CachedTorchDispatchMode,
)


class Regathers(Protocol):
    """What a recomputation asks of the root that drives the units (``step/root.py``)."""

    @property
    def in_backward(self) -> bool: ...

    def gather_for_recompute(self, unit: Unit, grad: bool) -> None: ...


def recompute_activations(root: Regathers, unit: Unit) -> None:
    """Recompute ``unit``'s activations in backward rather than keep them (non-reentrant).

    The checkpoint encloses the module's ``forward``, inside the sharding hooks. By the time
    backward recomputes it, the unit's outputs have had their gradients, so pre-backward has
    gathered the unit: the recomputation reuses that gather.
    """
    forward = unit.module.forward
    recompute_or_run = guard_recompute(root, unit, forward)

    @functools.wraps(forward)
    def checkpointed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        # The checkpoint saves its tensor arguments, and under saved-tensor hooks (shardwrap's,
        # around every forward) gives each back as a tensor of its own: one tensor passed
        # twice (attention's query, key and value) would be recomputed as different ones, on
        # another path (MultiheadAttention's packed projection). So each goes in once.
        distinct = {id(a): a for a in args if isinstance(a, torch.Tensor)}  # in first use order
        place = {key: i for i, key in enumerate(distinct)}
        tensors = list(distinct.values())
        places = [place[id(a)] if isinstance(a, torch.Tensor) else None for a in args]
        others = [None if isinstance(a, torch.Tensor) else a for a in args]  # no tensor held

        def run(*given: torch.Tensor) -> Any:
            again = [a if i is None else given[i] for a, i in zip(others, places)]
            return recompute_or_run(*again, **kwargs)

        return torch.utils.checkpoint.checkpoint(run, *tensors, use_reentrant=False)

    unit.module.forward = checkpointed


def guard_recompute(
    root: Regathers, unit: Unit, function: Callable[..., Any]
) -> Callable[..., Any]:
    """``function``, a checkpointed piece of ``unit``'s forward, made safe to recompute.

    Backward recomputes it after pre-backward gathered the unit, but with the module's
    attributes back on the shards: the guard shows it the full parameters first, reusing
    that gather.
    """

    def recompute_or_run(*args: Any, **kwargs: Any) -> Any:
        if root.in_backward:
            root.gather_for_recompute(unit, grad=True)
        return function(*args, **kwargs)

    return recompute_or_run


@contextmanager
def apart_from_replay() -> Iterator[None]:
    """Step out of a selective checkpoint's replay while a unit's full parameters are shown to
    a recomputation.

    Selective activation checkpointing replays in backward exactly the ops its region ran in
    forward, and refuses any other: the gather and the views are sharding work, which forward
    did outside the region where a part of a unit is checkpointed. Only the checkpoint's modes
    on top of the dispatch stack are stepped out of; a mode beneath them (an allocation
    tracker) still sees the gather.
    """
    popped: list[TorchDispatchMode] = []
    try:
        while isinstance(_get_current_dispatch_mode(), _SELECTIVE_CHECKPOINT_MODES):
            popped.append(_pop_mode())
        yield
    finally:
        for mode in reversed(popped):
            _push_mode(mode)


def compile_unit(own_calls: OwnCalls, unit: Unit, options: dict[str, Any]) -> None:
    """Compile ``unit``'s ``forward`` with ``torch.compile(**options)``; hooks stay outside.

    The modules inside lose their own-call hooks, which would break the graph at every
    module: within a compiled unit only the unit as a whole may be called.
    """
    own_calls.unhook(unit.module)
    unit.module.forward = torch.compile(unit.module.forward, **options)
