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
- Reductions on CPU add the ranks' pieces in rank order, one order for every element
  (``_sum_in_rank_order``); on other backends the backend picks the order.
- A complex tensor reaches the backend's own collectives as its real and imaginary parts
  (``_wire``): NCCL has no complex type.

Every collective adds its calls and bytes to an optional :class:`CommStats`, which the
benchmarks read.

A collective the backend gives up on raises :class:`~shardwrap.comm.failures.CollectiveFailed`
(or, where this rank's own allocation failed, ``OutOfMemoryInCollective``), from
``comm/failures.py``.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from .failures import CollectiveFailed, Group, OutOfMemoryInCollective, failed

__all__ = [
    "CommStats",
    "Pending",
    "all_gather",
    "all_gather_many",
    "all_reduce",
    "as_sent",
    "broadcast",
    "divides_first",
    "packing",
    "group_rank",
    "group_size",
    "reduce_scatter",
    "reduce_scatter_many",
]


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


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 without a group)."""
    return 0 if group is None else group.rank()


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 without a group)."""
    return 1 if group is None else group.size()


def as_sent(t: Tensor) -> Tensor:
    """``t`` as a collective carries it: a float8 tensor's bytes (gloo sends no float8, and
    torch sums none), a complex one's real and imaginary parts, any other tensor itself."""
    return t.view(torch.uint8) if t.is_floating_point() and t.element_size() == 1 else _wire(t)


def _wire(t: Tensor) -> Tensor:
    """``t`` as a backend's own collective takes it: a complex tensor as its real and imaginary
    parts (NCCL has no complex type), which sum and average as the complex values do."""
    return torch.view_as_real(t) if t.is_complex() else t


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
        work = group._allgather_base(_wire(out), _wire(shard))
        return Pending(work, what="all-gather", group=group)
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
        work = group._reduce_scatter_base(_wire(out), _wire(full), opts)
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


def divides_first(dtype: torch.dtype) -> bool:
    """Whether an average over ranks in ``dtype`` divides each rank's part before the sum:
    float16's, whose sum of the ranks' gradients can overflow where their average fits (the
    divide is exact at a power-of-two world size, but for subnormals)."""
    return dtype == torch.float16


def _exchange_reduce_scatter(out: Tensor, full: Tensor, group: dist.ProcessGroup) -> Pending:
    rank, world, n = group.rank(), group.size(), out.numel()
    tag = _next_tag(group)
    if n == 0:
        return Pending(None)
    first = divides_first(full.dtype)
    if first:
        full.div_(world)
    peers = _peers(rank, world)
    sends = [(peer, group.send([full[peer * n : (peer + 1) * n]], peer, tag)) for peer in peers]
    own = full[rank * n : (rank + 1) * n]
    # At two ranks the one peer's piece lands in ``out`` itself; otherwise in buffers of its own.
    buffers = [out] if world == 2 else [torch.empty_like(out) for _ in peers]
    recvs = [(peer, group.recv([b], peer, tag)) for b, peer in zip(buffers, peers)]

    def finish() -> None:
        if world == 2:  # a + b is b + a: any order is the rank order
            _wait(recvs[0][1], peers[0], [], group, "reduce-scatter")
            out.add_(own)
        else:
            by_rank = sorted(recvs, key=lambda r: r[0])
            waits = {peer: (work, by_rank[i + 1 :]) for i, (peer, work) in enumerate(by_rank)}

            def arrive(peer: int) -> None:
                work, later = waits[peer]
                _wait(work, peer, later, group, "reduce-scatter")

            out.copy_(_sum_in_rank_order(rank, own, dict(zip(peers, buffers)), arrive))
        if not first:
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
    for full in fulls:
        if divides_first(full.dtype):
            full.div_(world)
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
                out.copy_(_sum_in_rank_order(rank, own, dict(zip(peers, pieces))))
            if not divides_first(out.dtype):
                out.div_(world)

    return Pending(None, finish, "reduce-scatter", group)


def _sum_in_rank_order(
    rank: int,
    own: Tensor,
    pieces: dict[int, Tensor],
    arrive: Callable[[int], None] = lambda peer: None,
) -> Tensor:
    """``own`` (this rank's piece) plus every peer's piece, added in rank order 0, 1, ..., N-1.

    Floating-point addition is not associative: the order decides the last bits of a sum. In
    one order for all, every element sums alike whichever rank's shard holds it, and as a plain
    model's gradient accumulated over the ranks' slices in rank order does. NOTE: those bits
    matter: Muon's bfloat16 Newton-Schulz iteration turned them into 1.6e-3 in a matrix after
    four steps at ``lr=0.02`` on 4 ranks (docs/optimizers.md). ``arrive(peer)`` waits for
    ``pieces[peer]`` just before it is added. Adds into the first term: ``own`` and the pieces
    are scratch.
    """
    total: Tensor | None = None
    for q in range(len(pieces) + 1):
        if q != rank:
            arrive(q)
        term = own if q == rank else pieces[q]
        total = term if total is None else total.add_(term)
    assert total is not None
    return total


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
                [_wire(mine if q == rank else t) for q, t in enumerate(outs)],
                [_wire(mine if q == rank else t) for q, t in enumerate(ins)],
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


def broadcast(tensor: Tensor, group: Group, root: int, stats: CommStats | None = None) -> Pending:
    """Copy ``tensor`` from the rank ``root`` of ``group`` to every rank of it, in place."""
    if stats is not None:
        stats.add("broadcast", tensor.numel() * tensor.element_size())
    if group is None:
        return Pending(None)
    opts = dist.BroadcastOptions()
    opts.rootRank = root
    try:
        return Pending(group.broadcast([_wire(tensor)], opts), what="broadcast", group=group)
    except RuntimeError as e:
        raise failed("broadcast", e, group) from e


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
        return Pending(group.allreduce([_wire(tensor)], opts), what=what, group=group)
    except RuntimeError as e:
        raise failed(what, e, group) from e
