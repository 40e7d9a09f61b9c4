"""Who owns what in a whole-parameter step (``whole_params.py``): each shard parameter's pieces
and owner rank, and per shard group what each rank sends and receives. Pure bookkeeping: every
rank, and the memory planner (``owners``), computes the same from the same sizes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .pieces import PIECE_ATTR
from .shard_grad import shard_grad_owner

__all__ = ["BALANCE", "Entry", "Plan", "held", "make_entries", "make_plans", "owners", "span"]

BALANCE = 1.1  # no rank owns more than this times an even split (but for one parameter)


@dataclass
class Entry:
    """One shard parameter the optimizer steps, and where its pieces are."""

    param: nn.Parameter
    split: Any  # its whole shape and tp blocks: a Split (engine/shards/split.py, a room apart)
    pieces: list[tuple[int, int]]  # per rank of ``group``: [start, stop) in stacked order
    grad_owner: Any  # what types its whole gradient on the owner (``as_shard_grad``)
    group: Any  # the ranks among which it has an owner: the shard group, or shard x tp
    rank: int  # this rank's index in ``group``
    owner: int = 0

    @property
    def numel(self) -> int:
        return self.split.numel

    @property
    def shape(self) -> tuple[int, ...]:
        return self.split.shape


@dataclass
class Plan:
    """Who owns what over one shard group, for one dtype and one gradient dtype."""

    group: Any  # the process group (None: one rank)
    rank: int
    world: int
    dtype: torch.dtype
    grad_dtype: torch.dtype  # the gradients' (a parameter's ``grad_dtype`` may differ)
    device: torch.device  # where the parameters' pieces are, and their whole values are made
    wire: torch.device  # where the exchange's buffers are: the group's compute device
    entries: list[Entry]
    stats: Any = None  # the model's CommStats: the exchange counts as "all_to_all"
    sends: list[list[Entry]] = field(default_factory=list)  # per peer: its params I hold
    recvs: list[list[Entry]] = field(default_factory=list)  # per peer: my params it holds


def span(e: Entry, q: int) -> int:
    a, b = e.pieces[q]
    return b - a


def held(entries: list[Entry], q: int) -> int:
    return sum(span(e, q) for e in entries)


def make_entries(params: list[nn.Parameter], kept: dict[int, int]) -> dict[int, Entry]:
    """Each parameter's pieces and owner, by ``id``, over each shard group (shard x tp for a
    tp-split parameter): ``kept[id]`` where given, else by :func:`owners` among the
    parameters not kept."""
    entries: dict[int, Entry] = {}
    by_group: dict[int, tuple[int, list[Entry]]] = {}
    ranges: dict[int, list[tuple]] = {}
    whole: dict[int, Any] = {}  # per flat group: its whole gradients' owner
    for p in params:
        ref, index, stats = getattr(p, PIECE_ATTR)
        fg = ref()
        mesh = fg.mesh
        if id(fg) not in ranges:
            ranges[id(fg)] = [fg.layout.local_pieces(q) for q in range(mesh.shard_size)]
            # sharded over no one: a whole gradient's norms are its own, made on this rank
            whole[id(fg)] = shard_grad_owner(None, stats, fg.home)
        split = fg.splits[index]
        spans = [(pcs[index].start, pcs[index].stop) for pcs in ranges[id(fg)]]
        if split.is_split:  # model rank q = shard rank * tp + block: a range of that block
            block = split.block_numel
            pieces = [(t * block + a, t * block + b) for a, b in spans for t in range(split.parts)]
            group, rank = mesh.model, mesh.model_rank
        else:
            pieces, group, rank = spans, mesh.shard, mesh.shard_rank
        e = entries[id(p)] = Entry(p, split, pieces, whole[id(fg)], group, rank)
        by_group.setdefault(id(group), (len(pieces), []))[1].append(e)
    for world, group in by_group.values():
        new = [e for e in group if id(e.param) not in kept]
        spans = [[span(e, q) for q in range(world)] for e in new]
        for e, owner in zip(new, owners([e.numel for e in new], spans)):
            e.owner = owner
        for e in group:
            e.owner = kept.get(id(e.param), e.owner)
    return entries


def owners(numels: list[int], spans: list[list[int]]) -> list[int]:
    """The owner rank of each parameter of one shard group, in the optimizer's order.

    ``numels[i]`` is parameter ``i``'s size and ``spans[i][q]`` how many of its elements shard
    rank ``q`` holds. Largest first (the optimizer's order among equals), each goes to the rank
    that holds most of it, so that the least moves, as long as that keeps the rank's owned
    elements within ``BALANCE`` times an even split; else to the next such rank by elements
    held; where none has room, to the rank owning the fewest so far. So no rank owns more than
    ``BALANCE`` times an even split, or an even split plus one parameter. Pure arithmetic: every
    rank, and the memory planner, computes the same from the same sizes.
    """
    world = len(spans[0]) if spans else 1
    cap = BALANCE * sum(numels) / world
    load = [0] * world
    result = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: -numels[i]):
        near = sorted(range(world), key=lambda q: (-spans[i][q], load[q], q))
        owner = next((q for q in near if load[q] + numels[i] <= cap), None)
        if owner is None:
            owner = min(range(world), key=lambda q: (load[q], -spans[i][q], q))
        result[i] = owner
        load[owner] += numels[i]
    return result


def make_plans(entries: list[Entry]) -> list[Plan]:
    """What each rank sends and receives for ``entries`` (each with a ``.grad``), one plan per
    shard group, dtype and gradient dtype."""
    plans: dict[tuple[int, torch.dtype, torch.dtype], Plan] = {}
    for e in entries:
        p = e.param
        ref, _, stats = getattr(p, PIECE_ATTR)
        key = (id(e.group), p.dtype, p.grad.dtype)
        if key not in plans:
            wire = ref().mesh.device  # the host tier's pieces are in host memory, its group NCCL
            plans[key] = Plan(e.group, e.rank, len(e.pieces), *key[1:], p.device, wire, [], stats)
        plans[key].entries.append(e)
    for plan in plans.values():
        r = plan.rank
        plan.sends = [
            [e for e in plan.entries if e.owner == q and span(e, r)] if q != r else []
            for q in range(plan.world)
        ]
        plan.recvs = [
            [e for e in plan.entries if e.owner == r and span(e, q)] if q != r else []
            for q in range(plan.world)
        ]
    return list(plans.values())
