"""Full flat buffers passed from unit to unit, so that a gather or a flat gradient reuses memory."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["BufferPool"]


class BufferPool:
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
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.holding = True  # False: released buffers are freed, not kept
        self.holder: dict[int, Any] = {}
        self._free: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}
        self._scratch: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}

    def take(self, numel: int, dtype: torch.dtype, device: torch.device, holder: Any) -> Tensor:
        """A 1-D buffer to gather ``holder`` into, its values undefined."""
        buf = self._pop((numel, dtype, device))
        self.claim(buf, holder)
        return buf

    def claim(self, buf: Tensor, holder: Any) -> None:
        """Record that ``holder`` is gathered in ``buf`` (a buffer kept outside the pool)."""
        self.holder[buf.data_ptr()] = holder

    def take_scratch(self, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A 1-D buffer for a flat gradient, its values undefined."""
        return self._pop((numel, dtype, device))

    def give_scratch(self, buf: Tensor) -> None:
        """Take back a flat gradient that nothing reads any more."""
        if buf.is_contiguous() and buf.dim() == 1 and buf.storage_offset() == 0:
            free = self._scratch.setdefault((buf.numel(), buf.dtype, buf.device), [])
            if len(free) < self.keep:
                free.append(buf)

    def trim_scratch(self) -> None:
        """Free the flat gradients kept for reuse (backward is over)."""
        self._scratch.clear()

    def _pop(self, key: tuple[int, torch.dtype, torch.device]) -> Tensor:
        for lists in (self._scratch, self._free):
            free = lists.get(key)
            if free:
                return free.pop()
        return torch.empty(key[0], dtype=key[1], device=key[2])

    def give(self, buf: Tensor, keep: bool = True) -> None:
        """Take ``buf`` back; with ``keep=False`` free it (a size no gather will ask for)."""
        del self.holder[buf.data_ptr()]
        free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
        if keep and self.holding and len(free) < self.keep:
            free.append(buf)

    def trim(self) -> None:
        """Free every parameter buffer no unit holds (nothing will be gathered for a while)."""
        self._free.clear()
