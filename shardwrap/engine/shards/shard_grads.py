"""The ``.grad`` of one flat group's shard params: where its reduced gradients land.

Design note. A reduced gradient arrives as one flat shard (1-D, padded/N). Where every shard
param takes a gradient and none has one, their ``.grad`` become views of it, with no copy;
where they are still those views (the same tensors, over the same memory: ``p.grad.data = t``
keeps the tensor and moves it off the buffer), the next one is added to it in one call;
otherwise each piece is added to (or copied into) its own ``.grad``. The views are known
weakly: once ``zero_grad()`` drops them, their memory is freed.

Between a backward under ``no_sync`` and the synced one, a rank's accumulated gradients are
unreduced, in the group's flat gradient, not in ``.grad``; on a plain model they are ``.grad``,
and ``zero_grad()`` drops them. So each parameter they include then has a ``.grad`` (zeros,
where it had none) that is noted (:meth:`ShardGrads.stand_in`), and before the next backward
the group drops the unreduced gradient of each one ``zero_grad()`` cleared since
(:meth:`ShardGrads.cleared`): set to ``None``, or zeroed in place, which the shard gradients
count (``engine/optim/shard_grad.py``). Any other change to such a ``.grad`` is refused.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
from torch import Tensor, nn

from .layout import LocalPiece

__all__ = ["ShardGrads"]

AsGrads = Callable[[list[tuple[int, Tensor]]], list[Tensor]]


def _unmark(mark: tuple[weakref.ReferenceType[Tensor], int] | None) -> None:
    """The ``.grad`` a mark notes stands in no more."""
    grad = mark[0]() if mark is not None else None
    if grad is not None:
        grad._shardwrap_unreduced = False


class ShardGrads:
    """The ``.grad`` of a flat group's shard params.

    Args:
        names: the parameters' names, in flat order.
        params: the shard params, in flat order.
        pieces: where each one's piece lies in the shard.
        piece_shapes: each one's shape.
        dtype: the shard's dtype (a ``.grad``'s where its param sets no ``grad_dtype``).
        shard_numel: the shard's elements, padding included.
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        pieces: Sequence[LocalPiece],
        piece_shapes: list[tuple[int, ...]],
        dtype: torch.dtype,
        shard_numel: int,
    ) -> None:
        self.names = names
        self.params = params
        self.pieces = pieces
        self.piece_shapes = piece_shapes
        self.dtype = dtype
        self.shard_numel = shard_numel
        # 1-D, padded/N: the buffer behind the shard params' .grad, while they use it.
        self._flat: Callable[[], Tensor | None] = _dead_ref
        # Each view (weakly), with where its memory began when made.
        self._views: list[tuple[Callable[[], Tensor | None], int]] = []
        # Per shard param, while the group holds unreduced gradients (``no_sync``): its
        # ``.grad`` (weakly) and that tensor's version when the last such backward ended, or
        # ``None`` where it is not among them; ``None`` with nothing unreduced.
        self._marks: list[tuple[Callable[[], Tensor | None], int] | None] | None = None

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
        dtypes = self._dtypes()
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
            and all(
                p.grad is not None and p.grad is v() and p.grad.data_ptr() == address
                for p, (v, address) in zip(params, self._views)
            )
        ):
            flat.add_(new)
        elif every and one_dtype and all(p.grad is None for p in params):
            self._view(new, as_grads)
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

    def stand_in(self, held: list[bool], as_grads: AsGrads, buffer: Tensor | None) -> None:
        """After a backward that reduced nothing: give each shard param in ``held`` (whose
        gradient this rank holds unreduced) a ``.grad``, zeros where it has none, typed by
        ``as_grads`` (in ``buffer``, the home's free gradient buffer, where every one needs
        one), and note them all for :meth:`cleared`."""
        params = self.params
        if not any(held):
            self._marks = None
            return
        bare = [i for i, h in enumerate(held) if h and params[i].grad is None]
        dtypes = self._dtypes()
        if len(bare) == len(params) and dtypes.count(dtypes[0]) == len(dtypes):
            if buffer is None or buffer.dtype != dtypes[0]:
                device = params[0].device
                buffer = torch.zeros(self.shard_numel, dtype=dtypes[0], device=device)
            self._view(buffer.zero_(), as_grads)
        elif bare:
            zeros = [
                (i, torch.zeros(params[i].shape, dtype=dtypes[i], device=params[i].device))
                for i in bare
            ]
            for i, grad in zip(bare, as_grads(zeros)):
                params[i].grad = grad
            self._flat, self._views = _dead_ref, []
        self._marks = []
        for p, h in zip(params, held):
            self._marks.append((weakref.ref(p.grad), p.grad._version) if h else None)
            if h:
                p.grad._shardwrap_zeroings = 0  # counted by the shard gradients
                p.grad._shardwrap_unreduced = True  # its norm would be of none of them

    def cleared(self) -> list[int]:
        """The shard params noted by :meth:`stand_in` whose ``.grad`` was cleared since
        (``zero_grad()``: set to ``None``, or zeroed in place); they are noted no more.

        Raises:
            RuntimeError: such a ``.grad`` was replaced or changed in place otherwise: the
                unreduced gradient cannot follow, and keeping it would be silently wrong.
        """
        marks = self._marks
        if marks is None:
            return []
        # The .grad of a group are views of one buffer, whose version counter they share:
        # each zeroing of any of them counts once there.
        zeroings: dict[int, int] = {}
        for p, mark in zip(self.params, marks):
            if mark is not None and p.grad is not None and p.grad is mark[0]():
                key = p.grad.untyped_storage().data_ptr()
                zeroings[key] = zeroings.get(key, 0) + p.grad._shardwrap_zeroings
        out = []
        for i, (p, mark) in enumerate(zip(self.params, marks)):
            if mark is None:
                continue
            grad, version = mark[0](), mark[1]
            if p.grad is not None:
                if p.grad is not grad or (
                    grad._version != version
                    and grad._version - version != zeroings[grad.untyped_storage().data_ptr()]
                ):
                    raise RuntimeError(
                        f"shardwrap: the .grad of {self.names[i]} was replaced or changed in "
                        "place between a backward under no_sync() (or "
                        "require_backward_grad_sync=False) and the synced backward. Until that "
                        "backward this rank's accumulated gradients stay unreduced, outside "
                        ".grad, and only zero_grad() reaches them (it drops them, as on a plain "
                        "model). Change gradients after the synced backward."
                    )
                if grad._shardwrap_zeroings == 0:
                    continue  # untouched (a neighbour in its buffer may have been zeroed)
            out.append(i)
            _unmark(mark)
            marks[i] = None
        if all(m is None for m in marks):
            self._marks = None
        return out

    def stands_in(self, index: int) -> bool:
        """Whether shard param ``index``'s ``.grad`` is still the one :meth:`stand_in` gave it:
        a backward under ``no_sync`` left this rank's gradient of it unreduced, outside
        ``.grad``, which holds zeros (or what it held before) until the synced backward."""
        marks = self._marks
        if marks is None or marks[index] is None:
            return False
        grad = self.params[index].grad
        return grad is not None and grad is marks[index][0]()

    def forget(self) -> None:
        """The unreduced gradients are gone (reduced, or dropped with a backward that raised):
        note nothing more."""
        for mark in self._marks or ():
            _unmark(mark)
        self._marks = None

    def _dtypes(self) -> list[torch.dtype]:
        """Per shard param, its ``.grad``'s dtype: its ``grad_dtype``, else the shard's."""
        return [p.grad_dtype or self.dtype for p in self.params]

    def _view(self, flat: Tensor, as_grads: AsGrads) -> None:
        """Make every shard param's ``.grad`` its view of ``flat`` (1-D, padded/N)."""
        views = as_grads(
            [
                (i, flat[pc.shard_offset : pc.shard_offset + pc.numel].view(shape))
                for i, (pc, shape) in enumerate(zip(self.pieces, self.piece_shapes))
            ]
        )
        for p, v in zip(self.params, views):
            p.grad = v
        self._flat = weakref.ref(flat)
        self._views = [(weakref.ref(v), v.data_ptr()) for v in views]


def _dead_ref() -> None:
    return None
