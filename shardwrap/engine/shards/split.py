"""A parameter split into equal blocks along one dimension: where each block's elements lie.

Pure arithmetic, and the two reshapes it implies. A tensor-parallel parameter is split across
the ranks of its tensor-parallel group along one dimension; each rank holds one block, and
a flat group lays out that block's elements, flattened. The *stacked* order of a parameter is
its blocks' flattened elements one block after the other: for a split along dimension 0 it is
the parameter's own flattened order, along any other dimension a permutation of it. Ranges of
the stacked order are what shardwrap knows of a split parameter (which rank holds which,
which file holds which); :meth:`Split.runs` turns one into contiguous ranges of the whole
parameter's flattened order, which checkpoints of another layout are read by.

A parameter that is not split has one block, the whole parameter: its stacked order is its
own, and every function here is the identity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Split", "overlaps"]


@dataclass(frozen=True)
class Split:
    """A parameter of ``shape`` split into ``parts`` equal blocks along ``dim``.

    ``dim`` is ``None`` (or ``parts`` 1) for a parameter that is not split.
    """

    shape: tuple[int, ...]
    dim: int | None = None
    parts: int = 1

    def __post_init__(self) -> None:
        if self.dim is not None and not 0 <= self.dim < len(self.shape):
            raise ValueError(f"Split.dim {self.dim} is outside a shape of {len(self.shape)} dims")
        if self.parts < 1 or (self.dim is not None and self.shape[self.dim] % self.parts):
            raise ValueError(
                f"Split: dimension {self.dim} of {self.shape} does not split in {self.parts}"
            )

    @property
    def is_split(self) -> bool:
        return self.dim is not None and self.parts > 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def block_shape(self) -> tuple[int, ...]:
        if not self.is_split:
            return self.shape
        assert self.dim is not None
        d = self.dim
        return (*self.shape[:d], self.shape[d] // self.parts, *self.shape[d + 1 :])

    @property
    def block_numel(self) -> int:
        return self.numel // self.parts if self.is_split else self.numel

    @property
    def identity(self) -> bool:
        """Whether the stacked order is the whole parameter's flattened order (not split, or
        split along its first non-trivial dimension)."""
        return not self.is_split or math.prod(self.shape[: self.dim]) == 1

    def runs(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """Stacked elements ``[start, stop)`` as contiguous ranges of the whole parameter's
        flattened order: ``(whole_start, whole_stop, stacked_start)`` each, in stacked order.

        A block is ``outer`` slices of ``rows * inner`` contiguous elements (``outer`` the
        product of the sizes before ``dim``, ``inner`` of those after), so a range gives at
        most one run per slice it crosses.
        """
        if start >= stop:
            return []
        if self.identity:
            return [(start, stop, start)]
        assert self.dim is not None
        inner = math.prod(self.shape[self.dim + 1 :])
        run = self.shape[self.dim] // self.parts * inner  # one slice of a block
        full_row = self.shape[self.dim] * inner  # one slice of the whole
        block = self.block_numel
        out = []
        v = start
        while v < stop:
            t, i = divmod(v, block)
            o, rem = divmod(i, run)
            n = min(stop - v, run - rem)
            whole = o * full_row + t * run + rem
            out.append((whole, whole + n, v))
            v += n
        return out

    def block(self, whole: Tensor, index: int) -> Tensor:
        """Block ``index`` of ``whole`` (a view)."""
        if not self.is_split:
            return whole
        assert self.dim is not None
        rows = self.shape[self.dim] // self.parts
        return whole.narrow(self.dim, index * rows, rows)

    def stacked(self, whole: Tensor) -> Tensor:
        """``whole`` in stacked order, 1-D (a view where that order is its own)."""
        if self.identity:
            return whole.reshape(-1)
        return torch.cat([self.block(whole, t).reshape(-1) for t in range(self.parts)])

    def unstacked(self, stacked: Tensor) -> Tensor:
        """The whole parameter, shaped, from its elements in stacked order (a view where that
        order is its own)."""
        if self.identity:
            return stacked.view(self.shape)
        assert self.dim is not None
        blocks = stacked.view(self.parts, *self.block_shape).unbind(0)
        return torch.cat(blocks, dim=self.dim)


def overlaps(
    mine: Split, lo: int, hi: int, theirs: Split, start: int, stop: int
) -> list[tuple[int, int, int]]:
    """Where stacked elements ``[start, stop)`` of ``theirs`` hold stacked elements
    ``[lo, hi)`` of ``mine`` (two splits of one parameter): ``(at, to, n)`` each, ``n``
    elements from offset ``at`` of the former to offset ``to`` of the latter."""
    if (mine.identity and theirs.identity) or (mine.dim, mine.parts) == (theirs.dim, theirs.parts):
        a, b = max(lo, start), min(hi, stop)
        return [(a - start, a - lo, b - a)] if a < b else []
    wanted, held = sorted(mine.runs(lo, hi)), sorted(theirs.runs(start, stop))
    out, i, j = [], 0, 0
    while i < len(wanted) and j < len(held):
        (w0, w1, wv), (h0, h1, hv) = wanted[i], held[j]
        a, b = max(w0, h0), min(w1, h1)
        if a < b:
            out.append((hv + a - h0 - start, wv + a - w0 - lo, b - a))
        if w1 <= h1:
            i += 1
        else:
            j += 1
    return out
