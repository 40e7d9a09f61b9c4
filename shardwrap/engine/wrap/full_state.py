"""The unwrapped model's state dict, taken from a sharded one (``full_state_dict()``).

Design note. Each flat group is gathered in turn and its full parameters copied to the CPU;
then the model's own ``state_dict()`` is taken with each shard parameter's full copy registered
in its place, so the modules' state-dict hooks and ``_save_to_state_dict`` overrides see (and
may replace: a cast, a scale, renamed keys) the full values, as on the unwrapped model. Taking
the keys and looking the full tensors up afterwards would hand such a hook this rank's piece,
and what it made of it would be saved as the whole tensor.
"""

from __future__ import annotations

import threading
from typing import Any

from torch import Tensor, nn

__all__ = ["full_state", "taking_full_state"]

_taking = threading.local()


def taking_full_state() -> bool:
    """Whether this thread is taking a full state dict (the root's own state-dict hook, which
    marks pieces, leaves it alone)."""
    return getattr(_taking, "on", False)


def full_state(model: nn.Module, root: Any, rank0_only: bool) -> dict[str, Any]:
    """``model.full_state_dict(rank0_only)``: see :meth:`ShardedModule.full_state_dict`."""
    keep = not rank0_only or root.mesh.rank == 0
    full: dict[int, Tensor] = {}
    for unit in root.units:
        for g in unit.groups:
            with unit.readable(g) as views:
                if keep:
                    for p, view in zip(g.shard_params, views):
                        full[id(p)] = view.to("cpu", copy=True)
    if not keep:
        return {}
    swapped = []
    _taking.on = True
    try:
        for unit in root.units:
            for g in unit.groups:
                for p, slots in zip(g.shard_params, g.slots):
                    for module, attr in slots:
                        if module._parameters.get(attr) is p:
                            module._parameters[attr] = full[id(p)]
                            swapped.append((module, attr, p))
        state = nn.Module.state_dict(model)
    finally:
        _taking.on = False
        for module, attr, p in swapped:
            module._parameters[attr] = p
    made = {t.untyped_storage().data_ptr() for t in full.values() if t.numel()}
    return {  # buffers, and anything else the model's own memory holds, copied to the CPU
        k: v.to("cpu", copy=True)
        if isinstance(v, Tensor) and v.untyped_storage().data_ptr() not in made
        else v  # a full copy, or a module's get_extra_state() as state_dict() gives it
        for k, v in state.items()
    }
