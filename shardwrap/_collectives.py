"""Collectives as free functions that take the process group explicitly.

Design note: ``group=None`` means world size 1 with no process group at all; every
collective then degenerates to a local copy, so a single process runs exactly the code
path of a sharded run. All collectives go through the group's own methods rather than
the global ``torch.distributed`` registry, which lets tests run ranks as threads, each
with its own group.

Backend quirks handled here:

- On CPU (gloo) a reduce-scatter is an in-place all-reduce of the scratch input followed by
  dividing this rank's slice into the output: faster there, and independent of whether the
  release's gloo supports AVG.
- Collectives return a :class:`Pending` whose ``wait()`` finishes the work (the division
  above, for one), so callers can overlap communication with compute.

Every collective adds its calls and bytes to an optional :class:`CommStats`, which the
benchmarks read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CommStats",
    "Pending",
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


class Pending:
    """A collective in flight; ``wait()`` blocks until it is done and runs its epilogue."""

    __slots__ = ("_work", "_then")

    def __init__(self, work: dist.Work | None, then: Callable[[], None] | None = None) -> None:
        self._work = work
        self._then = then

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


def group_rank(group: Group) -> int:
    """This process's rank in ``group`` (0 without a group)."""
    return 0 if group is None else group.rank()


def group_size(group: Group) -> int:
    """Number of ranks in ``group`` (1 without a group)."""
    return 1 if group is None else group.size()


def all_gather(out: Tensor, shard: Tensor, group: Group, stats: CommStats | None = None) -> Pending:
    """Gather every rank's ``shard`` into ``out`` (1-D, ``world_size * shard.numel()``)."""
    if stats is not None:
        stats.add("all_gather", shard.numel() * shard.element_size() * group_size(group))
    if group is None:
        out.copy_(shard)
        return Pending(None)
    return Pending(group._allgather_base(out, shard))


def reduce_scatter(out: Tensor, full: Tensor, group: Group, stats: CommStats | None = None) -> Pending:
    """Average ``full`` (1-D) over ranks and keep this rank's shard of the result in ``out``.

    ``full`` is scratch: on CPU it is overwritten with the sum over ranks.
    """
    world = group_size(group)
    if stats is not None:
        stats.add("reduce_scatter", full.numel() * full.element_size())
    if group is None:
        out.copy_(full)
        return Pending(None)
    if full.device.type == "cpu":
        # NOTE: gloo's reduce-scatter ran 1.5-2x slower than an in-place all-reduce of the
        # same buffer followed by a slice, at 2 and 4 ranks (50 MB, this project's CPU
        # machines); gloo also lacks AVG on some releases, so sum and divide.
        lo = group.rank() * out.numel()
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        work = group.allreduce([full], opts)
        return Pending(work, lambda: torch.div(full[lo : lo + out.numel()], world, out=out))
    opts = dist.ReduceScatterOptions()
    opts.reduceOp = dist.ReduceOp.AVG
    return Pending(group._reduce_scatter_base(out, full, opts))


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
    return Pending(group.allreduce([tensor], opts))
