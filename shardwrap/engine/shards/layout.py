"""Flat layout: where each parameter lives in a unit's flat buffer and on which rank.

Pure arithmetic, no tensors' contents and no process groups. A flat buffer is the
concatenation of its parameters, flattened, in a fixed order, followed by at most
``world_size - 1`` padding elements so that it splits into ``world_size`` equal shards.
Rank ``r`` owns elements ``[r * shard_size, (r + 1) * shard_size)`` of it. A buffer of no
elements (a unit whose parameters are all empty, ``nn.Linear(h, 0)``) is padded to one element
per rank, so that every shard, gather and reduction has memory of its own.

Checkpoints key their files on the per-parameter element ranges computed here, so the
layout of a checkpoint never depends on the world size that wrote it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

__all__ = ["FlatLayout", "LocalPiece", "view_end"]


def view_end(offset: int, shape: Sequence[int], stride: Sequence[int]) -> int:
    """One past the last element of its storage that a view (``offset``, ``shape``,
    ``stride``) reads; ``offset`` for a view of no elements."""
    if 0 in shape:
        return offset
    return offset + 1 + sum((n - 1) * st for n, st in zip(shape, stride))


@dataclass(frozen=True)
class LocalPiece:
    """The part of one parameter that one rank's shard holds.

    The piece covers elements ``[start, stop)`` of the flattened parameter and sits at
    ``[shard_offset, shard_offset + numel)`` of the rank's shard. An empty piece has
    ``start == stop`` and ``numel == 0``.
    """

    start: int
    stop: int
    shard_offset: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class FlatLayout:
    """Offsets, padding and shard ranges of one flat buffer.

    Args:
        numels: element count of each parameter, in flat order.
        world_size: number of ranks sharing the buffer (at least 1).
    """

    numels: tuple[int, ...]
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be at least 1, got {self.world_size}")
        if any(n < 0 for n in self.numels):
            raise ValueError(f"numels must be non-negative, got {self.numels}")

    @cached_property
    def offsets(self) -> tuple[int, ...]:
        """Start of each parameter in the flat buffer."""
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    @property
    def numel(self) -> int:
        """Elements of real data, without padding."""
        return sum(self.numels)

    @cached_property
    def shard_size(self) -> int:
        """Elements in each rank's shard, padding included (at least one)."""
        return max(1, -(-self.numel // self.world_size))

    @property
    def padded_numel(self) -> int:
        """Elements in the full flat buffer, padding included."""
        return self.shard_size * self.world_size

    @property
    def padding(self) -> int:
        """Padding elements at the end of the flat buffer (at most ``world_size - 1``, or
        ``world_size`` for a buffer of no elements)."""
        return self.padded_numel - self.numel

    def shard_range(self, rank: int) -> tuple[int, int]:
        """The ``[start, stop)`` range of the flat buffer that ``rank`` owns."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside world size {self.world_size}")
        return rank * self.shard_size, (rank + 1) * self.shard_size

    def local_pieces(self, rank: int) -> tuple[LocalPiece, ...]:
        """For every parameter, the piece of it that ``rank``'s shard holds."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for offset, n in zip(self.offsets, self.numels):
            start, stop = max(lo, offset), min(hi, offset + n)
            if start >= stop:
                pieces.append(LocalPiece(0, 0, 0))
            else:
                pieces.append(LocalPiece(start - offset, stop - offset, start - lo))
        return tuple(pieces)

    @cached_property
    def places(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """Per parameter, ``(rank, start, stop)`` for each rank holding part of it: where its
        elements lie over the ranks, whatever else shares the buffer."""
        by_rank = [self.local_pieces(r) for r in range(self.world_size)]
        return tuple(
            tuple((r, pcs[i].start, pcs[i].stop) for r, pcs in enumerate(by_rank) if pcs[i].numel)
            for i in range(len(self.numels))
        )

    def owners(self, index: int) -> tuple[tuple[int, LocalPiece], ...]:
        """The ranks that hold part of parameter ``index``, with the piece each holds."""
        offset, n = self.offsets[index], self.numels[index]
        if n == 0:
            return ()
        first = offset // self.shard_size
        last = (offset + n - 1) // self.shard_size
        return tuple((r, self.local_pieces(r)[index]) for r in range(first, last + 1))
