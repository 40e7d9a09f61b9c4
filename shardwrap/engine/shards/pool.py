"""Full flat buffers passed from unit to unit, so that a gather or a flat gradient reuses memory."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import Tensor

__all__ = ["BufferPool", "Spares"]

K = TypeVar("K", bound=Hashable)
B = TypeVar("B")


class Spares(Generic[K, B]):
    """The pool's policy: which released buffers are kept, and which one a request gets.

    A request for ``key`` (a size, dtype, ...) gets a spare flat gradient first, then a spare
    gathered buffer, and ``make(key)`` only when there is neither. A released gathered buffer
    is kept (up to ``keep`` per key) while ``holding``; a flat gradient is kept (up to ``keep``
    per key) apart from them, whatever ``holding`` says, until ``trim_scratch``. The engine's
    pool makes real buffers (:class:`BufferPool`); the memory planner makes keys it counts the
    bytes of, so that the plan follows these rules as the engine does.
    """

    def __init__(self, make: Callable[[K], B], keep: int = 2) -> None:
        self.keep = keep
        self.holding = True  # False: released buffers are freed, not kept
        self._make = make
        self._free: dict[K, list[B]] = {}
        self._scratch: dict[K, list[B]] = {}

    def pop(self, key: K) -> B:
        """A spare for ``key`` (a flat gradient first), else a new one."""
        for lists in (self._scratch, self._free):
            free = lists.get(key)
            if free:
                return free.pop()
        return self._make(key)

    def put(self, key: K, buf: B) -> None:
        """Keep a released gathered buffer, while holding and fewer than ``keep`` of its key."""
        free = self._free.setdefault(key, [])
        if self.holding and len(free) < self.keep:
            free.append(buf)

    def put_scratch(self, key: K, buf: B) -> None:
        """Keep a flat gradient nothing reads any more, if fewer than ``keep`` of its key."""
        free = self._scratch.setdefault(key, [])
        if len(free) < self.keep:
            free.append(buf)

    def trim(self) -> None:
        """Free every spare gathered buffer (nothing will be gathered for a while)."""
        self._free.clear()

    def trim_scratch(self) -> None:
        """Free the flat gradients kept for reuse (backward is over)."""
        self._scratch.clear()

    def spares(self) -> Iterator[B]:
        """Every buffer kept, gathered buffers and flat gradients alike."""
        for lists in (self._free, self._scratch):
            for free in lists.values():
                yield from free


def _empty(key: tuple[int, torch.dtype, torch.device]) -> Tensor:
    # Made under torch.inference_mode() it would be an inference tensor, which no gather after
    # that block could write into: a pooled buffer outlives the forward that asked for it.
    with torch.inference_mode(False):
        return torch.empty(key[0], dtype=key[1], device=key[2])


class BufferPool(Spares[tuple[int, torch.dtype, torch.device], Tensor]):
    """Full flat buffers passed from unit to unit, so a gather reuses memory.

    A buffer a unit releases goes to the free list of its size (up to ``keep`` per size)
    and the next unit of that size gathers into it: no allocation, no page faults. This is
    safe because nothing outside the owning unit keeps a buffer's address: autograd saves
    views of it by (group, offset, shape) only (see ``Root``'s saved-tensor hooks).
    ``holder`` maps a buffer's data pointer to what is gathered in it (a flat group).

    Flat gradients come from here too (``take_scratch``): a unit's flat gradient is the size of
    its gathered parameters, and once reduced it is handed to the next unit's backward, which
    then allocates nothing. They are kept apart from the parameters' free list, whatever
    ``holding`` says, until ``trim_scratch`` at the end of backward, and never enter ``holder``.
    Which buffer is kept and handed out is :class:`Spares`' policy.
    """

    def __init__(self, keep: int = 2) -> None:
        super().__init__(_empty, keep)
        self.holder: dict[int, Any] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, holder: Any) -> Tensor:
        """A 1-D buffer to gather ``holder`` into, its values undefined."""
        buf = self.pop((numel, dtype, device))
        self.claim(buf, holder)
        return buf

    def claim(self, buf: Tensor, holder: Any) -> None:
        """Record that ``holder`` is gathered in ``buf`` (a buffer kept outside the pool)."""
        self.holder[buf.data_ptr()] = holder

    def take_scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D buffer for a flat gradient, its values undefined."""
        return self.pop((numel, dtype, device))

    def give_scratch(self, buf: Tensor) -> None:
        """Take back a flat gradient that nothing reads any more."""
        if buf.is_contiguous() and buf.dim() == 1 and buf.storage_offset() == 0:
            self.put_scratch((buf.numel(), buf.dtype, buf.device), buf)

    def give(self, buf: Tensor, keep: bool = True) -> None:
        """Take ``buf`` back; with ``keep=False`` free it (a size no gather will ask for)."""
        del self.holder[buf.data_ptr()]
        if keep:
            self.put((buf.numel(), buf.dtype, buf.device), buf)
