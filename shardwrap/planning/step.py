"""What the memory planner measures of the optimizer step on the meta device: state, temporaries.

Design note. The user's optimizer is built over meta tensors shaped like one rank's shard
parameters (each parameter's piece, in the shards' dtype, ``engine.shards.flat_group.piece_shape``),
each trainable one with a gradient, in the wrapped model's order, and stepped twice under the
dispatch mode that counts the trace's live bytes: what is alive after the steps is the
optimizer's state, the most alive during them the step's peak (the first step makes the
state, the second holds it throughout).

An optimizer that the engine steps whole (``engine.optim.whole_params``: Muon, Adafactor, classes
declared ``reads_shapes=True``) is stepped here as the engine's step hooks step it on that rank:
the engine's own owner rule (``ownership.owners``) picks the parameters the rank owns; the
all-to-all buffers of the gather (values and gradients) are made; each owned parameter the rank
does not hold whole gets whole values and a whole gradient, in its shape, which stay until the
step's end; the others have no gradient, so the step skips them; after the step, the buffers of
the all-to-all that sends the new values back. Its state is then that of the owned parameters,
in their shapes, and the step's peak holds the exchange. Owners differ by rank, so such a plan
is measured for every rank (:func:`ranks_to_plan`).

For the disk tier the shard parameters and gradients are typed as that tier's, over a home
that applies the tier's own rule for where state goes (:class:`_MetaFiles`): state made like
a shard parameter or a gradient the optimizer steps (a piece's, or the whole one an owner
steps, typed as the engine types it) is in files; anything else (temporaries, the exchange's
buffers and whole values and gradients) is in memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim import Optimizer

from ..comm.collectives import CommStats
from ..engine.optim.ownership import owners
from ..engine.optim.shard_grad import as_shard_grad, shard_grad_owner
from ..engine.optim.whole_params import steps_whole
from ..engine.shards.flat_group import piece_shape
from ..tiers.home import DiskHome, Home
from ..tiers.offload import _FUSED_OPTIMIZERS as FUSED_OPTIMIZERS
from ..tiers.offload import grads_in_own_dtype, stored_param
from ..tiers.shard_param import raw_data, set_raw_data
from .trace import LiveBytes, Trace

__all__ = ["OptimizerFactory", "StepBytes", "optimizer_bytes", "ranks_to_plan"]

OptimizerFactory = Callable[[list[nn.Parameter]], Optimizer | Iterable[Optimizer]]
"""``fn(params)``: one optimizer, or several over parts of ``params``, stepped in their order."""


@dataclass(frozen=True)
class _Piece:
    """A shard parameter's parameter: its shape and how many elements each rank holds."""

    shape: torch.Size
    spans: list[int]  # per shard rank

    @property
    def numel(self) -> int:
        return self.shape.numel()


def ranks_to_plan(tr: Trace, optimizer: OptimizerFactory | None) -> list[int]:
    """The ranks whose optimizer step may hold the most: rank 0 (which holds the most
    elements) where every optimizer steps pieces, every rank where one steps whole parameters
    (what each owns follows the owner rule, not the rank)."""
    if optimizer is None or not tr.groups:
        return [0]
    params, _ = _shard_params(tr, 0)
    if any(steps_whole(type(opt)) for opt in _optimizers(optimizer, params)):
        return list(range(tr.groups[0].layout.world_size))
    return [0]


@dataclass(frozen=True)
class StepBytes:
    """What one rank's optimizer holds, in bytes."""

    state: int
    """Its state between steps."""
    most: int
    """The most alive during a step, the state included."""
    in_files: int = 0
    """Of ``state``, what the disk tier makes in its files (measured with ``disk``)."""


def optimizer_bytes(
    tr: Trace,
    optimizer: OptimizerFactory | None,
    device: str,
    fuse: bool = False,
    rank: int = 0,
    disk: bool = False,
) -> StepBytes:
    """The optimizer's state on ``rank``, and the most its step holds.

    Where a parameter group left ``fused`` and ``foreach`` unset, torch steps it as it would
    on ``device`` (one foreach step on CUDA, tensor by tensor on a CPU), and with ``fuse``
    (the offload tiers) the engine turns on torch's fused kernel for the optimizers that have
    one (``tiers.offload.prefer_fused``): a fused step updates in place and allocates nothing.
    An optimizer the engine steps whole is stepped as the engine steps it (the design note).
    With ``disk``, the shard parameters and their gradients are the disk tier's, over a home
    that makes on the meta device what the disk tier makes in its files (:class:`_MetaFiles`).
    """
    if optimizer is None:
        return StepBytes(0, 0)
    files = _MetaFiles() if disk else None
    params, pieces = _shard_params(tr, rank, files)
    if not any(p.grad is not None for p in params):
        return StepBytes(0, 0)
    counter = _StepBytes()
    with counter:
        opts = _optimizers(optimizer, params)
        fused = []  # per optimizer: every group steps with a fused kernel
        for opt in opts:
            groups = []
            for group in opt.param_groups:
                unset = group.get("fused") is None and group.get("foreach") is None
                fusable = _has_fused(opt) and grads_in_own_dtype(group["params"])
                groups.append(bool(group.get("fused")) or (fuse and unset and fusable))
                # meta tensors have no fused kernel: step them per tensor, for the state
                if "foreach" in group:
                    group["foreach"] = device == "cuda" if unset else bool(group["foreach"])
                if "fused" in group:
                    group["fused"] = False
            fused.append(all(groups))
        # The first step makes the state; the second shows what a step holds besides it (the
        # whole-parameter exchange comes before the state is made).
        for _ in range(2):
            for opt, in_place in zip(opts, fused):
                before = counter.most
                if steps_whole(type(opt)):
                    _step_whole(opt, pieces, rank)
                else:
                    opt.step()
                if in_place:  # the fused kernel's step: its state, no temporaries
                    counter.most = max(before, counter.live())
        state = counter.live()
    _, most = counter.mark()
    in_files = files.live() if files is not None else 0
    del opts
    return StepBytes(state, most, in_files)


class _StepBytes(LiveBytes):
    """The live bytes of a step, where a meta tensor's value read (``.item()``) gives 1.

    HACK: meta tensors have no values. Adafactor reads its parameter's norm as a number
    (``param.norm().item()``) to scale its step; no allocation depends on that number.
    """

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            return True if args[0].dtype == torch.bool else 1
        return super().__torch_dispatch__(func, types, args, kwargs)


class _MetaFiles(DiskHome):
    """The disk tier's home, its files on the meta device: by the tier's own rule
    (``DiskHome.made_like``, ``made_from_grad``) it makes the optimizer state made like a
    shard parameter or its gradient, here as meta tensors it records."""

    def __init__(self) -> None:  # no folder: nothing is written
        Home.__init__(self, torch.device("meta"))
        self.made: dict[int, tuple[StorageWeakRef, int]] = {}

    def tensor(self, numel: int, dtype: torch.dtype, name: str = "") -> Tensor:
        out = torch.empty(numel, dtype=dtype, device="meta")
        storage = out.untyped_storage()
        self.made[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
        return out

    def live(self) -> int:
        """Bytes of what it made that is still alive."""
        return sum(n for ref, n in self.made.values() if not ref.expired())


def _shard_params(
    tr: Trace, rank: int, files: _MetaFiles | None = None
) -> tuple[list[nn.Parameter], dict[int, _Piece]]:
    """Meta shard parameters as ``rank`` holds them, in the model's order, and what each is a
    piece of (by ``id``); with ``files``, the disk tier's (their state made in ``files``)."""
    owner = shard_grad_owner(None, CommStats(), files) if files is not None else None
    groups = tr.groups
    world = groups[0].layout.world_size if groups else 1
    ranges = [[g.layout.local_pieces(q) for q in range(world)] for g in groups]
    params, pieces = [], {}
    for i, j in tr.params:
        g, spans = groups[i], [pcs[j].numel for pcs in ranges[i]]
        shape = piece_shape(g.shapes[j], spans[rank])
        data = torch.empty(shape, dtype=g.dtype, device="meta")
        if files is None:
            p = nn.Parameter(data, g.requires_grad)
        else:
            p = stored_param(data, g.requires_grad, files)
        if g.requires_grad:
            p.grad_dtype = g.kept_grad_dtype
            grad = torch.empty(shape, dtype=g.kept_grad_dtype, device="meta")
            p.grad = grad if owner is None else as_shard_grad(grad, owner)
        params.append(p)
        pieces[id(p)] = _Piece(g.shapes[j], spans)
    return params, pieces


def _optimizers(optimizer: OptimizerFactory, params: list[nn.Parameter]) -> list[Optimizer]:
    made = optimizer(params)
    return [made] if isinstance(made, Optimizer) else list(made)


def _step_whole(opt: Optimizer, pieces: dict[int, _Piece], rank: int) -> None:
    """``opt.step()`` as ``engine.optim.whole_params`` runs it on shard rank ``rank``."""
    params = [p for group in opt.param_groups for p in group["params"]]
    of = [pieces[id(p)] for p in params]
    owner = owners([e.numel for e in of], [e.spans for e in of])
    world = len(of[0].spans) if of else 1
    by_dtype: dict[tuple[torch.dtype, torch.dtype], list[int]] = {}  # values', gradients'
    for i, p in enumerate(params):
        if p.grad is not None:
            by_dtype.setdefault((p.dtype, p.grad.dtype), []).append(i)

    def exchange(idx: list[int], dtype: torch.dtype, per_element: int) -> list[Tensor]:
        """One all-to-all's buffers: to each peer its pieces of the parameters it owns, and
        from each peer its pieces of the ones this rank owns."""
        sizes = []
        for q in range(world):
            if q != rank:
                sizes.append(sum(of[i].spans[rank] for i in idx if owner[i] == q))
                sizes.append(sum(of[i].spans[q] for i in idx if owner[i] == rank))
        return [torch.empty(per_element * n, dtype=dtype, device="meta") for n in sizes]

    restore = []
    with torch.no_grad():
        for (dtype, grad_dtype), idx in by_dtype.items():
            wire = torch.promote_types(dtype, grad_dtype)
            buffers = exchange(idx, wire, 2)  # values and gradients
            for i in idx:
                p, piece = params[i], of[i]
                restore.append((p, raw_data(p), p.grad))
                grad, p.grad = p.grad, None
                if owner[i] != rank:
                    continue
                if piece.spans[rank] == piece.numel:  # held whole: stepped in place
                    set_raw_data(p, raw_data(p).view(piece.shape))
                    p.grad = grad.view(piece.shape)
                else:  # the whole gradient typed as the piece's (the disk tier's)
                    set_raw_data(p, torch.empty(piece.shape, dtype=dtype, device="meta"))
                    whole = torch.empty(piece.shape, dtype=grad_dtype, device="meta")
                    owned_by = getattr(grad, "_shardwrap_owner", None)
                    p.grad = whole if owned_by is None else as_shard_grad(whole, owned_by)
            del buffers
        opt.step()
        for (dtype, _), idx in by_dtype.items():
            exchange(idx, dtype, 1)  # the new values, back to each piece's rank
        for p, data, grad in restore:
            p.grad = None
            set_raw_data(p, data)
            p.grad = grad


def _has_fused(optimizer: Optimizer) -> bool:
    return isinstance(optimizer, FUSED_OPTIMIZERS)
