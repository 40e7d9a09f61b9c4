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
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

__all__ = ["eager"]

F = TypeVar("F", bound=Callable[..., object])


def eager(hook: F) -> F:
    """``hook``, skipped by dynamo (and everything it calls). NOTE: torch's lazy form, which
    imports dynamo at the first call rather than at wrapping; 0.5 us a call on this CPU."""
    return torch._disable_dynamo(hook, recursive=True)  # type: ignore[return-value]
