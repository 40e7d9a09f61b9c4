"""Full flat buffers passed from unit to unit, so that a gather or a flat gradient reuses memory."""

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

    Flat gradients come from here too (``take_scratch``): a unit's flat gradient is the size of
    its gathered parameters, and once reduced it is handed to the next unit's backward, which
    then allocates nothing. They are kept apart from the parameters' free list, whatever
    ``holding`` says, until ``trim_scratch`` at the end of backward, and never enter ``owner``.
    """

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.holding = True  # False: released buffers are freed, not kept
        self.owner: dict[int, FlatGroup] = {}
        self._free: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}
        self._scratch: dict[tuple[int, torch.dtype, torch.device], list[Tensor]] = {}

    def take(self, group: FlatGroup, dtype: torch.dtype) -> Tensor:
        buf = self._pop((group.layout.padded_numel, dtype, group.home.device))
        self.owner[buf.data_ptr()] = group
        return buf

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
        del self.owner[buf.data_ptr()]
        free = self._free.setdefault((buf.numel(), buf.dtype, buf.device), [])
        if keep and self.holding and len(free) < self.keep:
            free.append(buf)

    def trim(self) -> None:
        """Free every parameter buffer no unit holds (nothing will be gathered for a while)."""
        self._free.clear()
