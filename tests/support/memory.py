"""Allocation tracking for memory tests: ``shardwrap.track_allocations`` with two filters.

``TorchDispatchMode`` is per thread, so under ``tests._ranks`` each rank tracks only its own
allocations.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from shardwrap import AllocationTracker

__all__ = ["StorageTracker"]


class StorageTracker(AllocationTracker):
    """:class:`shardwrap.AllocationTracker`, skipping some storages besides.

    Args:
        existing: tensors made before tracking (inputs) whose storages never count.
        ignore: tensors whose storage never counts.
    """

    def __init__(
        self, existing: tuple[Tensor, ...] = (), ignore: Callable[[Tensor], bool] | None = None
    ) -> None:
        super().__init__()
        self._existing = {t.untyped_storage()._cdata for t in existing}
        self._ignore = ignore

    def counts(self, t: Tensor) -> bool:
        if t.untyped_storage()._cdata in self._existing or (self._ignore and self._ignore(t)):
            return False
        return super().counts(t)
