"""This rank's pieces of sharded tensors, as state dicts hand them out, and loaded back.

Design note. A sharded model's ``state_dict()``, and the ``state_dict()`` of an optimizer over
its shard parameters, hold this rank's pieces under the full names. Saved on one rank (a DDP
script's ``torch.save(model.state_dict(), path)`` under ``if rank == 0:``, the most common save
line in PyTorch) they would be written as if whole, and the other ranks' pieces lost, shown
only when a load fails on a shape. So each such tensor is handed out as a :class:`ShardPiece`:
the same storage, typed to know the whole tensor's shape and the elements of it that it holds,
and refusing to be pickled (``torch.save``), naming the calls that save the whole. It costs
what any tensor subclass costs (torch's default ``__torch_function__``), and what is computed
from it stays a piece, so a copy (``.cpu()``, ``.clone()``) cannot be saved either.

An optimizer over shard parameters is adopted once (:func:`adopt_optimizer`, called where the
engine first sees it: its first step, or a save or load of it):

1. its ``state_dict()`` marks each state tensor of a sharded parameter as a piece (a shape-aware
   optimizer's, held whole by the parameter's owner rank alone, as a piece of that rank's);
2. its ``load_state_dict()`` takes its own ``state_dict()`` back, or the unwrapped model's
   optimizer state (a DDP checkpoint, ``full_optimizer_state_dict``), at any world size: each
   tensor of a parameter's full shape is cut to this rank's piece (stepped whole: kept by the
   owner, dropped elsewhere), made where the optimizer makes its state (the disk tier's files);
3. state loaded before it was adopted is cut alike when it is.

For ``torch.distributed.checkpoint`` (DCP), both state dicts hand out pieces shaped as the whole
tensor instead (``dcp_pieces.py``), and a ``ShardPiece`` that reaches DCP anyway (a state dict
taken with ``state_dict()`` itself) is refused there, at its save and at ``async_save``'s
staging, naming ``get_model_state_dict``.
"""

from __future__ import annotations

import copy
import os
import sys
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ...tiers.shard_param import (
    copies_whole_into,
    first_among,
    is_collective,
    not_a_dtensor,
    whole_beside,
    whole_beside_piece,
)
from .dcp_pieces import (
    DCPPiece,
    dcp_call,
    full_optimizer_state,
    local_piece,
    owned_elsewhere,
    refuse_tensor_parallel,
)
from .save_guard import guard_torch_save
from .shard_grad import ShardGrad

__all__ = ["PIECE_ATTR", "ShardPiece", "adopt_optimizer", "as_piece", "inner_optimizer"]

PIECE_ATTR = "_shardwrap_piece"  # on a shard parameter: (its FlatGroup, weakly; index; CommStats)

# What to call instead of saving a rank's state dict (every rank calls them).
SAVE_FIXES = (
    "On every rank, call model.full_state_dict(rank0_only=True) and "
    "shardwrap.full_optimizer_state_dict(model, optimizer, rank0_only=True), then torch.save "
    "them on rank 0 (a file that loads into the unwrapped model, or at any world size); or "
    "shardwrap.save_checkpoint(path, model, optimizer) on every rank (each rank writes its "
    "pieces). See docs/ddp.md"
)

# What to give torch.distributed.checkpoint instead of a rank's state dict.
DCP_FIX = (
    "Give torch.distributed.checkpoint get_model_state_dict(model) and "
    "get_optimizer_state_dict(model, optimizer) (or the model and optimizer themselves): they "
    "show it where each piece lies in the whole tensor. See docs/dcp.md"
)
# safetensors' own files, whose save reads a tensor's memory directly
_SAFETENSORS = os.path.join("", "safetensors", "")
# torch's helpers that copy a state dict's tensors into plain ones (async_save's CPU staging)
_STAGING = os.path.join("torch", "distributed", "_state_dict_utils.py")


class ShardPiece(Tensor):
    """This rank's piece of a sharded tensor (a parameter, or its optimizer state) in a state
    dict: a plain tensor for every use but pickling, which raises (see the module's note).

    Attributes:
        full_shape: the whole tensor's shape.
        start, stop: the elements ``[start, stop)`` of the flattened whole tensor held here.
    """

    full_shape: torch.Size
    start: int
    stop: int

    __getattr__ = not_a_dtensor

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: this rank's piece would be saved as if it were the whole tensor."""
        raise TypeError(
            f"shardwrap: saving {self._held()}: a sharded model's state_dict() and its "
            "optimizer's hold each rank's pieces, so a state dict saved on one rank would hold "
            f"that rank's pieces under the full names and lose the others'. {SAVE_FIXES}."
        )

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """As any tensor, but refusing to be copied into a plain tensor by DCP's staging (the
        copy would be written as the whole tensor), to be read by ``safetensors`` (which
        writes its memory as the whole tensor), to be sent by ``torch.distributed``, and a
        copy of a whole tensor's value into it (naming ``load_state_dict``). What is computed
        from a piece, element for element (``.clone()``, ``.cpu()``), holds the same elements."""
        if _SAFETENSORS in sys._getframe(1).f_code.co_filename:
            piece = first_among(ShardPiece, args, kwargs)
            raise TypeError(
                f"shardwrap: safetensors was given {piece._held()}: it would write it as the "
                f"whole tensor, and the other ranks' pieces would be lost. {SAVE_FIXES}; "
                "shardwrap.export(path, model) writes safetensors of the whole model."
            )
        if is_collective(func):
            piece = first_among(ShardPiece, args, kwargs)
            raise TypeError(
                f"shardwrap: torch.distributed.{func.__name__} of {piece._held()}: each rank's "
                "state dict holds other elements under the same names, so a collective over "
                "them would mix different elements (or wait forever where their sizes differ). "
                "Nothing was sent. Every rank already holds rank 0's weights after wrapping; to "
                "give every rank a state loaded on one, load the full state dict on every rank "
                "(model.load_state_dict(full)), or edit inside "
                "`with model.gathered(modifier_rank=0):`."
            )
        if copies_whole_into(ShardPiece, func, args, "full_shape"):
            raise ValueError(
                f"shardwrap: copy_ of a value of the whole tensor's shape into "
                f"{args[0]._held()}, from a sharded model's state_dict(): its values are this "
                "rank's pieces. Load whole values with model.load_state_dict(state_dict) "
                "(strict=False for some of them), which each rank cuts to its pieces."
            )
        piece = whole_beside_piece(ShardPiece, func, args, "full_shape")
        if piece is not None:
            message = whole_beside(func, piece._held(), tuple(piece.full_shape))
            raise ValueError(f"shardwrap: {message}")
        if (
            func is Tensor.copy_
            and len(args) > 1
            and isinstance(args[1], ShardPiece)
            and not isinstance(args[0], ShardPiece)
            and sys._getframe(1).f_code.co_filename.endswith(_STAGING)
        ):
            raise TypeError(
                f"shardwrap: staging {args[1]._held()} for torch.distributed.checkpoint copies "
                f"it into a plain tensor, which DCP would write as the whole tensor. {DCP_FIX}."
            )
        out = super().__torch_function__(func, types, args, kwargs or {})
        source = args[0] if args else None
        if type(out) is ShardPiece and not hasattr(out, "start") and hasattr(source, "start"):
            if out.shape == source.shape:
                out.full_shape, out.start, out.stop = source.full_shape, source.start, source.stop
        return out

    def __create_write_items__(self, fqn: str, obj: Any) -> Any:
        """Refused: DCP would write the piece as the whole tensor ``fqn``."""
        raise TypeError(
            f"shardwrap: torch.distributed.checkpoint was given {self._held()} as '{fqn}', from "
            f"a sharded model's (or its optimizer's) state_dict(). {DCP_FIX}."
        )

    def __create_chunk_list__(self) -> Any:
        """Refused: DCP would load the whole tensor's rectangles into the piece."""
        raise TypeError(
            f"shardwrap: torch.distributed.checkpoint was asked to load into {self._held()}, "
            f"from a sharded model's (or its optimizer's) state_dict(). {DCP_FIX}."
        )

    def _held(self) -> str:
        shape = getattr(self, "full_shape", None)
        held = "" if shape is None else f" (elements {self.start}:{self.stop} of {tuple(shape)})"
        return f"this rank's piece of a sharded tensor{held}, of shape {tuple(self.shape)}"

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardPiece:
        """A copy that is a piece of the same tensor (``copy.deepcopy(model.state_dict())``)."""
        plain = self.as_subclass(Tensor)
        # kept alive with the memo, as deepcopy keeps what it copies: a later alias at the
        # same address would otherwise be taken for this one
        memo.setdefault(id(memo), []).append(plain)
        copied = copy.deepcopy(plain, memo)
        piece = as_piece(copied, self.full_shape, self.start, self.stop)
        memo[id(self)] = piece
        return piece


def as_piece(t: Tensor, full_shape: tuple[int, ...], start: int, stop: int) -> ShardPiece:
    """``t`` (same storage) as a piece holding elements ``[start, stop)`` of ``full_shape``."""
    guard_torch_save(ShardPiece)
    piece = t.as_subclass(ShardPiece)
    piece.full_shape, piece.start, piece.stop = torch.Size(full_shape), start, stop
    return piece


def piece_of(param: Tensor) -> tuple[torch.Size, int, int, tuple[int, ...]] | None:
    """A shard parameter's (full shape, start, stop, piece shape), or ``None`` for a tensor
    that is no shard parameter."""
    info = getattr(param, PIECE_ATTR, None)
    if info is None:
        return None
    ref, index, _ = info
    group = ref()
    piece = group.pieces[index]
    shape = group.shapes[index]
    return shape, piece.start, piece.stop, tuple(group.piece_shapes[index])


# optimizers ------------------------------------------------------------------------------

Owns = Callable[[nn.Parameter], bool]  # whether this rank steps a parameter whole
_followers: weakref.WeakSet[Optimizer] = weakref.WeakSet()  # wrappers kept on their groups


def inner_optimizer(optimizer: Optimizer) -> Optimizer:
    """The optimizer whose ``state`` holds ``optimizer``'s: ``optimizer`` itself, or, for a
    wrapper holding another optimizer whose ``param_groups`` it shares (timm's ``Lookahead``,
    whose own ``state`` stays empty and whose ``state_dict()`` is the inner one's), that one,
    through any number of wrappers. Saves read it, loads write it; a load replaces its
    ``param_groups`` list, so the wrapper is then pointed at the new one, as the wrapper's own
    ``load_state_dict`` does (a scheduler over the wrapper keeps reaching the groups)."""
    held = next(
        (
            v
            for v in vars(optimizer).values()
            if isinstance(v, Optimizer) and v is not optimizer
            and v.param_groups is optimizer.param_groups
        ),
        None,
    )  # fmt: skip
    if held is None:
        return optimizer
    inner = inner_optimizer(held)
    if "param_groups" in vars(optimizer) and optimizer not in _followers:
        _followers.add(optimizer)
        wrapper = weakref.ref(optimizer)

        def follow(loaded: Optimizer) -> None:
            if (w := wrapper()) is not None:
                w.param_groups = loaded.param_groups

        inner.register_load_state_dict_post_hook(follow)
    return inner


_adopted: weakref.WeakSet[Optimizer] = weakref.WeakSet()


def adopt_optimizer(optimizer: Optimizer, owns: Owns | None) -> None:
    """Hook ``optimizer``'s ``state_dict()`` and ``load_state_dict()`` (once), and cut the state
    it already holds (see the module's note).

    Args:
        optimizer: an optimizer over shard parameters.
        owns: for an optimizer stepping parameters whole, whether this rank steps each; ``None``
            for one stepping pieces.

    Raises:
        ValueError: state of a sharded parameter shaped neither like it nor like its piece.
    """
    if optimizer in _adopted:
        return
    _adopted.add(optimizer)

    def mark(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        return _marked(optimizer, state_dict, owns)

    def cut(optimizer: Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
        # a state's key is its parameter's position, or its name (DCP's set_optimizer_state_dict):
        # matched to the parameters as torch matches them, by the groups' order
        saved = [k for group in state_dict.get("param_groups", ()) for k in group["params"]]
        params = dict(zip(saved, _params(optimizer)))
        scalars = _scalar_keys((params.get(i), entry) for i, entry in state_dict["state"].items())
        state = {}
        for i, entry in state_dict["state"].items():
            kept = _cut_entry(params.get(i), entry, owns, i, scalars, strict=True)
            if kept is not None:
                state[i] = kept
        return {**state_dict, "state": state}

    optimizer.register_state_dict_post_hook(mark)
    optimizer.register_load_state_dict_pre_hook(cut)
    index = {id(p): i for i, p in enumerate(_params(optimizer))}
    scalars = _scalar_keys(optimizer.state.items())
    for param, entry in list(optimizer.state.items()):  # loaded before the engine saw it
        kept = _cut_entry(param, entry, owns, index.get(id(param)), scalars, strict=False)
        if kept is None:
            del optimizer.state[param]
        else:
            optimizer.state[param] = kept


def _params(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order its ``state_dict()`` numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_state_tensor(value: Any) -> bool:
    """A tensor of per-element state (not ``step``, a 0-d tensor) of a piece, which is never
    0-d (``flat_group.piece_shape``)."""
    return isinstance(value, Tensor) and value.ndim > 0


# 0-d state that no element holds, in torch's optimizers: step counts and schedules (NAdam's
# ``mu_product``, ASGD's ``eta`` and ``mu``)
_TORCH_SCALARS = frozenset({"step", "mu_product", "eta", "mu"})


def _scalar_keys(entries: Iterable[tuple[Tensor | None, dict[str, Any]]]) -> frozenset[str]:
    """The keys of an optimizer's whole-tensor state (``(parameter, entry)`` pairs) that are
    scalars, not per-element state: a 0-d parameter's state is 0-d either way (its step and its
    moment alike), so they are read off the state of the parameters of one dimension or more,
    where every 0-d value is a scalar; torch's own names where no such parameter has state."""
    found: set[str] = set()
    seen = False
    for param, entry in entries:
        info = piece_of(param) if param is not None else None
        if info is not None and info[0]:
            seen = True
            found |= {k for k, v in entry.items() if not _is_state_tensor(v)}
    return frozenset(found) if seen else _TORCH_SCALARS


def _packed(value: Tensor) -> bool:
    """State an optimizer keeps in a tensor subclass of its own (a low-bit optimizer's
    quantized state): only that optimizer reads it, so it is handed on as it is. Not
    shardwrap's own: state made from a gradient (SGD's momentum buffer, a clone of the first
    gradient) is a :class:`ShardGrad`, a piece like any other."""
    return (
        isinstance(value, Tensor)
        and not isinstance(value, ShardPiece | DCPPiece | ShardGrad)
        and (type(value) is not Tensor)
    )


def _marked(optimizer: Optimizer, state_dict: dict[str, Any], owns: Owns | None) -> dict:
    """``state_dict`` with each sharded parameter's state tensors as pieces (new entries: the
    optimizer's own state is left plain).

    For torch.distributed.checkpoint the pieces are :class:`DCPPiece`\\ s and, for a parameter
    stepped whole, every rank shows the same entry (empty pieces but on its owner), as DCP's
    helpers expect; asked for the whole state (``full_state_dict=True``), it is gathered.
    """
    call = dcp_call()
    params = _params(optimizer)
    dcp = call is not None
    sharded = [i for i, p in enumerate(params) if piece_of(p) is not None] if dcp else []
    mesh = getattr(params[sharded[0]], PIECE_ATTR)[0]().mesh if sharded else None
    if call is not None and mesh is not None:
        refuse_tensor_parallel(mesh, call)
    if call is not None and call.full:
        full = full_optimizer_state(call.model, optimizer, call.rank0_only)
        # {} on a rank that DCP keeps nothing of (rank0_only): the groups alone, no exchange
        return dict(full) if full else {**state_dict, "state": {}}
    state = {}
    for i, entry in state_dict["state"].items():
        info = piece_of(params[i]) if isinstance(i, int) and 0 <= i < len(params) else None
        if info is None:
            state[i] = entry
        elif owns is not None:  # whole, on its owner alone; for DCP its scalars too
            state[i] = {
                k: _shown(v, v.shape, 0, v.numel(), dcp)
                if not _packed(v) and (_is_state_tensor(v) or (dcp and isinstance(v, Tensor)))
                else v
                for k, v in entry.items()
            }
        else:
            full_shape, start, stop, shape = info
            state[i] = {
                k: _shown(v, full_shape, start, stop, dcp)
                if _is_state_tensor(v) and not _packed(v) and tuple(v.shape) == shape
                else v
                for k, v in entry.items()
            }
    if dcp and owns is not None and mesh is not None:
        state.update(owned_elsewhere(state, sharded, mesh.shard, mesh.device))
    return {**state_dict, "state": state}


def _shown(v: Tensor, full: tuple[int, ...], start: int, stop: int, dcp: bool) -> Tensor:
    """State tensor ``v`` as the piece ``[start, stop)`` of a tensor of shape ``full``."""
    if isinstance(v, ShardGrad):
        v = v.as_subclass(Tensor)
    return DCPPiece(v, full, start, stop) if dcp else as_piece(v, full, start, stop)


def _cut_entry(
    param: Tensor | None,
    entry: dict[str, Any],
    owns: Owns | None,
    index: Any,
    scalars: frozenset[str],
    strict: bool,
) -> dict[str, Any] | None:
    """One parameter's loaded state as this rank holds it; ``None`` where it holds none (a
    parameter stepped whole on another rank). A tensor of neither the parameter's shape nor its
    piece's raises where ``strict`` (a load), and is left as it is otherwise (state the
    optimizer holds already: a save or a step says what is wrong with it). Of a 0-d parameter,
    the 0-d values but those under ``scalars`` are its per-element state, cut as any."""
    info = piece_of(param) if param is not None else None
    if info is None:
        return entry
    full, start, stop, shape = info
    assert isinstance(param, nn.Parameter)
    if owns is not None:  # stepped whole: the owner keeps it as it is, made like the param's
        if not owns(param):
            return None
        whole = {k: _whole(v, f"'{k}' of parameter {index}") for k, v in entry.items()}
        return {k: _made_from(param, v) if _is_state_tensor(v) else v for k, v in whole.items()}
    out = {}
    for key, value in entry.items():
        name = f"optimizer state '{key}' of parameter {index}"
        value = local_piece(value, full, start, stop, name)
        of_element = isinstance(value, Tensor) and not full and key not in scalars
        if not (_is_state_tensor(value) or of_element):
            out[key] = value
        elif tuple(value.shape) == shape:  # this rank's own piece
            out[key] = value.as_subclass(Tensor) if isinstance(value, ShardPiece) else value
        elif value.shape == full:
            piece = value.reshape(-1)[start:stop].view(shape)
            out[key] = torch.empty_like(param, dtype=value.dtype)  # where the state lives
            with torch.no_grad():
                out[key].copy_(piece)
        elif not strict:
            out[key] = value
        else:
            raise ValueError(
                f"load_state_dict: optimizer state '{key}' of parameter {index} has shape "
                f"{tuple(value.shape)}, neither the parameter's {tuple(full)} nor this rank's "
                f"piece's {shape}. Load the optimizer state of the unwrapped model (or of "
                "shardwrap.full_optimizer_state_dict), or this rank's own state_dict()."
            )
    return out


def _whole(value: Tensor, name: str) -> Tensor:
    """Whole-stepped state as loaded: a :class:`DCPPiece` of it must hold all of it."""
    if isinstance(value, DCPPiece):
        return local_piece(value, value.full_shape, 0, value.full_shape.numel(), name)
    return value


def _made_from(param: nn.Parameter, value: Tensor) -> Tensor:
    """Whole-stepped state ``value``, made from the shard parameter as the optimizer makes such
    state (``new_empty``: in the disk tier's files) where it is floating point; state in an
    optimizer's own subclass as it is (copying it into a plain tensor would dequantize it)."""
    if _packed(value):
        return value
    if not value.is_floating_point():
        return value.as_subclass(Tensor) if isinstance(value, ShardPiece) else value
    out = param.new_empty(value.shape, dtype=value.dtype)
    with torch.no_grad():
        out.copy_(value)
    return out
