"""Buckets: several small units' gathers, or several groups' reductions, as one exchange.

Design note. On a backend that pays per message (gloo: about a millisecond of thread wake-ups
per exchange on a busy CPU, whatever its size; see ``comm/collectives.py``) a model of small
units spends its step on messages, not bytes. So consecutive units whose gathered buffers fit
in the model's bucket (``ShardedModule(bucket_mb=...)``) are gathered in one exchange, and
consecutive groups whose flat gradients fit in it are reduced in one. Which units and groups
share a bucket depends only on what every rank knows alike (the agreed forward plan or unit,
the canonical order of reductions, sizes), so every rank issues the same exchanges:

- forward: the next gathers of the agreed plan (``engine/step/schedule.py``), from the one wanted;
  without a plan (a pass's first, generation), the unit wanted and the units after it in the
  order of units;
- backward: the unit wanted, then the units before it in the order of units (the reverse
  of the usual order of forward, so usually the next ones backward needs), down to unit 1
  (the root is gathered from its forward to its backward);
- reductions: consecutive groups in the canonical order, issued once all are ready.

A unit a bucket gathers early stays gathered until its own forward or backward releases it (or
the end of backward does). The units of a forward's final bucket stay gathered for backward,
which starts with them (as the unit that runs last in forward does without buckets): a model
whose units fit in one bucket gathers nothing in backward. Within a bucket, a
group that would take it over the limit (a large one), or whose gather is quantized, is
gathered on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import Tensor

from .collectives import CommStats, Group, Pending, all_gather, all_gather_many

__all__ = ["Gathers", "bucket_ends", "bucket_size", "last_bucket"]


def bucket_size(candidates: Sequence[int], nbytes: Callable[[int], int], limit: int) -> int:
    """How many of ``candidates`` (at least the first) share one bucket: the first, then each
    next one while the bucket's bytes stay within ``limit`` and no candidate repeats."""
    total, taken = nbytes(candidates[0]), {candidates[0]}
    for c in candidates[1:]:
        total += nbytes(c)
        if total > limit or c in taken:
            break
        taken.add(c)
    return len(taken)


def bucket_ends(nbytes: Sequence[int], limit: int) -> dict[int, int]:
    """Consecutive buckets of items of ``nbytes`` bytes each, in order: where the bucket
    beginning at each bucket's first position ends (``limit`` 0: one item each)."""
    ends: dict[int, int] = {}
    start = 0
    while start < len(nbytes):
        ends[start] = start + bucket_size(range(start, len(nbytes)), nbytes.__getitem__, limit)
        start = ends[start]
    return ends


def last_bucket(plan: Sequence[int], nbytes: Callable[[int], int], limit: int) -> list[int]:
    """The final bucket of ``plan`` (unit indices) issued bucket by bucket from its start."""
    at, bucket = 0, []
    while at < len(plan):
        count = bucket_size(plan[at:], nbytes, limit)
        bucket, at = list(plan[at : at + count]), at + count
    return bucket


class Gathers:
    """Plain all-gathers collected for one exchange of at most ``limit`` bytes of full buffers.

    :meth:`add` each gather, then :meth:`issue` them all; a gather that would take the exchange
    over ``limit`` goes out on its own as it is added. Every rank adds the same gathers in the
    same order.
    """

    def __init__(self, stats: CommStats | None, limit: int) -> None:
        self.stats = stats
        self.limit = limit
        self._outs: list[Tensor] = []
        self._shards: list[Tensor] = []
        self._then: list[Callable[[], None]] = []
        self._group: Group = None
        self._nbytes = 0
        self._pending: Pending | None = None

    def add(
        self, out: Tensor, shard: Tensor, group: Group, then: Callable[[], None] | None = None
    ) -> Pending:
        """Gather ``shard`` from every rank into ``out`` with the others (see ``all_gather``);
        ``then`` runs once the exchange is done (when it goes alone: on its wait)."""
        nbytes = out.numel() * out.element_size()
        if self._nbytes + nbytes > self.limit:
            return all_gather(out, shard, group, self.stats)
        self._outs.append(out)
        self._shards.append(shard)
        if then is not None:
            self._then.append(then)
        self._group = group
        self._nbytes += nbytes
        return Pending(None, self.wait)

    def issue(self) -> None:
        """Start the exchange of every gather added (none: nothing)."""
        if self._outs:
            self._pending = all_gather_many(self._outs, self._shards, self._group, self.stats)

    def wait(self) -> None:
        """Wait for the exchange, then run every gather's ``then``; once."""
        if self._pending is None:
            return
        self._pending.wait()
        self._pending = None
        then, self._then = self._then, []
        for fn in then:
            fn()
