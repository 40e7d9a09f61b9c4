"""The optimizer's state as over the unwrapped model: gathered whole, and loaded back.

A DDP script keeps its model and optimizer in one file (``{"model": ..., "optimizer": ...}``).
:func:`full_optimizer_state_dict` is the optimizer's half, as ``model.full_state_dict()`` is
the model's: ``optimizer.state_dict()``'s own format, keyed by the parameters' positions in
its groups, each state tensor in the parameter's full shape, so the file loads into the
unwrapped model's optimizer, and into a sharded model's at any world size (its
``load_state_dict`` cuts each tensor to the rank's piece: ``engine/optim/pieces.py``).

What each rank holds is read as a checkpoint reads it (:func:`plan_optimizer`): state shaped
like this rank's pieces (elementwise optimizers), gathered one flat group and state key at a
time over the shard group; state a shape-aware optimizer (Muon, Adafactor) keeps whole on each
parameter's owner, sent from the owners; scalars (``step``) from rank 0.
"""

from __future__ import annotations

import copy
import hashlib
import io
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..comm.collectives import all_gather, all_reduce, all_to_all
from ..engine.optim.dcp_pieces import register_full_optimizer_state
from ..engine.optim.pieces import inner_optimizer
from ..engine.optim.whole_params import stepped_whole
from ..engine.shards.flat_group import FlatGroup
from ..engine.step.root import Root
from .entry import sharded_model, wrapped_root
from .files import agree
from .optimizer_state import OptimizerPlan, names_by_id, plan_optimizer
from .packed_state import unpack

__all__ = ["full_optimizer_state_dict", "load_full_optimizer_state_dict"]

StateByName = dict[str, dict[str, Any]]  # parameter name -> state key -> value


def full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, rank0_only: bool = False
) -> dict[str, Any]:
    """``optimizer.state_dict()`` as the unwrapped model's optimizer would return it.

    Every state tensor is in its parameter's full shape, on the CPU; the keys are the
    parameters' positions in ``optimizer.param_groups``, as torch numbers them, so an optimizer
    built alike over the unwrapped model loads it, and so does one over the model wrapped at any
    world size. Gathers one flat group's state at a time. Call on every rank.

    Args:
        model: the model, wrapped with :class:`ShardedModule`.
        optimizer: an optimizer over ``model.parameters()``: elementwise (AdamW, SGD, ...) or
            stepping whole parameters (Muon, Adafactor).
        rank0_only: only rank 0 gets the state; the others get ``{}``.

    Raises:
        ValueError: as ``save_checkpoint`` refuses an optimizer: a parameter that is not the
            model's, state of an elementwise optimizer shaped neither like its piece nor as
            a scalar, LBFGS; or optimizer state whose keys differ across ranks (every rank).
    """
    model, root = wrapped_root(model, "full_optimizer_state_dict")
    optimizer = inner_optimizer(optimizer)  # a wrapper's (Lookahead's) state is its inner one's
    mesh = root.mesh
    plan: OptimizerPlan | None = None
    work: Gathers = []

    def prepare() -> int:
        nonlocal plan, work
        stepped_whole(optimizer)  # refuses LBFGS; from now its state_dict() hands out pieces
        plan = plan_optimizer(model, optimizer, "full_optimizer_state_dict")
        work = _pieces_by_group(root, plan)
        return _digest(work)

    digests = agree(mesh.control, mesh.control_device, "full_optimizer_state_dict", prepare)
    assert plan is not None
    if len(set(digests)) > 1:  # they would issue different gathers
        raise ValueError(
            "full_optimizer_state_dict: the ranks hold optimizer state under different keys "
            "(a parameter stepped on some ranks only, or a state key of its own on one rank); "
            "step the optimizer alike on every rank"
        )
    keep = not rank0_only or mesh.rank == 0
    full = _gather_pieces(root, work, keep)
    packed: dict[str, dict[str, Any]] = {}
    if plan.whole:
        owned, packed = _send_owned(root, plan, to_rank0=rank0_only)
        full.update(owned)
    if not keep:
        return {}
    names = names_by_id(model)
    state: dict[int, dict[str, Any]] = {}
    groups = []
    index = 0
    for group in optimizer.param_groups:
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            scalars = {} if plan.whole else plan.scalars.get(name, {})
            entry = {k: _on_cpu(v) for k, v in {**scalars, **full.get(name, {})}.items()}
            if name in packed:  # a low-bit optimizer's state tensors, from their parts
                entry = unpack(entry, packed[name], lambda v: v, torch.device("cpu"))
            if entry:
                state[index] = entry
            ids.append(index)
            index += 1
        groups.append({**hyper, "params": ids})
    return {"state": state, "param_groups": groups}


def load_full_optimizer_state_dict(
    model: nn.Module, optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]
) -> None:
    """Load an optimizer state of the unwrapped model (:func:`full_optimizer_state_dict`, or a
    DDP run's ``optimizer.state_dict()``) into ``optimizer``, over the sharded ``model`` at any
    world size: each rank keeps its pieces (stepped whole: each owner its parameters').

    The same as ``optimizer.load_state_dict(state_dict)``, which on an optimizer over a sharded
    model cuts full state to pieces too; this one can be called before the optimizer's first
    step, and says what is wrong. No communication: every rank passes the whole state dict.

    Raises:
        TypeError: ``model`` is not wrapped, or ``optimizer`` holds none of its parameters.
        ValueError: a state tensor shaped neither like its parameter nor like this rank's
            piece; groups of other sizes (as ``load_state_dict`` says); a dict that is no
            optimizer state (``{}``, what ``rank0_only`` gives ranks other than 0).
    """
    model, optimizer = sharded_model(model), inner_optimizer(optimizer)
    root = vars(model).get("_shardwrap_root")
    if not isinstance(root, Root):
        raise TypeError(
            "load_full_optimizer_state_dict takes a model wrapped with ShardedModule, got "
            f"{type(model).__name__}"
        )
    if not any(id(p) in root.param_of for g in optimizer.param_groups for p in g["params"]):
        raise TypeError(
            "load_full_optimizer_state_dict: the optimizer holds none of the sharded model's "
            "parameters; build it from model.parameters() after wrapping"
        )
    missing = [key for key in ("state", "param_groups") if key not in state_dict]
    if missing:
        empty = " (empty: full_optimizer_state_dict(..., rank0_only=True) gives the other ranks {})"
        raise ValueError(
            "load_full_optimizer_state_dict: the state dict has no "
            + " and no ".join(f"'{key}'" for key in missing)
            + (empty if not state_dict else "")
            + ". Every rank loads the whole state: torch.load the file rank 0 saved on every "
            "rank, or take full_optimizer_state_dict without rank0_only. Nothing was loaded."
        )
    stepped_whole(optimizer)  # hooks its load_state_dict, which cuts full state to pieces
    optimizer.load_state_dict(state_dict)


def _on_cpu(value: Any) -> Any:
    return value.detach().to("cpu", copy=True) if isinstance(value, Tensor) else value


Gathers = list[tuple[FlatGroup, str, torch.dtype, list[tuple[int, Tensor]]]]


def _pieces_by_group(root: Root, plan: OptimizerPlan) -> Gathers:
    """This rank's state pieces to gather: per flat group, state key and dtype, each
    parameter's (index in the group, piece)."""
    work: Gathers = []
    for unit in root.units:
        for g in unit.groups:
            by_key: dict[tuple[str, torch.dtype], list[tuple[int, Tensor]]] = {}
            for i, name in enumerate(g.names):
                for key, value in plan.sharded.get(name, {}).items():
                    by_key.setdefault((key, value.dtype), []).append((i, value))
            work.extend((g, key, dtype, items) for (key, dtype), items in by_key.items())
    return work


def _digest(work: Gathers) -> int:
    """56 bits of a hash of what ``work`` gathers, the same on every rank that gathers alike."""
    text = repr([(g.names[i], key, str(dtype)) for g, key, dtype, items in work for i, _ in items])
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _gather_pieces(root: Root, work: Gathers, keep: bool) -> StateByName:
    """Each parameter's state pieces gathered whole over the shard group (kept where
    ``keep``): one all-gather per flat group, state key and dtype."""
    device = root.mesh.device
    full: StateByName = {}
    for g, key, dtype, items in work:
        shard = torch.zeros(g.layout.shard_size, dtype=dtype, device=device)
        for i, value in items:
            pc = g.pieces[i]
            shard[pc.shard_offset : pc.shard_offset + pc.numel].copy_(value.reshape(-1))
        out = torch.empty(g.layout.padded_numel, dtype=dtype, device=device)
        all_gather(out, shard, g.mesh.shard, root.stats).wait()
        for i, _ in items if keep else ():
            offset, numel = g.layout.offsets[i], g.layout.numels[i]
            value = out[offset : offset + numel].view(g.shapes[i]).to("cpu", copy=True)
            full.setdefault(g.names[i], {})[key] = value
    return full


def _send_owned(
    root: Root, plan: OptimizerPlan, to_rank0: bool
) -> tuple[StateByName, dict[str, dict[str, Any]]]:
    """The whole-stepped state of every parameter (scalars and tensors; a low-bit state
    tensor as its parts), and the records to rebuild those from their parts
    (``packed_state.py``), sent from each owner to shard rank 0 (``to_rank0``) or to every rank,
    as the bytes of ``torch.save``: the tensors' shapes (Adafactor's factors) are known to their
    owners alone."""
    mesh = root.mesh
    mine: StateByName = {
        name: {**plan.scalars.get(name, {}), **{k: _on_cpu(v) for k, v in state.items()}}
        for name, state in plan.owned.items()
    }
    mine.update({n: dict(s) for n, s in plan.scalars.items() if n not in mine})
    group, rank, world = mesh.shard, mesh.shard_rank, mesh.shard_size
    if world == 1:
        return mine, dict(plan.packed)
    buffer = io.BytesIO()
    torch.save({"state": mine, "packed": plan.packed}, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes = torch.zeros(world, dtype=torch.int64, device=mesh.device)
    sizes[rank] = payload.numel()
    all_reduce(sizes, group, dist.ReduceOp.SUM, root.stats).wait()
    receives = rank == 0 or not to_rank0
    empty = torch.empty(0, dtype=torch.uint8, device=mesh.device)
    sent = payload.to(mesh.device)
    ins = [sent if q != rank and (q == 0 or not to_rank0) else empty for q in range(world)]
    outs = [
        torch.empty(int(n), dtype=torch.uint8, device=mesh.device)
        if receives and q != rank
        else empty
        for q, n in enumerate(sizes.tolist())
    ]
    all_to_all(outs, ins, group, root.stats).wait()
    if not receives:
        return {}, {}
    held: StateByName = dict(mine)
    packed = dict(plan.packed)
    for q, out in enumerate(outs):
        if q != rank:
            sent_by_q = torch.load(io.BytesIO(out.cpu().numpy().tobytes()), weights_only=True)
            held.update(sent_by_q["state"])
            packed.update(sent_by_q["packed"])
    return held, packed


# get_optimizer_state_dict(..., options=StateDictOptions(full_state_dict=True)) gathers with it
register_full_optimizer_state(full_optimizer_state_dict)
