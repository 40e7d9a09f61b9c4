"""State an optimizer over shard parameters held before shardwrap saw it, checked before its
next step.

Design note. An optimizer that steps each rank's pieces keeps per-parameter state shaped like
this rank's piece (Adam's moments, SGD's momentum). State of other shapes (another world size's
pieces), which torch's ``load_state_dict`` takes as it is, would make the next step fail
half-way through the update ("The size of tensor a (36) must match the size of tensor b
(2412)"). shardwrap first sees an optimizer when it steps (or when a checkpoint saves or loads
it, see ``whole_params.py``): from then on each ``load_state_dict`` cuts a full state to this
rank's pieces and refuses other shapes (``pieces.py``), and the state the optimizer already
holds (loaded before that, and left as it was where it was neither full nor a piece) is
checked here before its next step (a ``load_checkpoint`` may still replace it), naming the
state and the fix. Optimizers that step whole parameters keep state shaped like the whole
parameter on its owner: not checked here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["check_held_state", "watch"]

NameOf = Callable[[nn.Parameter], str | None]  # a shard parameter's name; None: not one
# optimizers watched whose state, held from before, is checked at their next step
_UNCHECKED: weakref.WeakKeyDictionary[Optimizer, NameOf] = weakref.WeakKeyDictionary()


def watch(optimizer: Optimizer, name_of: NameOf) -> None:
    """Check the state ``optimizer`` (stepping pieces) holds now at its next step (see
    :func:`check_held_state`). ``name_of`` tells shard parameters (by their names) from any
    other."""
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
    _check(optimizer, name_of, ((p, optimizer.state.get(p, {})) for p in params))
    del _UNCHECKED[optimizer]


def _check(
    optimizer: Optimizer,
    name_of: NameOf,
    entries: Iterable[tuple[nn.Parameter, dict[str, Any]]],
) -> None:
    for p, entry in entries:
        name = name_of(p)
        if name is None:
            continue
        for key, value in entry.items():
            if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                raise ValueError(_message(optimizer, name, p, key, value))


def _message(optimizer: Optimizer, name: str, p: nn.Parameter, key: str, value: Tensor) -> str:
    cls = type(optimizer).__name__
    return (
        f"{cls} holds state '{key}' of '{name}' of shape {tuple(value.shape)}, where this rank "
        f"steps its piece of shape {tuple(p.shape)}: a state_dict of another world size's "
        "optimizer is not this rank's. Nothing was changed. "
        "Save and load with shardwrap.save_checkpoint / load_checkpoint, which reshard "
        f"optimizer state; or load it into the unwrapped model's {cls} and train that"
    )
