"""State given to an optimizer over shard parameters, checked before the optimizer takes it.

Design note. An optimizer that steps each rank's pieces keeps per-parameter state shaped like
this rank's piece (Adam's moments, SGD's momentum). The ``state_dict`` of an unwrapped model's
optimizer, or of one at another world size, holds other shapes, which torch's
``load_state_dict`` takes as they are: the next step then fails half-way through the update
("The size of tensor a (36) must match the size of tensor b (2412)"). shardwrap first sees an
optimizer when it steps (or when a checkpoint saves or loads it, see ``whole_params.py``):
from then on every ``load_state_dict`` is checked before it changes anything, and the state the
optimizer already holds (loaded before that) is checked before its next step (a
``load_checkpoint`` may still replace it), naming the state and the fix. Optimizers that step
whole parameters keep state shaped like the whole parameter on its owner: not checked here.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["check_held_state", "watch"]

NameOf = Callable[[nn.Parameter], str | None]  # a shard parameter's name; None: not one
# optimizers watched whose state, held from before, is checked at their next step
_UNCHECKED: weakref.WeakKeyDictionary[Optimizer, NameOf] = weakref.WeakKeyDictionary()


def watch(optimizer: Optimizer, name_of: NameOf) -> None:
    """Check every state ``optimizer`` (stepping pieces) is given by ``load_state_dict`` from
    now on, before it takes it, and the state it holds now at its next step (see
    :func:`check_held_state`). ``name_of`` tells shard parameters (by their names) from any
    other."""
    optimizer.register_load_state_dict_pre_hook(functools.partial(_before_load, name_of=name_of))
    _UNCHECKED[optimizer] = name_of


def check_held_state(optimizer: Optimizer) -> None:
    """Before a step of a watched optimizer: check, until it passes once, the state it held
    when it was first watched.

    Raises:
        ValueError: state of another shape than this rank's piece, naming it and the fix.
    """
    name_of = _UNCHECKED.get(optimizer)
    if name_of is None:
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    _check(optimizer, name_of, ((p, optimizer.state.get(p, {})) for p in params), "holds")
    del _UNCHECKED[optimizer]


def _before_load(optimizer: Optimizer, state_dict: dict[str, Any], name_of: NameOf) -> None:
    """``load_state_dict``'s pre-hook: each saved entry goes to the parameter at the same place
    in the groups, as torch maps them."""
    saved = chain.from_iterable(g["params"] for g in state_dict.get("param_groups", ()))
    mine = chain.from_iterable(g["params"] for g in optimizer.param_groups)
    state = state_dict.get("state", {})
    entries = ((p, state.get(i, {})) for i, p in zip(saved, mine))
    _check(optimizer, name_of, entries, "is given")


def _check(
    optimizer: Optimizer,
    name_of: NameOf,
    entries: Iterable[tuple[nn.Parameter, dict[str, Any]]],
    verb: str,
) -> None:
    for p, entry in entries:
        name = name_of(p)
        if name is None:
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(_message(optimizer, name, p, key, value, verb))


def _message(
    optimizer: Optimizer, name: str, p: nn.Parameter, key: str, value: Tensor, verb: str
) -> str:
    cls = type(optimizer).__name__
    return (
        f"{cls} {verb} state '{key}' of '{name}' of shape {tuple(value.shape)}, where this rank "
        f"steps its piece of shape {tuple(p.shape)}: a state_dict of the unwrapped model's "
        "optimizer (or of another world size) is not a sharded one's. Nothing was changed. "
        "Save and load with shardwrap.save_checkpoint / load_checkpoint, which reshard "
        f"optimizer state; or load it into the unwrapped model's {cls} and train that"
    )
