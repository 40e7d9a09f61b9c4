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

A collective the backend gives up on raises :class:`CollectiveFailed` on this rank, saying
what it can: the collective; this rank's step and phase, as each sharded model on the group
reports them (:func:`report_whereabouts`; collectives stay free of models); the peers that did
not answer where that is known. Gloo's timeout names no peer ("Timed out waiting 5000ms for
recv operation to complete"), so they are known for exchanges (whose receives from a peer are
its own) and for a group of two; otherwise the message says so. An allocation that fails on
this rank inside a collective is this rank's own failure, not a peer's: it raises
:class:`OutOfMemoryInCollective`, a ``torch.OutOfMemoryError`` that says so.
"""

from __future__ import annotations

import errno
import itertools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveFailed",
    "OutOfMemoryInCollective",
    "is_out_of_memory",
    "failed",
    "CommStats",
    "Pending",
    "group_timeout",
    "all_gather",
    "all_gather_many",
    "all_reduce",
    "packing",
    "group_rank",
    "group_size",
    "reduce_scatter",
    "reduce_scatter_many",
    "report_whereabouts",
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
    """A collective did not complete: a peer stopped, stalled past the timeout, or is elsewhere.

    Attributes:
        collective: which one: "all-gather", "reduce-scatter", "handshake", "all-reduce",
            "all-to-all".
        rank: this rank (in the default group where the group is registered there).
        doing: this rank's step and phase, e.g. "in the backward of forward pass 3", or
            ``None`` where no sharded model uses the group.
        silent: the peer ranks that did not answer, or ``None`` where that is not known.
    """

    collective: str = ""
    rank: int = 0
    doing: str | None = None
    silent: list[int] | None = None


class OutOfMemoryInCollective(torch.OutOfMemoryError):
    """This rank ran out of memory itself inside a collective: no peer failed. A
    ``torch.OutOfMemoryError``, so code that catches those (to skip a batch, say) catches it.
    Its ``collective``, ``rank`` and ``doing`` are :class:`CollectiveFailed`'s."""

    collective: str = ""
    rank: int = 0
    doing: str | None = None


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation that failed on this rank: ``MemoryError``, a
    ``torch.OutOfMemoryError``, ``ENOMEM``, or torch's CPU allocator refusing (a
    ``RuntimeError``, where a GPU's is a ``torch.OutOfMemoryError``)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    if isinstance(error, OSError) and error.errno == errno.ENOMEM:
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "can't allocate memory" in text or "Cannot allocate memory" in text
    )


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and runs its epilogue.

    Raises:
        CollectiveFailed: from ``wait()``, when the backend gives up on the collective (a
            peer gone, or no answer within the group's timeout), naming the collective, this
            rank's step and phase and, where known, the peers that did not answer.
    """

    __slots__ = ("_work", "_then", "_what", "_group")

    def __init__(
        self,
        work: dist.Work | None,
        then: Callable[[], None] | None = None,
        what: str = "",
        group: Group = None,
    ) -> None:
        self._work = work
        self._then = then
        self._what = what
        self._group = group

    def wait(self) -> None:
        try:
            if self._work is not None:
                self._work.wait()
                self._work = None
            if self._then is not None:
                then, self._then = self._then, None
                then()
        except (CollectiveFailed, OutOfMemoryInCollective):
            raise
        except RuntimeError as e:
            raise failed(self._what, e, self._group) from e


# What each live sharded model on a group is doing, for the message of a collective that fails
# there: objects with a ``whereabouts() -> str`` method (a model's ``Mesh``), held weakly.
_REPORTERS: weakref.WeakKeyDictionary[dist.ProcessGroup, weakref.WeakSet[Any]] = (
    weakref.WeakKeyDictionary()
)


def report_whereabouts(reporter: Any, groups: Iterable[Group]) -> None:
    """Have a collective that fails on any of ``groups`` say ``reporter.whereabouts()``."""
    for group in groups:
        if group is not None:
            _REPORTERS.setdefault(group, weakref.WeakSet()).add(reporter)


def failed(
    what: str, error: BaseException, group: Group = None, silent: list[int] | None = None
) -> CollectiveFailed | OutOfMemoryInCollective:
    """The error for a collective (``what``: "all-gather", "handshake", ...) the backend
    abandoned on ``group``: this rank's step and phase, the peers that did not answer
    (``silent``, group ranks, where known: the peers of a point-to-point exchange it waited
    on; the other rank of a group of two), the group's timeout and the backend's first line.
    An allocation that failed on this rank (:func:`is_out_of_memory`) is this rank's own: an
    :class:`OutOfMemoryInCollective` that says so, naming no peer.
    """
    said = str(error).splitlines()[0] if str(error) else type(error).__name__
    rank, doing, timeout = 0, None, None
    if group is not None:
        rank, timeout = _global_rank(group, group.rank()), group_timeout(group)
        texts = sorted(r.whereabouts() for r in _REPORTERS.get(group, ()))
        doing = "; ".join(texts) or None
    if is_out_of_memory(error):
        own = OutOfMemoryInCollective(
            f"shardwrap: rank {rank} ran out of memory in the {what or 'collective'} "
            f"({doing or 'in no sharded model: none uses this group'}): its own allocation "
            "failed there, no peer did, and the other ranks will report that it did not answer. "
            "Free memory on this rank (a smaller batch or sequence, activation checkpointing, "
            f"an offload tier), then run again. The allocator said: {said}"
        )
        own.collective, own.rank, own.doing = what, rank, doing
        return own
    if group is not None:
        if silent is None and group.size() == 2:
            silent = [1 - group.rank()]
        if silent is not None:
            silent = [_global_rank(group, r) for r in silent]
    if silent:
        who = f"rank{'s' if len(silent) > 1 else ''} {', '.join(map(str, silent))} did not answer"
    else:
        who = "which rank did not answer is unknown (the backend does not say)"
    raised = CollectiveFailed(
        f"shardwrap: the {what or 'collective'} did not complete on rank {rank} "
        f"({doing or 'in no sharded model: none uses this group'}): {who}. A rank stopped, "
        "stalled past the process group's timeout "
        f"({timeout if timeout is not None else 'unknown'}), or is at another call; see the "
        f"other ranks' errors for what they were doing. The backend said: {said}"
    )
    raised.collective, raised.rank, raised.doing, raised.silent = what, rank, doing, silent
    return raised


def _global_rank(group: dist.ProcessGroup, rank: int) -> int:
    """``rank`` of ``group`` in the default group, where ``group`` is registered there."""
    try:
        return dist.get_global_rank(group, rank)
    except (ValueError, RuntimeError):
        return rank


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
        return Pending(group._allgather_base(out, shard), what="all-gather", group=group)
    except RuntimeError as e:
        raise failed("all-gather", e, group) from e


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
        work = group._reduce_scatter_base(out, full, opts)
        return Pending(work, what="reduce-scatter", group=group)
    except RuntimeError as e:
        raise failed("reduce-scatter", e, group) from e


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
    peers = _peers(rank, world)
    sends = [(peer, group.send([shard], peer, tag)) for peer in peers]
    recvs = [(peer, group.recv([out[peer * n : (peer + 1) * n]], peer, tag)) for peer in peers]
    return Pending(None, _finisher(recvs, sends, group, "all-gather"), "all-gather", group)


def _exchange_reduce_scatter(out: Tensor, full: Tensor, group: dist.ProcessGroup) -> Pending:
    rank, world, n = group.rank(), group.size(), out.numel()
    tag = _next_tag(group)
    if n == 0:
        return Pending(None)
    peers = _peers(rank, world)
    sends = [(peer, group.send([full[peer * n : (peer + 1) * n]], peer, tag)) for peer in peers]
    own = full[rank * n : (rank + 1) * n]
    # At two ranks the one peer's piece lands in ``out`` itself; otherwise in buffers of its own.
    buffers = [out] if world == 2 else [torch.empty_like(out) for _ in peers]
    recvs = [(peer, group.recv([b], peer, tag)) for b, peer in zip(buffers, peers)]

    def finish() -> None:
        for i, (peer, work) in enumerate(recvs):
            _wait(work, peer, recvs[i + 1 :], group, "reduce-scatter")
            if world > 2:
                own.add_(buffers[i])
        if world == 2:
            out.add_(own)
        else:
            out.copy_(own)
        out.div_(world)
        for peer, work in sends:
            _wait(work, peer, [], group, "reduce-scatter")

    return Pending(None, finish, what="reduce-scatter", group=group)


# Several at once -----------------------------------------------------------------------
#
# NOTE: on gloo every exchange costs its peers several thread wake-ups each, which on a busy CPU
# take a millisecond or two whatever the size: measured at 2 ranks on 2 cores
# (benchmarks/exchange_latency.py), with 2 ms of compute between exchanges, one of 3 KB cost 1.6 ms
# and one of 200 KB 1.8 ms (0.14 and 0.20 ms back to back). Small buffers therefore go packed, one
# exchange per peer for all of them; the packing costs a copy of each, and its buffers hold as many
# bytes as the full buffers (see ``packing``). On other backends each collective goes out on its
# own.

ALIGN = 16  # bytes: every packed item starts at a multiple of this, so it can be viewed typed


def packing(nbytes: Iterable[int]) -> tuple[list[int], int]:
    """Where each item of ``nbytes`` bytes starts in a packed buffer, and the buffer's size."""
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def all_gather_many(
    outs: list[Tensor], shards: list[Tensor], group: Group, stats: CommStats | None = None
) -> Pending:
    """``all_gather(outs[i], shards[i])`` for every ``i``, as one exchange per peer on gloo.

    Counted as one all-gather in ``stats``. Every rank passes the same sizes and dtypes.
    """
    if len(outs) == 1:
        return all_gather(outs[0], shards[0], group, stats)
    if stats is not None:
        stats.add("all_gather", sum(o.numel() * o.element_size() for o in outs))
    if group is None or shards[0].device.type != "cpu":
        pendings = [all_gather(o, s, group) for o, s in zip(outs, shards)]
        return Pending(None, lambda: _wait_all(pendings))
    rank, world = group.rank(), group.size()
    owns = []
    for out, shard in zip(outs, shards):
        n = shard.numel()
        own = out[rank * n : (rank + 1) * n]
        if own.data_ptr() != shard.data_ptr() or own.dtype != shard.dtype:
            own.copy_(shard)
        owns.append(own)
    offsets, total = packing(o.numel() * o.element_size() for o in owns)
    if total == 0:
        return Pending(None)
    packed = torch.empty(total, dtype=torch.uint8)
    for own, at in zip(owns, offsets):
        packed[at : at + own.numel() * own.element_size()].copy_(own.view(torch.uint8))
    peers = _peers(rank, world)
    received, exchange = _exchange_packed(group, dict.fromkeys(peers, packed), "all-gather")

    def finish() -> None:
        exchange()
        for peer, data in received.items():
            for out, own, at in zip(outs, owns, offsets):
                n = own.numel()
                out[peer * n : (peer + 1) * n].view(torch.uint8).copy_(
                    data[at : at + n * own.element_size()]
                )

    return Pending(None, finish, "all-gather", group)


def reduce_scatter_many(
    outs: list[Tensor], fulls: list[Tensor], group: Group, stats: CommStats | None = None
) -> Pending:
    """``reduce_scatter(outs[i], fulls[i])`` for every ``i``, as one exchange per peer on gloo,
    summing in the same order as each alone does (so the results are the same bit for bit).

    Counted as one reduce-scatter in ``stats``. ``fulls`` are scratch and may be overwritten.
    """
    if len(outs) == 1:
        return reduce_scatter(outs[0], fulls[0], group, stats)
    if stats is not None:
        stats.add("reduce_scatter", sum(f.numel() * f.element_size() for f in fulls))
    if group is None or fulls[0].device.type != "cpu":
        pendings = [reduce_scatter(o, f, group) for o, f in zip(outs, fulls)]
        return Pending(None, lambda: _wait_all(pendings))
    rank, world = group.rank(), group.size()
    offsets, total = packing(o.numel() * o.element_size() for o in outs)
    if total == 0:
        return Pending(None)
    peers = _peers(rank, world)
    packs: dict[int, Tensor] = {}
    for peer in peers:
        pack = packs[peer] = torch.empty(total, dtype=torch.uint8)
        for out, full, at in zip(outs, fulls, offsets):
            n = out.numel()
            pack[at : at + n * out.element_size()].copy_(
                full[peer * n : (peer + 1) * n].view(torch.uint8)
            )
    received, exchange = _exchange_packed(group, packs, "reduce-scatter")

    def finish() -> None:
        exchange()
        for out, full, at in zip(outs, fulls, offsets):
            n = out.numel()
            if n == 0:
                continue
            pieces = [received[p][at : at + n * out.element_size()].view(out.dtype) for p in peers]
            own = full[rank * n : (rank + 1) * n]
            if world == 2:  # as reduce_scatter: the peer's piece, then the own one added
                out.copy_(pieces[0]).add_(own)
            else:
                for piece in pieces:
                    own.add_(piece)
                out.copy_(own)
            out.div_(world)

    return Pending(None, finish, "reduce-scatter", group)


def _exchange_packed(
    group: dist.ProcessGroup, packs: dict[int, Tensor], what: str
) -> tuple[dict[int, Tensor], Callable[[], None]]:
    """Send ``packs[peer]`` to each peer and receive as many bytes from it; returns the buffers
    that receive, by peer, and what waits for the whole exchange."""
    tag = _next_tag(group)
    try:
        sends = [(peer, group.send([pack], peer, tag)) for peer, pack in packs.items()]
        received = {peer: torch.empty_like(pack) for peer, pack in packs.items()}
        recvs = [(peer, group.recv([received[peer]], peer, tag)) for peer in packs]
    except RuntimeError as e:
        raise failed(what, e, group) from e
    return received, _finisher(recvs, sends, group, what)


def _wait_all(pendings: list[Pending]) -> None:
    for p in pendings:
        p.wait()


def all_to_all(
    outs: list[Tensor], ins: list[Tensor], group: Group, stats: CommStats | None = None
) -> Pending:
    """Send ``ins[q]`` to rank ``q`` and receive rank ``q``'s into ``outs[q]`` (1-D each).

    Sizes may differ from peer to peer; both sides know them, and empty ones are not sent.
    This rank's own slot is not exchanged.
    """
    if group is None:
        return Pending(None)
    rank, world = group.rank(), group.size()
    if stats is not None:
        sent = sum(t.numel() * t.element_size() for q, t in enumerate(ins) if q != rank)
        stats.add("all_to_all", sent)
    try:
        if ins[rank].device.type != "cpu":
            mine = torch.empty(0, dtype=outs[rank].dtype, device=outs[rank].device)
            work = group.alltoall(
                [mine if q == rank else t for q, t in enumerate(outs)],
                [mine if q == rank else t for q, t in enumerate(ins)],
                dist.AllToAllOptions(),
            )
            return Pending(work, what="all-to-all", group=group)
        tag = _next_tag(group)
        peers = _peers(rank, world)
        sends = [(q, group.send([ins[q]], q, tag)) for q in peers if ins[q].numel()]
        recvs = [(q, group.recv([outs[q]], q, tag)) for q in peers if outs[q].numel()]
    except RuntimeError as e:
        raise failed("all-to-all", e, group) from e
    return Pending(None, _finisher(recvs, sends, group, "all-to-all"), "all-to-all", group)


def _finisher(
    recvs: list[tuple[int, dist.Work]],
    sends: list[tuple[int, dist.Work]],
    group: dist.ProcessGroup,
    what: str,
) -> Callable[[], None]:
    """The end of a point-to-point exchange: wait for every receive, then every send."""

    def finish() -> None:
        for i, (peer, work) in enumerate(recvs):
            _wait(work, peer, recvs[i + 1 :], group, what)
        for peer, work in sends:
            _wait(work, peer, [], group, what)

    return finish


def _peers(rank: int, world: int) -> list[int]:
    """Every other rank, starting after this one, so that no rank is everyone's first peer."""
    return [(rank + i) % world for i in range(1, world)]


def _wait(
    work: dist.Work,
    peer: int,
    later: list[tuple[int, dist.Work]],
    group: dist.ProcessGroup,
    what: str,
) -> None:
    """Wait for a send to or receive from ``peer``. If the backend gives up on it, the error
    names ``peer`` and each peer of the receives in ``later`` whose data has not arrived."""
    try:
        work.wait()
    except RuntimeError as e:
        silent = {peer} | {q for q, w in later if not _arrived(w)}
        raise failed(what, e, group, sorted(silent)) from e


def _arrived(receive: dist.Work) -> bool:
    """Whether a receive's data is here (asked after a peer's timeout: every live peer sent
    long ago, so a short wait tells; NOTE: gloo closes the pair on a timeout)."""
    try:
        receive.wait(timedelta(milliseconds=50))
    except RuntimeError:
        return False
    return True


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
        return Pending(group.allreduce([tensor], opts), what=what, group=group)
    except RuntimeError as e:
        raise failed(what, e, group) from e
