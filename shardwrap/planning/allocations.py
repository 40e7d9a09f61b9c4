"""The tracked-allocation measure: the peak of live tensor bytes a block of code creates.

Design note. On a GPU, ``torch.cuda.max_memory_allocated`` says what tensors held at the
peak; on a CPU torch keeps no such count, and the resident set adds what no tensor holds (the
allocator's retention, kernel scratch, library code). :func:`track_allocations` is the CPU's
counterpart, and what ``shardwrap.estimate_memory`` plans: a dispatch mode that sees every
op, records each storage an op creates (weakly: it counts while anything keeps it alive) and
takes the peak of the live bytes whenever a new one appears.

A storage counts when an op creates it (``torch.tensor(data)`` included): an output over
one of the op's inputs (a view, an in-place op) is not new, so tensors made before tracking
never count however they are viewed. Only storages torch's allocator made count: memory
torch was handed (a mapped file, such as the disk tier's store, a NumPy array) is not the
process's to plan. A dispatch mode is per thread, so ranks run as threads of one process
each track their own.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .python_ops import resolve_python_ops

__all__ = ["AllocationTracker", "track_allocations"]


class AllocationTracker(TorchDispatchMode):
    """Live bytes of the storages ops create while it is entered, and their peak.

    Use as a context manager (:func:`track_allocations`); ``peak`` and :meth:`live` stay
    readable after it exits.
    """

    def __init__(self, device: str | torch.device | None = None) -> None:
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}  # by storage address
        self.peak = 0
        """The most bytes alive at once, in bytes."""

    def __enter__(self) -> AllocationTracker:
        resolve_python_ops()  # ranks as threads, each entering one: see planning/python_ops.py
        return super().__enter__()

    def live(self) -> int:
        """The bytes of tracked storages alive now."""
        dead = [k for k, (ref, _) in self.storages.items() if ref.expired()]
        for k in dead:
            del self.storages[k]
        return sum(n for _, n in self.storages.values())

    def reset_peak(self) -> None:
        """Start a new peak from what is alive now (as ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak = self.live()

    def counts(self, t: Tensor) -> bool:
        """Whether ``t``'s storage, new to an op's inputs, is counted: made by torch's
        allocator (resizable) on the tracked device."""
        storage = t.untyped_storage()
        return storage.resizable() and (self.device is None or t.device.type == self.device)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # ``torch.tensor(data)`` fills a storage outside any op, then lifts it: that is new.
        fresh = func in _LIFTS
        inputs = (
            set()
            if fresh
            else {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _dense(t)}
        )
        grew = False
        for t in tree_leaves(out):
            if not _dense(t) or t.untyped_storage()._cdata in inputs or not self.counts(t):
                continue
            storage = t.untyped_storage()
            known = self.storages.get(storage._cdata)
            if known is None or known[0].expired():
                self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                grew = True
        if grew:
            self.peak = max(self.peak, self.live())
        return out


_LIFTS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)


def _dense(t: Any) -> bool:
    return isinstance(t, Tensor) and not t.is_meta and not t.is_sparse and t.layout == torch.strided


def track_allocations(device: str | torch.device | None = None) -> AllocationTracker:
    """Track the tensors created inside a ``with`` block: their live bytes and the peak.

    The CPU's counterpart of ``torch.cuda.max_memory_allocated``, and the measure
    :func:`shardwrap.estimate_memory` plans. Example, checking a plan::

        plan = shardwrap.estimate_memory(model, world_size=2, stage=3, batch=4, seq=512)
        with shardwrap.track_allocations() as tracked:
            model = ShardedModule(model, auto_wrap=Block, stage=3)
            ...  # two or more training steps
        print(tracked.peak / plan.row(3).peak)

    Args:
        device: count only tensors on this device type (``"cpu"``, ``"cuda"``); default:
            every device.

    Returns:
        An :class:`AllocationTracker` to enter; ``peak`` is in bytes.

    Notes:
        - A storage counts from the op that creates it while anything keeps it alive; views
          of tensors made before the block, and memory torch was handed (mapped files such as
          the disk tier's store, NumPy arrays), never count.
        - Tracking is per thread (each rank of a threaded run tracks its own) and runs Python
          at every op: steps inside the block are slower, so keep it out of timed ones.
    """
    return AllocationTracker(device)
