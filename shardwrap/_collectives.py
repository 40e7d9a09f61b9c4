"""Collectives as free functions that take the process group explicitly.

Design note: ``group=None`` means world size 1 with no process group at all; every
collective then degenerates to a local copy, so a single process runs exactly the code
path of a sharded run. All collectives go through the group's own methods rather than
the global ``torch.distributed`` registry, which lets tests run ranks as threads, each
with its own group.

Backend quirks handled here:

- On CPU (gloo) gathers and reductions are direct point-to-point exchanges (see the note
  above ``_exchange_all_gather``): several times faster there than gloo's collectives, and
  independent of whether the release's gloo can average.
- Collectives return a :class:`Pending` whose ``wait()`` finishes the work (the division
  above, for one), so callers can overlap communication with compute.

Every collective adds its calls and bytes to an optional :class:`CommStats`, which the
benchmarks read.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveFailed",
    "failed",
    "CommStats",
    "Pending",
    "group_timeout",
    "all_gather",
    "all_reduce",
    "group_rank",
    "group_size",
    "reduce_scatter",
]

Group = dist.ProcessGroup | None


@dataclass
class CommStats:
    """Calls and bytes sent per collective kind, summed since the last :meth:`reset`."""

    calls: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        self.calls[kind] = self.calls.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + nbytes

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class CollectiveFailed(RuntimeError):
    """A collective did not complete: a peer stopped, stalled past the timeout, or is elsewhere."""


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and runs its epilogue.

    Raises:
        CollectiveFailed: from ``wait()``, when the backend gives up on the collective (a
            peer gone, or no answer within the group's timeout), naming the collective.
    """

    __slots__ = ("_work", "_then", "_what")

    def __init__(
        self, work: dist.Work | None, then: Callable[[], None] | None = None, what: str = ""
    ) -> None:
        self._work = work
        self._then = then
        self._what = what

    def wait(self) -> None:
        try:
            if self._work is not None:
                self._work.wait()
                self._work = None
            if self._then is not None:
                then, self._then = self._then, None
                then()
        except CollectiveFailed:
            raise
        except RuntimeError as e:
            raise failed(self._what, e) from e


def failed(what: str, error: BaseException) -> CollectiveFailed:
    """The error for a collective (``what``: "all-gather", "handshake", ...) the backend
    abandoned, with the backend's first line."""
    said = str(error).splitlines()[0] if str(error) else type(error).__name__
    return CollectiveFailed(
        f"shardwrap: the {what or 'collective'} did not complete: a rank stopped, stalled past "
        f"the process group's timeout, or is at another call (the backend said: {said}). See "
        "the other ranks' errors for what they were doing."
    )


def group_timeout(group: Group) -> timedelta | None:
    """The timeout ``group``'s backend bounds each collective with, if it can be read."""
    if group is None:
        return None
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 without a group)."""
    return 0 if group is None else group.rank()


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 without a group)."""
    return 1 if group is None else group.size()


def all_gather(out: Tensor, shard: Tensor, group: Group, stats: CommStats | None = None) -> Pending:
    """Gather every rank's ``shard`` into ``out`` (1-D, ``world_size * shard.numel()``).

    When ``out`` has another dtype, this rank's shard is cast straight into its own slot of
    ``out``, which then serves as the gather's input: the cast is the only copy. A shard that
    already is its slot of ``out`` is not copied.
    """
    if stats is not None:
        stats.add("all_gather", shard.numel() * out.element_size() * group_size(group))
    if group is None:
        if out.data_ptr() != shard.data_ptr() or out.dtype != shard.dtype:
            out.copy_(shard)
        return Pending(None)
    if shard.dtype != out.dtype:
        n = shard.numel()
        own = out[group.rank() * n : (group.rank() + 1) * n]
        own.copy_(shard)
        shard = own
    try:
        if shard.device.type == "cpu":
            return _exchange_all_gather(out, shard, group)
        # in place when shard is a slot of out
        return Pending(group._allgather_base(out, shard), what="all-gather")
    except RuntimeError as e:
        raise failed("all-gather", e) from e


def reduce_scatter(
    out: Tensor, full: Tensor, group: Group, stats: CommStats | None = None
) -> Pending:
    """Average ``full`` (1-D) over ranks and keep this rank's shard of the result in ``out``.

    ``full`` is scratch and may be overwritten.
    """
    if stats is not None:
        stats.add("reduce_scatter", full.numel() * full.element_size())
    if group is None:
        out.copy_(full)
        return Pending(None)
    try:
        if full.device.type == "cpu":
            return _exchange_reduce_scatter(out, full, group)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = dist.ReduceOp.AVG
        return Pending(group._reduce_scatter_base(out, full, opts), what="reduce-scatter")
    except RuntimeError as e:
        raise failed("reduce-scatter", e) from e


# Gloo: direct exchanges --------------------------------------------------------------
#
# NOTE: on gloo, point-to-point exchanges written straight into the destination beat the
# collectives: for a 50 MB flat buffer at 2 ranks, gathering took 21 ms wall and 13 ms of
# CPU against 81 ms and 60 ms for gloo's all-gather (which allocates and copies a buffer of
# its own), and reducing took 37 ms against 43 ms for an all-reduce plus slice and about
# 120 ms for gloo's reduce-scatter, sending half the bytes of the all-reduce. Every rank
# issues exchanges in the same order (the schedule sees to it), so a per-group counter gives
# matching tags; gloo keeps point-to-point tags apart from its collectives' own.

_tags: weakref.WeakKeyDictionary[dist.ProcessGroup, itertools.count] = weakref.WeakKeyDictionary()


def _next_tag(group: dist.ProcessGroup) -> int:
    """The next exchange tag of ``group``: the same sequence on every rank, for the group's life."""
    if group not in _tags:
        _tags[group] = itertools.count(1)
    return next(_tags[group]) % (1 << 31)


def _exchange_all_gather(out: Tensor, shard: Tensor, group: dist.ProcessGroup) -> Pending:
    rank, world, n = group.rank(), group.size(), shard.numel()
    tag = _next_tag(group)
    own = out[rank * n : (rank + 1) * n]
    if own.data_ptr() != shard.data_ptr():
        own.copy_(shard)
    if n == 0:
        return Pending(None)
    works = []
    for peer in _peers(rank, world):
        works.append(group.send([shard], peer, tag))
        works.append(group.recv([out[peer * n : (peer + 1) * n]], peer, tag))
    return Pending(None, lambda: _wait_all(works), what="all-gather")


def _exchange_reduce_scatter(out: Tensor, full: Tensor, group: dist.ProcessGroup) -> Pending:
    rank, world, n = group.rank(), group.size(), out.numel()
    tag = _next_tag(group)
    if n == 0:
        return Pending(None)
    sends = [
        group.send([full[peer * n : (peer + 1) * n]], peer, tag) for peer in _peers(rank, world)
    ]
    own = full[rank * n : (rank + 1) * n]
    if world == 2:
        recvs = [(group.recv([out], 1 - rank, tag), None)]
    else:
        buffers = [torch.empty_like(out) for _ in range(world - 1)]
        recvs = [(group.recv([b], peer, tag), b) for b, peer in zip(buffers, _peers(rank, world))]

    def finish() -> None:
        for work, buffer in recvs:
            work.wait()
            if buffer is not None:
                own.add_(buffer)
        if world == 2:
            out.add_(own)
        else:
            out.copy_(own)
        out.div_(world)
        _wait_all(sends)

    return Pending(None, finish, what="reduce-scatter")


def _peers(rank: int, world: int) -> list[int]:
    """Every other rank, starting after this one, so that no rank is everyone's first peer."""
    return [(rank + i) % world for i in range(1, world)]


def _wait_all(works: list[dist.Work]) -> None:
    for work in works:
        work.wait()


def all_reduce(
    tensor: Tensor,
    group: Group,
    op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
    stats: CommStats | None = None,
    kind: str = "all_reduce",
) -> Pending:
    """Reduce ``tensor`` in place over all ranks with ``op``; ``kind`` labels it in ``stats``."""
    if stats is not None:
        stats.add(kind, tensor.numel() * tensor.element_size())
    if group is None:
        return Pending(None)
    opts = dist.AllreduceOptions()
    opts.reduceOp = op
    what = kind.replace("_", "-")
    try:
        return Pending(group.allreduce([tensor], opts), what=what)
    except RuntimeError as e:
        raise failed(what, e) from e
