"""Loading state dicts into a sharded model: the unwrapped model's full one, or a rank's own
pieces (``ShardedModule.load_state_dict`` and ``load_full_state_dict``), and a submodule's own
``load_state_dict`` of whole values.

Design note. A submodule of a sharded model is a plain module whose registered parameters are
this rank's pieces, so torch's ``load_state_dict`` on it (``model.blocks[0].load_state_dict(sd)``,
as on the unwrapped model) would compare each whole value's shape with the piece's and raise,
on the ranks whose piece is not the whole parameter (a rank holding a whole vector would load
it, and the ranks would part ways). :func:`guard_submodule_loads` gives each module holding
pieces a load pre-hook that cuts each whole value to this rank's piece (inside ``gathered()``
also written into the full parameter), as the model's own ``load_state_dict`` does; it takes
the pieces DCP loaded too, where DCP reached the model through another module
(``torch.compile(model)``, a module holding it), which loads it module by module.

The model's own load of a full state dict checks every key and shape first and loads nothing
where one is wrong, then copies each rank's pieces. Where a module changes how it loads (a
``load_state_dict`` hook of the user's: renamed keys of an older checkpoint, a conversion; a
class's own ``_load_from_state_dict``, as torch's batch norms fill in ``num_batches_tracked``,
which older checkpoints lack), the model loads through torch's own ``load_state_dict`` instead,
so those run as on the unwrapped model, with the pre-hooks above run last on each module: they
see what the user's made of the state dict.

A value of this rank's piece shape is loaded as a piece only where the state dict says it is
this rank's own: its ``state_dict()``'s metadata, or the piece's own tensor (a copy of one
included). Any other (a file of pieces written by another library, a tensor of another size
that happens to share the piece's shape) is refused with torch's size mismatch, as the
unwrapped model refuses it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..optim.dcp_pieces import DCPPiece, local_piece, local_pieces
from ..optim.pieces import ShardPiece
from ..shards.tensor_parallel import is_dtensor
from ..step.edits import write_through

__all__ = [
    "SHARDS_OF",
    "StateDictKeysError",
    "StateDictShapeError",
    "guard_submodule_loads",
    "load_full",
    "load_state",
]

# In ``state_dict()._metadata[""]``: whose shards the state dict holds, (shard rank, shard size).
SHARDS_OF = "shardwrap_shards_of"


def load_state(model: Any, state_dict: Mapping[str, Any], strict: bool) -> Any:
    """``model.load_state_dict(state_dict, strict)``: see :meth:`ShardedModule.load_state_dict`."""
    _refuse_split(state_dict)
    own = nn.Module.state_dict(model, keep_vars=True)
    index = model._shardwrap_root.param_of
    checked = {k for k, v in state_dict.items() if isinstance(v, DCPPiece)}  # this rank's
    if checked:  # set_model_state_dict
        ranges = {
            k: (p.shape, p.group.pieces[p.index])
            for k, v in own.items()
            if (p := index.get(id(v))) is not None
        }
        state_dict = local_pieces(state_dict, ranges)
    vouched = _own_shards_noted(model, state_dict)
    full, shard, neither, itself = [], [], [], []
    for key, value in state_dict.items():
        param = index.get(id(own.get(key)))
        if param is None or not isinstance(value, Tensor):
            continue
        if _is_itself(value, own[key]):  # DCP's stand-in for a key a full state lacks
            itself.append(key)
            continue
        shape = tuple(value.shape)
        is_full, is_shard = shape == param.shape, shape == tuple(param.shard.shape)
        if is_full and is_shard:  # a vector whole on this rank: either reading
            continue
        if is_full:
            full.append(key)
        elif is_shard and (vouched or key in checked or _own_piece(model, key, value, param)):
            shard.append(key)
        else:
            neither.append(_size_mismatch(key, value.shape, param.shape))
    if neither or (full and shard):
        raise StateDictShapeError(
            "load_state_dict: "
            + (" ".join(neither[:4]) if neither else "full values and pieces mixed.")
            + " A sharded model takes the unwrapped model's full state dict, or this rank's "
            "own state_dict() (a tensor shaped as this rank's piece is taken for one only from "
            "it, or from a copy of its tensors). Use model.load_full_state_dict(sd) for a full "
            "state dict, or shardwrap.save_checkpoint / load_checkpoint to resume at any world "
            "size."
        )
    if full and itself:  # keep what DCP stood in with, as it is: the rest is a full state
        missing = [k for k in own if k not in state_dict]
        unexpected = [k for k in state_dict if k not in own]
        if strict and (missing or unexpected):
            raise _keys_error(model, missing, unexpected)
        load_full(model, {k: v for k, v in state_dict.items() if k not in itself}, False)
        return nn.modules.module._IncompatibleKeys(missing, unexpected)
    if full:
        return load_full(model, state_dict, strict)
    return load_through_torch(model, state_dict, strict)


def customises_loading(model: nn.Module) -> bool:
    """Whether a module of ``model`` changes how it loads (see the note)."""
    for m in model.modules():
        if m._load_state_dict_post_hooks or not all(
            _is_cut(h) for h in m._load_state_dict_pre_hooks.values()
        ):
            return True
        if type(m)._load_from_state_dict is not nn.Module._load_from_state_dict:
            return True
    return False


def load_through_torch(model: nn.Module, state_dict: Mapping[str, Any], strict: bool) -> Any:
    """torch's ``load_state_dict`` of ``model``, whose cutting pre-hooks run last."""
    for m in model.modules():
        hooks = m._load_state_dict_pre_hooks
        for key in [key for key, h in hooks.items() if _is_cut(h)]:
            hooks.move_to_end(key)
    return nn.Module.load_state_dict(model, state_dict, strict=strict)


def _is_cut(hook: Any) -> bool:
    fn = getattr(hook, "hook", hook)  # torch keeps a registered hook in a _WrappedHook
    return isinstance(fn, functools.partial) and fn.func is _cut_whole_values


def _is_itself(value: Tensor, param: Tensor) -> bool:
    """Whether ``value`` is the parameter's piece itself (its memory, its shape)."""
    return value.shape == param.shape and value.data_ptr() == param.data_ptr()


class StateDictKeysError(KeyError, RuntimeError):
    """Keys missing from a full state dict, or unknown to the model, with ``strict``: a
    ``KeyError`` naming them, and the ``RuntimeError`` torch's ``load_state_dict`` raises."""

    def __str__(self) -> str:
        return str(self.args[0])  # as a RuntimeError reads, not quoted as a KeyError's key


class StateDictShapeError(ValueError, RuntimeError):
    """Values of the wrong shape, named as torch names them (``size mismatch for ...``): the
    ``RuntimeError`` torch's ``load_state_dict`` raises, and a ``ValueError``."""


def _keys_error(model: Any, missing: list[str], unexpected: list[str]) -> StateDictKeysError:
    """Named as torch names them (``Missing key(s) in state_dict: ...``), with the fix."""
    said = [
        f"{kind} key(s) in state_dict: " + ", ".join(f'"{k}"' for k in keys) + "."
        for kind, keys in (("Missing", missing), ("Unexpected", unexpected))
        if keys
    ]
    return StateDictKeysError(
        f"load_full_state_dict: Error(s) in loading state_dict for {type(model).__name__}:"
        + "".join(f"\n\t{line}" for line in said)
        + "\nPass the state dict of the same model class and configuration "
        "(model.full_state_dict() or the unwrapped model's state_dict()), or "
        "strict=False to load only the keys given."
    )


def _refuse_split(state_dict: Mapping[str, Any]) -> None:
    """Refuse, before anything is loaded, a state dict holding DTensors (a tensor-parallel
    model's own ``state_dict()``): each holds this rank's block of the tensor."""
    split = [k for k, v in state_dict.items() if is_dtensor(v)]
    if split:
        more = f" and {len(split) - 3} more" if len(split) > 3 else ""
        raise ValueError(
            f"load_state_dict: {', '.join(split[:3])}{more} are DTensors (a tensor-parallel "
            "model's state_dict(), each this rank's block of the tensor); nothing was loaded. "
            "Give the whole tensors: {k: v.full_tensor() if isinstance(v, DTensor) else v for "
            "k, v in sd.items()} on every rank, or the sharded model's full_state_dict()."
        )


def _own_shards_noted(model: Any, state_dict: Mapping[str, Any]) -> bool:
    """Whether ``state_dict`` records that it holds this rank's shards (``state_dict()``'s
    metadata); one recording another rank's is refused."""
    metadata = getattr(state_dict, "_metadata", None) or {}
    saved = (metadata.get("") or {}).get(SHARDS_OF)
    mesh = model._shardwrap_root.mesh
    here = (mesh.shard_rank, mesh.shard_size)
    if saved is not None and tuple(saved) != here:
        raise _other_ranks(f"the shards of rank {saved[0]} of {saved[1]}", here)
    return saved is not None


def _own_piece(model: Any, key: str, value: Tensor, param: Any) -> bool:
    """Whether ``value``, of this rank's piece shape, is one of this rank's pieces: a tensor of
    a sharded model's ``state_dict()`` (or a copy of one) that holds this rank's elements.
    Another rank's piece is refused; a plain tensor (a file of pieces another library wrote,
    a checkpoint of another size) is not a piece."""
    if not isinstance(value, ShardPiece):
        return False
    start = getattr(value, "start", None)
    piece = param.group.pieces[param.index]
    if start is not None and (start, value.stop) != (piece.start, piece.stop):
        mesh = model._shardwrap_root.mesh
        held = f"elements {start}:{value.stop} of {key}, another rank's piece,"
        raise _other_ranks(held, (mesh.shard_rank, mesh.shard_size))
    return True


def _other_ranks(held: str, here: tuple[int, int]) -> ValueError:
    return ValueError(
        f"load_state_dict: the state dict holds {held} and this is rank {here[0]} of "
        f"{here[1]}: each rank loads only its own state_dict(). Use shardwrap.save_checkpoint "
        "/ load_checkpoint (any world size), or save model.full_state_dict() and load it "
        "with load_state_dict."
    )


def _size_mismatch(key: str, given: torch.Size, shape: Any) -> str:
    """torch's words for a value of the wrong shape."""
    return (
        f"size mismatch for {key}: copying a param with shape {torch.Size(given)} from "
        f"checkpoint, the shape in current model is {torch.Size(shape)}."
    )


def load_full(model: Any, state_dict: Mapping[str, Tensor], strict: bool) -> Any:
    """``model.load_full_state_dict(state_dict, strict)``: see
    :meth:`ShardedModule.load_full_state_dict`."""
    root = model._shardwrap_root
    root.check_state()
    _refuse_split(state_dict)
    if customises_loading(model):
        return load_through_torch(model, state_dict, strict)
    own = nn.Module.state_dict(model, keep_vars=True)
    missing = [k for k in own if k not in state_dict]
    unexpected = [k for k in state_dict if k not in own]
    if strict and (missing or unexpected):
        raise _keys_error(model, missing, unexpected)
    own = {k: v for k, v in own.items() if k in state_dict}
    index = root.param_of
    wrong = []
    for k, v in own.items():
        shape = index[id(v)].shape if id(v) in index else v.shape
        if tuple(state_dict[k].shape) != tuple(shape):
            wrong.append(_size_mismatch(k, state_dict[k].shape, shape))
    if wrong:
        raise StateDictShapeError(
            f"load_full_state_dict: Error(s) in loading state_dict for {type(model).__name__}:"
            + "".join(f"\n\t{line}" for line in wrong)
            + "\nNothing was loaded."
        )
    done: set[int] = set()
    loaded = []
    with torch.no_grad():
        for k, v in reversed(own.items()):  # of tied keys, the last one's value, as in torch
            if id(v) in done:
                continue
            done.add(id(v))
            value = state_dict[k].to(v.device)
            if id(v) in index:
                param = index[id(v)]
                v.copy_(param.group.piece_of(param.index, value))
                loaded.append((param.group, param.index, value))
            else:
                v.copy_(value)
    write_through(root, loaded)  # inside gathered(): the full parameters too
    return nn.modules.module._IncompatibleKeys(missing, unexpected)


def guard_submodule_loads(model: nn.Module, root: Any) -> None:
    """Give each module of ``model`` that holds pieces a ``load_state_dict`` pre-hook cutting
    whole values to this rank's pieces (see the note)."""
    groups = [g for u in root.units for g in u.groups]
    holders = {id(m): m for g in groups for slots in g.slots for m, _ in slots}
    ref = weakref.ref(root)
    for m in holders.values():
        m.register_load_state_dict_pre_hook(functools.partial(_cut_whole_values, root=ref))


def _cut_whole_values(
    module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any, root: Any
) -> None:
    live = root()
    if live is None:
        return
    loaded = []
    with torch.no_grad():
        for attr, p in module._parameters.items():
            param = live.param_of.get(id(p))
            value = state_dict.get(prefix + attr)
            if param is None or not isinstance(value, Tensor):
                continue
            if isinstance(value, DCPPiece):  # DCP's load of a model it reached through another
                piece = param.group.pieces[param.index]
                shown = local_piece(value, param.shape, piece.start, piece.stop, prefix + attr)
                state_dict[prefix + attr] = shown.reshape(p.shape)
                continue
            if value is p:
                continue
            if tuple(value.shape) != tuple(param.shape):
                if tuple(value.shape) != tuple(p.shape):  # torch would name the piece's shape
                    args[-1].append(
                        f"size mismatch for {prefix}{attr}: copying a param with shape "
                        f"{value.shape} from checkpoint, the shape in current model is "
                        f"{torch.Size(param.shape)}."
                    )
                    state_dict[prefix + attr] = p
                continue  # else a piece: this rank's own state_dict()
            value = value.to(p.device)
            p.copy_(param.group.piece_of(param.index, value).reshape(p.shape))
            loaded.append((param.group, param.index, value))
            state_dict[prefix + attr] = p  # torch copies the piece into itself
    write_through(live, loaded)
