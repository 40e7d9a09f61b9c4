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
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

__all__ = ["PIECE_ATTR", "ShardPiece", "adopt_optimizer", "as_piece"]

PIECE_ATTR = "_shardwrap_piece"  # on a shard parameter: (its FlatGroup, weakly; index; CommStats)

# What to call instead of saving a rank's state dict (every rank calls them).
SAVE_FIXES = (
    "On every rank, call model.full_state_dict(rank0_only=True) and "
    "shardwrap.full_optimizer_state_dict(model, optimizer, rank0_only=True), then torch.save "
    "them on rank 0 (a file that loads into the unwrapped model, or at any world size); or "
    "shardwrap.save_checkpoint(path, model, optimizer) on every rank (each rank writes its "
    "pieces). See docs/ddp.md"
)


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

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: this rank's piece would be saved as if it were the whole tensor."""
        shape = getattr(self, "full_shape", None)
        held = "" if shape is None else f" (elements {self.start}:{self.stop} of {tuple(shape)})"
        raise TypeError(
            f"shardwrap: saving this rank's piece of a sharded tensor{held}, of shape "
            f"{tuple(self.shape)}: a sharded model's state_dict() and its optimizer's hold "
            "each rank's pieces, so a state dict saved on one rank would hold that rank's "
            f"pieces under the full names and lose the others'. {SAVE_FIXES}."
        )

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
        params = _params(optimizer)
        state = {}
        for i, entry in state_dict["state"].items():
            param = params[i] if isinstance(i, int) and 0 <= i < len(params) else None
            kept = _cut_entry(param, entry, owns, i, strict=True)
            if kept is not None:
                state[i] = kept
        return {**state_dict, "state": state}

    optimizer.register_state_dict_post_hook(mark)
    optimizer.register_load_state_dict_pre_hook(cut)
    index = {id(p): i for i, p in enumerate(_params(optimizer))}
    for param, entry in list(optimizer.state.items()):  # loaded before the engine saw it
        kept = _cut_entry(param, entry, owns, index.get(id(param)), strict=False)
        if kept is None:
            del optimizer.state[param]
        else:
            optimizer.state[param] = kept


def _params(optimizer: Optimizer) -> list[Tensor]:
    """The optimizer's parameters in the order its ``state_dict()`` numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def _is_state_tensor(value: Any) -> bool:
    """A tensor of per-element state (not ``step``, a 0-d tensor)."""
    return isinstance(value, Tensor) and value.ndim > 0


def _packed(value: Tensor) -> bool:
    """State an optimizer keeps in a tensor subclass of its own (a low-bit optimizer's
    quantized state): only that optimizer reads it, so it is handed on as it is."""
    return type(value) is not Tensor and not isinstance(value, ShardPiece)


def _marked(optimizer: Optimizer, state_dict: dict[str, Any], owns: Owns | None) -> dict:
    """``state_dict`` with each sharded parameter's state tensors as pieces (new entries: the
    optimizer's own state is left plain)."""
    params = _params(optimizer)
    state = {}
    for i, entry in state_dict["state"].items():
        info = piece_of(params[i]) if isinstance(i, int) and 0 <= i < len(params) else None
        if info is None:
            state[i] = entry
            continue
        full, start, stop, shape = info
        state[i] = {
            key: (
                as_piece(v, v.shape, 0, v.numel())  # whole, on its owner alone
                if owns is not None
                else as_piece(v, full, start, stop)
            )
            if _is_state_tensor(v)
            and not _packed(v)
            and (owns is not None or tuple(v.shape) == shape)
            else v
            for key, v in entry.items()
        }
    return {**state_dict, "state": state}


def _cut_entry(
    param: Tensor | None, entry: dict[str, Any], owns: Owns | None, index: Any, strict: bool
) -> dict[str, Any] | None:
    """One parameter's loaded state as this rank holds it; ``None`` where it holds none (a
    parameter stepped whole on another rank). A tensor of neither the parameter's shape nor its
    piece's raises where ``strict`` (a load), and is left as it is otherwise (state the
    optimizer holds already: a save or a step says what is wrong with it)."""
    info = piece_of(param) if param is not None else None
    if info is None:
        return entry
    full, start, stop, shape = info
    assert isinstance(param, nn.Parameter)
    if owns is not None:  # stepped whole: the owner keeps it as it is, made like the param's
        if not owns(param):
            return None
        return {k: _made_from(param, v) if _is_state_tensor(v) else v for k, v in entry.items()}
    out = {}
    for key, value in entry.items():
        if not _is_state_tensor(value):
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
