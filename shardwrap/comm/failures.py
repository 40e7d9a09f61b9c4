"""When a collective fails: the errors shardwrap raises, and what they say.

Design note. A collective the backend gives up on raises :class:`CollectiveFailed` on this rank,
saying what it can: the collective; this rank's step and phase, as each sharded model on the
group reports them (:func:`report_whereabouts`; collectives stay free of models); the peers that
did not answer where that is known. Gloo's timeout names no peer ("Timed out waiting 5000ms for
recv operation to complete"), so they are known for exchanges (whose receives from a peer are
its own) and for a group of two; otherwise the message says so. An allocation that fails on
this rank inside a collective is this rank's own failure, not a peer's: it raises
:class:`OutOfMemoryInCollective`, a ``torch.OutOfMemoryError`` that says so.
"""

from __future__ import annotations

import errno
import weakref
from collections.abc import Iterable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveFailed",
    "Group",
    "OutOfMemoryInCollective",
    "failed",
    "group_timeout",
    "is_out_of_memory",
    "report_whereabouts",
]

Group = dist.ProcessGroup | None


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
