"""One wrapped module's shards and its SHARDED <-> GATHERED state machine.

Design note. A unit owns one :class:`FlatGroup` per (dtype, requires_grad) group of the
parameters it holds. Each group keeps this rank's 1/N shard of a padded flat buffer; the
optimizer sees one ``nn.Parameter`` per original parameter, a 1-D view of that shard.
Those shard parameters stay registered in the modules at all times, so ``parameters()``,
``state_dict()`` and an optimizer built after wrapping always see shards.

While the unit is gathered, the full flat buffer (a leaf tensor whose storage is released
on reshard) is split into views shaped like the original parameters, and the views shadow
the registered parameters through each module's instance ``__dict__``: ``module.weight``
returns the full view, ``module._parameters`` keeps the shard. Autograd accumulates the
gradients of all views into the flat buffer's ``.grad`` in one piece, which is then
reduce-scattered straight from the flat layout.

A unit knows nothing of other units or of the order of collectives; the schedule decides
when to gather, and the root decides when to reshard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch import Tensor, nn

from ._collectives import (
    CommStats,
    Group,
    Pending,
    all_gather,
    group_rank,
    group_size,
    reduce_scatter,
)
from ._layout import FlatLayout, LocalPiece

__all__ = ["FlatGroup", "ShardState", "Unit"]

Slot = tuple[nn.Module, str]


class ShardState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()


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
        key = (group.layout.padded_numel, dtype, group.shard.device)
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


class FlatGroup:
    """The parameters of one unit that share a dtype and ``requires_grad``.

    Three dtypes meet here: the shard's (``dtype``, the optimizer's master copy), the
    gathered parameters' (``compute_dtype``, which forward and backward use) and the flat
    gradient's (``grad_dtype``, in which ranks average it). Without mixed precision all three
    are the parameters' dtype.

    Args:
        names: canonical name of each parameter (as ``named_parameters()`` gives it).
        params: the original, full parameters, in flat order.
        slots: for each parameter, every ``(module, attribute)`` that holds it (several for
            tied parameters).
        group: process group, or ``None`` for world size 1.
        device: where the shard lives.
        pool: where the full buffer comes from while gathered.
        compute_dtype: dtype of the gathered parameters (default: ``dtype``).
        grad_dtype: dtype of the flat gradient and its reduction (default: ``compute_dtype``).
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        slots: list[list[Slot]],
        group: Group,
        device: torch.device,
        pool: BufferPool,
        compute_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
    ) -> None:
        self.names = names
        self.pool = pool
        self.slots = slots
        self.group = group
        self.shapes = [p.shape for p in params]
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.dtype
        self.grad_dtype = grad_dtype or self.compute_dtype
        self.requires_grad = params[0].requires_grad
        self.layout = FlatLayout(tuple(p.numel() for p in params), group_size(group))
        rank = group_rank(group)
        self.pieces: tuple[LocalPiece, ...] = self.layout.local_pieces(rank)

        lo, hi = self.layout.shard_range(rank)
        self.shard: Tensor = torch.zeros(hi - lo, dtype=self.dtype, device=device)  # 1-D, padded/N
        with torch.no_grad():
            for p, offset, n in zip(params, self.layout.offsets, self.layout.numels):
                a, b = max(lo, offset), min(hi, offset + n)
                if a < b:
                    self.shard[a - lo : b - lo].copy_(
                        p.detach().reshape(-1)[a - offset : b - offset]
                    )
        self.shard_params = [
            nn.Parameter(
                self.shard[pc.shard_offset : pc.shard_offset + pc.numel], self.requires_grad
            )
            for pc in self.pieces
        ]

        # 1-D, padded numel, over one element of memory: the autograd leaf that stands for the full
        # parameters. Its gradient is the flat gradient (grad_dtype); the values live in a
        # pooled buffer (1-D, padded numel, compute_dtype) while gathered.
        self.full: Tensor = _unbacked(self.layout.padded_numel, self.grad_dtype, device)
        self.full.requires_grad_(self.requires_grad)
        self._buffer: Tensor | None = None

        self.views: list[Tensor] | None = None
        self.views_track_grad = False
        # Differentiable uses of the views whose backward has not run; at zero, backward is
        # done reading the gathered parameters (their gradients are not yet one flat tensor).
        self.splits_pending = 0
        self.on_views_done: Callable[[FlatGroup], None] | None = None
        self.gathered_version = -1
        # 1-D, padded/N: the buffer behind the shard params' .grad, while they use it.
        self._grad_flat: Callable[[], Tensor | None] = _dead_ref
        self._grad_views: list[Callable[[], Tensor | None]] = []

    # storage -------------------------------------------------------------------------

    def alloc_storage(self, dtype: torch.dtype) -> None:
        if self._buffer is not None and self._buffer.dtype != dtype:
            self.release()
        if self._buffer is None:
            self._buffer = self.pool.take(self, dtype)

    @property
    def full_data(self) -> Tensor:
        """The gathered flat buffer, outside autograd (only while gathered)."""
        if self._buffer is None:
            raise RuntimeError(f"flat group {self.names[:2]}... is not gathered")
        return self._buffer

    @property
    def is_allocated(self) -> bool:
        return self._buffer is not None

    def free_storage(self) -> None:
        if self._buffer is not None:
            self.pool.give(self._buffer)
            self._buffer = None

    @property
    def is_stale(self) -> bool:
        """True when the buffer does not hold the shards for compute: it is gathered in another
        dtype, or the shard changed (an optimizer step, a load) since the last gather."""
        return self.shard._version != self.gathered_version or (
            self._buffer is not None and self._buffer.dtype != self.compute_dtype
        )

    # gather --------------------------------------------------------------------------

    def gather(self, stats: CommStats | None, exact: bool = False) -> Pending:
        """All-gather the shards into the full buffer (asynchronously where possible).

        The buffer is in ``compute_dtype``, or with ``exact`` in the shards' own dtype.
        """
        self.alloc_storage(self.dtype if exact else self.compute_dtype)
        self.gathered_version = self.shard._version
        return all_gather(self._buffer, self.shard, self.group, stats)

    def make_views(self, track_grad: bool) -> None:
        """Shape the gathered buffer into the parameters and shadow the shard params with them."""
        track_grad = track_grad and self.requires_grad
        if self.views is not None and self.views_track_grad == track_grad:
            return
        if track_grad:
            self.splits_pending += 1
            self.views = list(_FullParams.apply(self.full, self._buffer, self))
        else:
            self.views = self.param_views()
        self.views_track_grad = track_grad
        for view, slots in zip(self.views, self.slots):
            for module, attr in slots:
                module.__dict__[attr] = view

    def param_views(self) -> list[Tensor]:
        """The gathered buffer shaped into the parameters, outside autograd."""
        return _param_views(self.full_data, self)

    def flat_grad(self, grads: tuple[Tensor | None, ...]) -> Tensor:
        """The parameters' gradients laid out flat in ``grad_dtype`` (zeros where none, and in
        the padding): one copy, which also casts."""
        flat = torch.empty(
            self.layout.padded_numel, dtype=self.grad_dtype, device=self.shard.device
        )
        for g, offset, n in zip(grads, self.layout.offsets, self.layout.numels):
            if g is None:
                flat[offset : offset + n].zero_()
            else:
                flat[offset : offset + n].copy_(g.reshape(-1))
        flat[self.layout.numel :].zero_()
        return flat

    def views_backward_done(self) -> None:
        """One autograd use of the views has its gradients: at the last, release the buffer."""
        self.splits_pending -= 1
        if self.splits_pending == 0 and self.on_views_done is not None:
            self.on_views_done(self)

    def drop_views(self) -> None:
        if self.views is None:
            return
        self.views = None
        for slots in self.slots:
            for module, attr in slots:
                module.__dict__.pop(attr, None)

    def release(self) -> None:
        """Drop the views and give the buffer back to the pool."""
        self.drop_views()
        self.free_storage()

    def write_back(self) -> None:
        """Copy this rank's range of the full buffer (gathered ``exact``) back into the shard."""
        lo, hi = self.layout.shard_range(group_rank(self.group))
        with torch.no_grad():
            self.shard.copy_(self.full_data[lo:hi])

    # gradients -----------------------------------------------------------------------

    def reduce_grad(self, stats: CommStats | None) -> tuple[Pending, Tensor, Tensor]:
        """Start reduce-scattering the flat gradient (zeros if none).

        Returns the collective in flight, its output (this rank's averaged shard) and its
        input, which must stay alive until the collective completes. Pass the output to
        :meth:`accumulate` once done.
        """
        grad = self.full.grad
        self.full.grad = None
        if grad is None:
            grad = torch.zeros(
                self.layout.padded_numel, dtype=self.grad_dtype, device=self.shard.device
            )
        out = torch.empty_like(self.shard, dtype=self.grad_dtype)
        return reduce_scatter(out, grad, self.group, stats), out, grad

    def accumulate(self, new: Tensor) -> None:
        """Add a reduced shard gradient to the shard params' ``.grad`` (set it if ``None``).

        The ``.grad`` tensors are views of one flat buffer, known here only weakly: once
        ``zero_grad()`` drops them, their memory is freed.
        """
        new = new.to(self.dtype)
        params = self.shard_params
        flat = self._grad_flat()
        if flat is not None and all(p.grad is v() for p, v in zip(params, self._grad_views)):
            flat.add_(new)
        elif all(p.grad is None for p in params):
            views = [new[pc.shard_offset : pc.shard_offset + pc.numel] for pc in self.pieces]
            for p, v in zip(params, views):
                p.grad = v
            self._grad_flat = weakref.ref(new)
            self._grad_views = [weakref.ref(v) for v in views]
        else:
            for p, pc in zip(params, self.pieces):
                piece = new[pc.shard_offset : pc.shard_offset + pc.numel]
                if p.grad is None:
                    p.grad = piece.clone()
                else:
                    p.grad.add_(piece)
            self._grad_flat, self._grad_views = _dead_ref, []


def _dead_ref() -> None:
    return None


def _unbacked(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D leaf of ``numel`` elements over one element of memory (stride 0).

    Only its size, dtype and gradient matter; autograd still takes a contiguous gradient
    returned for it as ``.grad`` without copying.
    """
    return torch.empty_strided((numel,), (0,), dtype=dtype, device=device)


def _param_views(buffer: Tensor, group: FlatGroup) -> list[Tensor]:
    return [
        buffer[offset : offset + n].view(shape)
        for offset, n, shape in zip(group.layout.offsets, group.layout.numels, group.shapes)
    ]


class _FullParams(torch.autograd.Function):
    """The full parameters as views of a gathered buffer, differentiable as the group's leaf.

    Forward shapes the buffer into the parameters; backward lays their gradients out flat
    as the gradient of ``full``, the group's one leaf, so that however many forwards used
    the group, one accumulator sums them. Backward is also the moment autograd stops
    reading the parameters: the buffer is released before the flat gradient is allocated.
    """

    @staticmethod
    def forward(ctx: Any, full: Tensor, buffer: Tensor, group: FlatGroup) -> tuple[Tensor, ...]:
        ctx.group = group
        return tuple(_param_views(buffer, group))

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, None, None]:
        group: FlatGroup = ctx.group
        group.views_backward_done()
        return group.flat_grad(grads), None, None


class Unit:
    """A wrapped module: its flat groups and their shared SHARDED <-> GATHERED state.

    Args:
        module: the wrapped module.
        index: position in the pre-order of units (the root is 0); the schedule orders
            collectives by it, identically on every rank.
        groups: the unit's flat groups (possibly none).
        stats: collective counters shared by the whole model.
    """

    def __init__(
        self, module: nn.Module, index: int, groups: list[FlatGroup], stats: CommStats
    ) -> None:
        self.module = module
        self.index = index
        self.groups = groups
        self.stats = stats
        self.state = ShardState.SHARDED
        self._pending: list[Pending] = []
        self.trainable = [g for g in groups if g.requires_grad]
        self.frozen = [g for g in groups if not g.requires_grad]

    @property
    def is_stale(self) -> bool:
        return any(g.is_stale for g in self.groups)

    def start_gather(self, exact: bool = False) -> None:
        """Issue the all-gathers; the unit is GATHERING until :meth:`finish_gather`.

        With ``exact`` the buffers hold the shards' own dtype rather than the compute dtype.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        self._pending = [g.gather(self.stats, exact) for g in self.groups]
        self.state = ShardState.GATHERING

    def finish_gather(self) -> None:
        for p in self._pending:
            p.wait()
        self._pending = []
        self.state = ShardState.GATHERED

    def use_full(self, track_grad: bool) -> None:
        """Make the module's attributes the full parameters (the unit must be gathered)."""
        if self.state is not ShardState.GATHERED:
            raise RuntimeError(f"unit {self.index} is {self.state.name}, expected GATHERED")
        for g in self.groups:
            g.make_views(track_grad)

    def reshard(self) -> None:
        """Release the full buffers; the module's attributes fall back to the shards."""
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        for g in self.groups:
            g.release()
        self.state = ShardState.SHARDED

    @contextmanager
    def readable(self, group: FlatGroup) -> Iterator[list[Tensor]]:
        """Yield ``group``'s full parameters in the shards' dtype, for reading outside forward.

        Gathers into a buffer of its own, leaving the unit's state as it was.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        buffer = group.pool.take(group, group.dtype)
        try:
            all_gather(buffer, group.shard, group.group, self.stats).wait()
            yield _param_views(buffer, group)
        finally:
            group.pool.give(buffer, keep=group.dtype == group.compute_dtype)

    def register_grad_hooks(self, on_grad: Callable[[Unit, FlatGroup], None]) -> None:
        """Call ``on_grad(unit, group)`` once a group's flat gradient is complete.

        The hooks live in autograd's C++ side, out of sight of Python's garbage collector,
        so they hold only weak references: a dropped model is freed.
        """
        unit_ref = weakref.ref(self)
        callback = weakref.WeakMethod(on_grad)  # type: ignore[arg-type]
        for i, g in enumerate(self.trainable):

            def hook(_full: Tensor, i: int = i) -> None:
                unit, fn = unit_ref(), callback()
                if unit is not None and fn is not None:
                    fn(unit, unit.trainable[i])

            g.full.register_post_accumulate_grad_hook(hook)
