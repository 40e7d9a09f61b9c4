"""Allocation tracking for memory tests: every storage an op creates, and the peak of live bytes.

``TorchDispatchMode`` is per thread, so under ``tests._ranks`` each rank tracks only its own
allocations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["StorageTracker"]


class StorageTracker(TorchDispatchMode):
    """Tracks every storage that an op's outputs live in, and the peak of their live bytes.

    Storages are held through weak references, so a storage counts while anything (a
    parameter, a view, a leaked reference) keeps it alive. Live bytes only grow when a new
    storage appears, so the peak is measured then.
    """

    def __init__(
        self, existing: tuple[Tensor, ...] = (), ignore: Callable[[Tensor], bool] | None = None
    ) -> None:
        """``existing``: tensors made before tracking (inputs) whose storages never count, even
        when an op returns a view of them. ``ignore``: tensors whose storage never counts (the
        disk tier's file-backed tensors, say)."""
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self._existing = {t.untyped_storage()._cdata for t in existing}
        self._ignore = ignore
        self.peak = 0

    def live(self) -> int:
        return sum(n for ref, n in self.storages.values() if not ref.expired())

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor) and not t.is_meta:
                storage = t.untyped_storage()
                if storage._cdata in self._existing or (self._ignore and self._ignore(t)):
                    continue
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    self.peak = max(self.peak, self.live())
        return out

    def reset_peak(self) -> None:
        """Start a new peak from what is live now."""
        self.peak = self.live()
