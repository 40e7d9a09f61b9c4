"""Every registered op's Python object made before a dispatch mode of the planner is entered.

Design note. A dispatch mode receives each op as its Python object (``torch.ops.<ns>.<op>.
<overload>``), which torch makes the first time the op reaches any mode and then caches without
holding a reference of its own. Two threads whose modes meet an op for the first time at once
each make one; the second replaces the first as the attribute that keeps it alive, and the cache
may keep the one that was freed: every later pass of that op through a mode then reads freed
memory (a crash, or an op that is not the one it names). Ranks run as threads, each tracking
its own allocations (the test tier, ``benchmarks/estimate.py``), do exactly that with their first
collective. :func:`resolve_python_ops`, called as each mode is entered, makes every registered
op's object first, one thread at a time, so that no thread's mode makes one.
"""

from __future__ import annotations

import threading

import torch

__all__ = ["resolve_python_ops"]

_LOCK = threading.Lock()
_RESOLVED: set[str] = set()


def resolve_python_ops() -> None:
    """Make the Python object of each registered op overload not made by an earlier call (all
    of them the first time, about 0.1 s; a few milliseconds after). Threads calling it at once
    wait for the one making them."""
    with _LOCK:
        for name in set(torch._C._dispatch_get_all_op_names()) - _RESOLVED:
            namespace, _, qualified = name.partition("::")
            op, _, overload = qualified.partition(".")
            try:
                getattr(getattr(getattr(torch.ops, namespace), op), overload or "default")
            except AttributeError:  # no Python object to make: no mode receives this one
                pass
            _RESOLVED.add(name)
