"""Edits to the full parameters outside forward: ``ShardedModule.gathered(writeback=True)``.

Design note. Inside ``gathered()`` every rank holds every parameter in full, and on exit each
rank copies back only its own shard's range. An edit the ranks did not all make alike (weights
loaded on rank 0 only) would reach only the ranks whose ranges it touched: a patchwork of old
and new values. So before anything is written back the ranks agree, in one small all-reduce:

1. whether any rank raised inside the block: then no rank writes anything back;
2. whose edits count: with ``modifier_rank`` that rank's full parameters are broadcast to every
   rank first (within its replicas, then within every shard group), so the edits of one rank
   reach all; without one, every rank must have made the same edits: a fingerprint of each
   parameter's bits is compared, and where one differs every rank raises, naming it, before
   anything is written.

With tensor parallelism each tp rank holds its own block of a split parameter: its fingerprint
is the sum of the blocks' over tp (one more small all-reduce), compared across the rest. A
``modifier_rank`` is refused there: one rank holds one block of each split parameter, so its
edits could not reach the others' (load whole weights with ``load_full_state_dict``).

Inside the block ``model.parameters()`` are still the pieces, and what writes through them (an
optimizer step, ``load_checkpoint``, ``p.zero_()``) writes the weights at once, unseen by the
full parameters. A write-back of every group would undo it without a word. So each group's
shard is marked when the block is entered (its version, and a fingerprint of this rank's range):
3. a group whose pieces were written is not written back; where its full parameters were
   edited too (this rank's range of them differs from the mark), every rank raises, naming it,
   and nothing is written back (one more small all-reduce, only where some rank wrote pieces).

A load through the module (``load_state_dict`` and kin) inside the block writes the full
parameters as well as the pieces and marks its groups afresh (:func:`write_through`): it counts
as an edit of the full parameters, so the block reads it and a ``modifier_rank``'s load reaches
every rank. A block inside another keeps the units gathered; its write-back marks every group
afresh for the outer block. While a block writes back, no gather may replace a group's full
parameters in another dtype (a forward under mixed precision): it raises instead, naming the
fix, since the block would write back rounded values.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.collectives import CommStats, all_reduce, broadcast
from ...comm.mesh import Mesh
from ..shards.flat_group import FlatGroup, views_of
from .full_grads import WITH_GRADS, drop_full_grads, show_full_grads

__all__ = [
    "Agreed",
    "EditMark",
    "agree_edits",
    "broadcast_from",
    "check_modifier_rank",
    "fingerprint",
    "gathered_block",
    "write_through",
]

_CHUNK = 1 << 20  # elements fingerprinted at a time: the int64 copy stays small
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_NONE = 1 << 62  # an int64 larger than any rank: "not me" in a MIN
_TP_HASH = 1 << 56  # a block's hashes are cut to this before summing: 64 tp ranks fit an int64


class EditMark(NamedTuple):
    """A flat group's shard as a ``gathered()`` block saw it last: its version, and a
    fingerprint of its values (this rank's range of the full buffer, as gathered)."""

    version: int
    print: tuple[int, int]


@contextmanager
def gathered_block(
    root: Any, writeback: bool, modifier_rank: int | None, with_grads: bool = False
) -> Iterator[None]:
    """``root``'s (the model's :class:`~shardwrap.engine.step.root.Root`, which imports this
    module) every unit gathered exactly and its full parameters exposed for the block, with
    their whole gradients as ``.grad`` where ``with_grads`` (``full_grads.py``); on exit, with
    ``writeback``, the edits the ranks agree on written back (see the note). A block inside
    another leaves the units gathered; its own edits are written back at its exit, with
    ``writeback``."""
    root.check_state()
    # the gathers below are paired by this one handshake
    root.schedule.enter(WITH_GRADS if with_grads else "gathered")
    groups = [g for u in root.units for g in u.groups]
    outer = not root.gathered_depth
    if outer:
        for unit in root.units:
            unit.reshard()  # a unit kept gathered holds the compute dtype; this needs the shards'
            unit.start_gather(exact=True)
            unit.finish_gather()
            unit.use_full(track_grad=False)
        root.own_calls.paused = True
        root.keeping += 1  # a forward inside (generate()) leaves the units gathered
    if writeback and root.edit_marks is None:
        root.edit_marks = [_mark(g) for g in groups]
        for g in groups:  # what is written back is never gathered again in another dtype
            g.exact_only = True
    root.gathered_depth += 1
    raised = True
    given_grads: list[Tensor] = []
    try:
        if with_grads:
            given_grads = show_full_grads(root, groups)
        yield
        raised = False
    finally:
        root.gathered_depth -= 1
        drop_full_grads(given_grads)
        try:
            if writeback:
                _write_back(root, groups, raised, modifier_rank)
        finally:
            if outer:
                root.edit_marks = None
                root.keeping -= 1
                root.own_calls.paused = False
                for g in groups:
                    g.exact_only = False
                for unit in root.units:
                    unit.reshard()


def write_through(root: Any, loaded: list[tuple[FlatGroup, int, Tensor]]) -> None:
    """Inside ``gathered()``, a load's whole values (group, index, value) written into the full
    parameters too, so that the block reads them and a write-back counts them as edits of the
    full parameters (a ``modifier_rank``'s reach every rank), not as writes to the pieces."""
    if not root.gathered_depth:
        return
    with torch.no_grad():
        for g, i, value in loaded:
            spec = g.specs[i]
            block = value if spec is None else spec.local_of(value)
            views_of(g.full_data, g)[i].copy_(block.reshape(g.shapes[i]))
    if root.edit_marks is not None:
        groups = [g for u in root.units for g in u.groups]
        touched = {id(g) for g, _, _ in loaded}
        root.edit_marks = [
            _mark(g) if id(g) in touched else m for g, m in zip(groups, root.edit_marks)
        ]


def _mark(g: FlatGroup) -> EditMark:
    return EditMark(g.shard._version, fingerprint(g.shard))


def _pieces_written(g: FlatGroup, mark: EditMark) -> bool:
    """Whether ``g``'s shard was written since ``mark`` through the pieces (an optimizer step,
    ``p.copy_``, ``load_checkpoint``); a fused optimizer's write is seen as marked stale."""
    return g.shard._version != mark.version or g.gathered_version == -1


def _write_back(
    root: Any, groups: list[FlatGroup], raised: bool, modifier_rank: int | None
) -> None:
    """Write back the full parameters' edits the ranks agree on, leaving alone each group
    whose pieces were written inside the block: those writes are the weights', and the full
    buffer does not hold them. A group written both ways raises on every rank."""
    assert root.edit_marks is not None
    written = [_pieces_written(g, m) for g, m in zip(groups, root.edit_marks)]
    agreed = _agreed(root, groups, raised, modifier_rank, any(written))
    if not agreed.write:
        return
    if agreed.pieces_written:
        clash = [  # this rank's range edited: unlike the mark, and unlike the pieces now
            name
            for g, w, m in zip(groups, written, root.edit_marks)
            if w and fingerprint(_own_range(g)) not in (m.print, fingerprint(g.shard))
            for name in g.names
        ]
        _agree_clash(root, clash)
    for g, w in zip(groups, written):
        if not w:
            g.write_back()
    if root.gathered_depth:  # inside another block, which goes on from here
        root.edit_marks = [_mark(g) for g in groups]


def _own_range(g: FlatGroup) -> Tensor:
    lo, hi = g.layout.shard_range(g.mesh.shard_rank)
    return g.full_data[lo:hi]


def _agree_clash(root: Any, clash: list[str]) -> None:
    """Raise on every rank where any rank's parameters were written both ways."""
    anyone = bool(clash)
    if root.mesh.world_size > 1:
        t = torch.tensor([-int(anyone)], dtype=torch.int64, device=root.mesh.control_device)
        all_reduce(t, root.mesh.control, dist.ReduceOp.MIN, root.stats).wait()
        anyone = t.item() < 0
    if anyone:
        where = ", ".join(clash[:4]) + ("..." if len(clash) > 4 else "") if clash else None
        raise ValueError(
            "gathered(writeback=True): inside the block some parameters were written both "
            "through model.parameters() (this rank's pieces: an optimizer step, p.copy_, "
            "load_checkpoint) and through the module's full parameters "
            f"({where or 'on another rank'}, or others in their flat groups); writing the full "
            "ones back would undo the pieces' writes. Nothing was written back; the pieces' "
            "writes stand. Write the full parameters (module attributes, load_state_dict) or "
            "the pieces inside one block, not both."
        )


class Agreed(NamedTuple):
    """What every rank agreed on leaving a ``gathered(writeback=True)`` block."""

    write: bool  # write back: no rank raised, and the edits agree
    pieces_written: bool  # some rank wrote pieces inside the block


def _agreed(
    root: Any,
    groups: list[FlatGroup],
    raised: bool,
    modifier_rank: int | None,
    written: bool,
) -> Agreed:
    """Whether to write back the edits made inside ``gathered()``; every rank agrees."""
    if root.mesh.world_size == 1:
        return Agreed(not raised, written)
    return agree_edits(groups, root.mesh, root.stats, raised, modifier_rank, written)


def check_modifier_rank(modifier_rank: int | None, writeback: bool | None, mesh: Mesh) -> bool:
    """Validate ``gathered()``'s arguments before any collective; returns whether edits are
    written back (``writeback=None``: where a ``modifier_rank`` is given).

    Raises:
        TypeError: a ``modifier_rank`` that is not an int.
        ValueError: one outside ``[0, world_size)``, given with ``writeback=False``, or with
            tensor parallelism.
    """
    world_size = mesh.world_size
    if modifier_rank is None:
        return bool(writeback)
    if mesh.tp is not None:
        raise ValueError(
            "gathered(modifier_rank=...) with tensor parallelism: each rank holds one block of "
            "each split parameter, so one rank's edits cannot reach the others'. Load whole "
            "weights with model.load_full_state_dict(sd) on every rank, or make the same edits "
            "on every rank inside gathered(writeback=True)."
        )
    if type(modifier_rank) is not int:
        raise TypeError(
            f"gathered(modifier_rank={modifier_rank!r}): the rank whose edits every rank takes "
            "is an int, e.g. model.gathered(modifier_rank=0)"
        )
    if not 0 <= modifier_rank < world_size:
        raise ValueError(
            f"gathered(modifier_rank={modifier_rank}): the model's ranks are 0 to "
            f"{world_size - 1}. Pass the rank that makes the edits, e.g. modifier_rank=0."
        )
    if writeback is False:
        raise ValueError(
            "gathered(writeback=False, modifier_rank=...): a modifier rank's edits are written "
            "back to every rank; drop writeback=False, or drop modifier_rank to discard edits."
        )
    return True


def agree_edits(
    groups: list[FlatGroup],
    mesh: Mesh,
    stats: CommStats,
    raised: bool,
    modifier_rank: int | None,
    written: bool = False,
) -> Agreed:
    """Agree, on every rank, what the ``gathered()`` block being left writes back (see the note
    above); with a ``modifier_rank``, broadcast its full parameters.

    Args:
        groups: every flat group, gathered exactly (``full_data`` in the shards' dtype).
        raised: whether this rank's block raised.
        written: whether this rank wrote pieces inside the block.

    Returns:
        Whether to write the full parameters back (``False`` where this rank raised), and
        whether any rank wrote pieces.

    Raises:
        RuntimeError: another rank raised inside the block (nothing is written back).
        ValueError: ranks passed different ``modifier_rank``s, or, without one, edited some
            parameter differently (naming it and the fix; nothing is written back).
    """
    me = mesh.rank
    modifier = -1 if modifier_rank is None else modifier_rank
    here = modifier_rank == me
    location = [mesh.shard_rank, mesh.replicate_rank] if here else [_NONE, _NONE]
    prints = [] if modifier_rank is not None else _fingerprints(groups, mesh, stats)
    header = [modifier, -modifier, -int(raised), -int(written), len(prints), -len(prints)]
    agreed = header + location + prints + [-h for h in prints]
    t = torch.tensor(agreed, dtype=torch.int64, device=mesh.control_device)
    all_reduce(t, mesh.control, dist.ReduceOp.MIN, stats).wait()
    low, neg_high, any_raised, any_written, n, neg_n, shard_at, replica_at, *rest = t.tolist()
    if low != -neg_high or n != -neg_n:
        raise ValueError(
            "gathered(): ranks passed different modifier_rank values; every rank must pass the "
            "same one (the rank whose edits every rank takes, or None where all edit alike)."
        )
    if any_raised < 0:
        if raised:
            return Agreed(False, any_written < 0)
        raise RuntimeError(
            "shardwrap: a rank raised inside model.gathered(writeback=True); no rank wrote its "
            "edits back, and the parameters are as they were before the block."
        )
    if modifier_rank is not None:
        for g in groups:
            broadcast_from(g.full_data, mesh, stats, shard_at, replica_at)
        return Agreed(True, any_written < 0)
    differ = _differing(groups, rest[: len(prints)], rest[len(prints) :])
    if differ:
        raise ValueError(
            "gathered(writeback=True): on leaving the block these parameters differ across "
            f"ranks: {', '.join(differ[:4])}{'...' if len(differ) > 4 else ''}; each rank "
            "would write back its own "
            "version of its range: a patchwork. Nothing was written back. To write one rank's "
            "edits (weights loaded on rank 0), pass gathered(modifier_rank=0); otherwise make "
            "the same edits on every rank."
        )
    return Agreed(True, any_written < 0)


def _fingerprints(groups: list[FlatGroup], mesh: Mesh, stats: CommStats) -> list[int]:
    """Every parameter's two hashes; a tp-split one's summed over the tp ranks' blocks."""
    hashes = [h for g in groups for view in g.param_views() for h in fingerprint(view)]
    split = [s.is_split for g in groups for s in g.splits for _ in range(2)]
    if mesh.tp is None or not any(split):
        return hashes
    blocks = [h % _TP_HASH if s else 0 for h, s in zip(hashes, split)]
    t = torch.tensor(blocks, dtype=torch.int64, device=mesh.device)  # NCCL takes no host tensor
    all_reduce(t, mesh.tp.get_group(), dist.ReduceOp.SUM, stats).wait()
    return [int(v) if s else h for v, h, s in zip(t.tolist(), hashes, split)]


def fingerprint(t: Tensor) -> tuple[int, int]:
    """Two 62-bit hashes of ``t``'s bits: their sum, and their sum weighted by position."""
    bits = t.reshape(-1).view(_BITS[t.element_size()])
    total = weighted = 0
    for start in range(0, bits.numel(), _CHUNK):
        chunk = bits[start : start + _CHUNK].to(torch.int64)
        place = torch.arange(start + 1, start + 1 + chunk.numel(), device=chunk.device)
        total += int(chunk.sum())
        weighted += int((chunk * place).sum())
    return total % (1 << 62), weighted % (1 << 62)


def _differing(groups: list[FlatGroup], low: list[int], neg_high: list[int]) -> list[str]:
    names = [n for g in groups for n in g.names]
    return [
        name
        for i, name in enumerate(names)
        if low[2 * i] != -neg_high[2 * i] or low[2 * i + 1] != -neg_high[2 * i + 1]
    ]


def broadcast_from(
    buffer: Tensor, mesh: Mesh, stats: CommStats, shard_at: int, replica_at: int
) -> None:
    """Copy the full ``buffer`` of the rank at (``shard_at``, ``replica_at``) to every rank."""
    if mesh.replicate is not None and mesh.shard_rank == shard_at:
        broadcast(buffer, mesh.replicate, replica_at, stats).wait()
    broadcast(buffer, mesh.shard, shard_at, stats).wait()
