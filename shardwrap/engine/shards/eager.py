"""The sharding hooks run eagerly, outside any graph ``torch.compile`` captures.

Design note. ``torch.compile(model)`` of a wrapped model traces ``nn.Module.__call__``, hooks
included, and dynamo cannot trace a hook that gathers (a process group is opaque to it: the
compile failed with an internal dynamo error naming ``ProcessGroup.allreduce``). Every forward
hook shardwrap registers is therefore marked for dynamo to skip: the graph breaks at each hook,
the hook runs eagerly, and the code between hooks is compiled, in parity with the plain model.
So is every hook backward runs (a tensor's and a gradient's hooks, the flat group's backward,
the saved-tensor hooks, the end-of-backward callback): a compiled training step calls
``loss.backward()`` from its compiled frame, and dynamo would trace them from there.
Hooks of modules inside a unit break the graph at every module, so ``compile=True``, which
compiles each unit's ``forward`` whole with its inner modules' hooks removed
(``engine/step/recompute.py``), gives the larger graphs.

The forward hooks' own work (gathering, releasing, the pool's bookkeeping) also runs outside
any ``torch.func`` transform (``untransformed``), as FSDP2's does: inside ``jvp`` or
``jacfwd`` every tensor made is a transform's wrapper, without storage, so a gathered buffer
could neither be recorded by address nor exchanged, and one made there would be kept in the
pool after the transform ended. The full parameters are then plain tensors, which the
transform takes as constants, as it takes the plain model's parameters. The module's inputs
and outputs stay the transform's (what the hooks cast or return is not done untransformed).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import Any, TypeVar

import torch

__all__ = ["eager", "untransformed"]

F = TypeVar("F", bound=Callable[..., object])


def eager(hook: F) -> F:
    """``hook``, skipped by dynamo (and everything it calls). NOTE: torch's lazy form, which
    imports dynamo at the first call rather than at wrapping; 0.5 us a call on this CPU."""
    return torch._disable_dynamo(hook, recursive=True)  # type: ignore[return-value]


def untransformed(fn: F) -> F:
    """``fn``, run outside the ``torch.func`` transforms active when it is called (if any)."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
