"""Full flat buffers passed from unit to unit, so that a gather reuses memory."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from ._flat_group import FlatGroup

__all__ = ["BufferPool"]


class BufferPool:
    """Full flat buffers passed from unit to unit, so a gather reuses memory.

    A buffer a unit releases goes to the free list of its size (up to ``keep`` per size)
    and the next unit of that size gathers into it: no allocation, no page faults. This is
    safe because nothing outside the owning unit keeps a buffer's address: autograd saves
    views of it by (group, offset, shape) only (see ``Root``'s saved-tensor hooks).
    ``owner`` maps a buffer's data pointer to the group gathered in it.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.holding = True  # False: released buffers are freed, not kept
        self.owner: dict[int, FlatGroup] = {}
        self._free: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}

    def take(self, group: FlatGroup, dtype: torch.dtype) -> Tensor:
        key = (group.layout.padded_numel, dtype, group.home.device)
        free = self._free.get(key)
        buf = free.pop() if free else torch.empty(key[0], dtype=key[1], device=key[2])
        self.owner[buf.data_ptr()] = group
        return buf

    def give(self, buf: Tensor, keep: bool = True) -> None:
        """Take ``buf`` back; with ``keep=False`` free it (a size no gather will ask for)."""
        del self.owner[buf.data_ptr()]
        free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
        if keep and self.holding and len(free) < self.keep:
            free.append(buf)

    def trim(self) -> None:
        """Free every buffer no unit holds (nothing will be gathered for a while)."""
        self._free.clear()
