"""The ``.grad`` of one flat group's shard params: where its reduced gradients land.

Design note. A reduced gradient arrives as one flat shard (1-D, padded/N). Where every shard
param takes a gradient and none has one, their ``.grad`` become views of it, with no copy;
where they are still those views, the next one is added to it in one call; otherwise each
piece is added to (or copied into) its own ``.grad``. The views are known weakly: once
``zero_grad()`` drops them, their memory is freed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .layout import LocalPiece

__all__ = ["ShardGrads"]

AsGrads = Callable[[list[tuple[int, Tensor]]], list[Tensor]]


class ShardGrads:
    """The ``.grad`` of a flat group's shard params.

    Args:
        params: the shard params, in flat order.
        pieces: where each one's piece lies in the shard.
        piece_shapes: each one's shape.
        dtype: the shard's dtype (a ``.grad``'s where its param sets no ``grad_dtype``).
    """

    def __init__(
        self,
        params: list[nn.Parameter],
        pieces: Sequence[LocalPiece],
        piece_shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
    ) -> None:
        self.params = params
        self.pieces = pieces
        self.piece_shapes = piece_shapes
        self.dtype = dtype
        # 1-D, padded/N: the buffer behind the shard params' .grad, while they use it.
        self._flat: Callable[[], Tensor | None] = _dead_ref
        self._views: list[Callable[[], Tensor | None]] = []

    @property
    def flat(self) -> Tensor | None:
        """The buffer whose views the ``.grad`` are, while they are."""
        return self._flat()

    def buffer_free(self, buffer: Tensor | None) -> bool:
        """Whether ``buffer``, a gradient buffer the group keeps between steps, may take this
        backward's reduced gradient: no shard param has a ``.grad`` and nothing else holds the
        buffer's memory (a ``.grad`` that a user kept past ``zero_grad()``, say, which it would
        overwrite)."""
        if buffer is None or any(p.grad is not None for p in self.params):
            return False
        # Held by the buffer itself and by the storage object asked; any view adds one.
        return torch._C._storage_Use_Count(buffer.untyped_storage()._cdata) <= 2

    def accumulate(self, new: Tensor, as_grads: AsGrads, seen: list[bool]) -> list[nn.Parameter]:
        """Add a reduced shard gradient to the shard params' ``.grad`` (set it if ``None``).

        ``as_grads`` types the new ``.grad`` tensors (given each as ``(index, view)``, all at
        once). As in plain PyTorch, a shard param that does not require grad now gets none,
        and neither does one that no rank's backward gave a gradient (``seen``, agreed across
        ranks): its ``.grad`` stays as it was. Each ``.grad`` is in its shard param's
        ``grad_dtype`` (the shard's dtype where unset).

        Returns:
            The shard params whose ``.grad`` this changed.
        """
        params = self.params
        dtypes = [p.grad_dtype or self.dtype for p in params]
        one_dtype = dtypes.count(dtypes[0]) == len(dtypes)
        if one_dtype:
            new = new.to(dtypes[0])
        flat = self._flat()
        takes = [p.requires_grad and s for p, s in zip(params, seen)]
        every = all(takes)
        if (
            every
            and flat is not None
            and flat is not new
            and flat.dtype == new.dtype
            and all(p.grad is not None and p.grad is v() for p, v in zip(params, self._views))
        ):
            flat.add_(new)
        elif every and one_dtype and all(p.grad is None for p in params):
            views = as_grads(
                [
                    (i, new[pc.shard_offset : pc.shard_offset + pc.numel].view(shape))
                    for i, (pc, shape) in enumerate(zip(self.pieces, self.piece_shapes))
                ]
            )
            for p, v in zip(params, views):
                p.grad = v
            self._flat = weakref.ref(new)
            self._views = [weakref.ref(v) for v in views]
        else:
            fresh = []  # (index, a copy of its piece) for the params without a gradient yet
            for i, (p, pc, take) in enumerate(zip(params, self.pieces, takes)):
                if not take:
                    continue
                piece = new[pc.shard_offset : pc.shard_offset + pc.numel].view(p.shape)
                if p.grad is None:
                    fresh.append((i, piece.to(dtypes[i], copy=True)))
                else:
                    p.grad.add_(piece)
            for (i, _), grad in zip(fresh, as_grads(fresh)):
                params[i].grad = grad
            self._flat, self._views = _dead_ref, []
        return [p for p, take in zip(params, takes) if take]


def _dead_ref() -> None:
    return None
