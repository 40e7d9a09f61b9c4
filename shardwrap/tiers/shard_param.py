"""Shard parameters: this rank's pieces of a unit's parameters, views of its flat shard.

Design note. A piece shares the flat shard's version counter, so every write through it (an
optimizer's step, ``copy_`` under ``no_grad``, a load) counts there, and that count is how a
unit that stays gathered (stages 1 and 2, ``reshard_after_forward=False``, ``keep_gathered``)
or a copy staged for the host tier learns that its shard changed. ``p.data`` is torch's way
around the count: the same memory under a counter of its own. Through it an EMA swap
(``p.data.copy_(ema)``, then back), an initialiser (``p.data.normal_()``) or a hand-written
optimizer would change the shard unseen, and a unit kept gathered would go on computing with
the old values, or with its own rank's slice new and the others' old. So a shard parameter's
``data`` is ``p.detach()``, the same memory under the same counter, and ``p.data = t`` copies
``t``'s values into the piece: the piece's memory is its slot of the flat shard, which another
tensor cannot become. A ``t`` of another shape, dtype or device is refused, naming the
parameter. The engine's own swaps (whole-parameter steps, the planner's) use :func:`raw_data`
and :func:`set_raw_data`, torch's own accessors.

``p.data`` is a :class:`ShardData`, so that what is refused on the piece is refused through it
too: a random draw (an initialiser written ``self.weight.data.normal_()``), a collective (a DDP
script's ``dist.broadcast(p.data, 0)``) and pickling (``torch.save({n: p.data ...})`` on rank
0 would write this rank's piece as the whole parameter). What is computed from it is a plain
tensor, as from the piece itself. On both, a copy of a value of the whole parameter's shape
(``p.copy_(sd[name])``, FSDP's loading loop over ``named_parameters()``) is refused naming
``load_state_dict``, instead of torch's size mismatch, as is any call combining the piece
with a plain tensor of the whole parameter's shape (an EMA made before wrapping, lerped with
the pieces: where the shapes broadcast, other elements blended without a word; 1.2 us more per
call on a piece), and so is indexing by position (``m.weight[0].zero_()``): a position in the
piece is not the parameter's. Every element and a boolean mask of the piece's shape are
allowed.

A random draw on the piece itself (``nn.init``'s initialisers, ``p.normal_()``) is refused:
see :class:`ShardParam`. Its ``__torch_function__`` costs a Python call per torch call on a
piece: a for-loop AdamW step over 150 pieces of 50,000 elements took 18.4 ms instead of
16.4 ms on this project's 2-core machine, a foreach step 34.8 ms either way.
"""

from __future__ import annotations

import inspect
import math
import sys
from typing import Any, NoReturn, TypeVar

import torch
import torch.distributed.distributed_c10d as dist_c10d
from torch import Tensor, nn
from torch._C import TensorBase
from torch.nn.utils import parametrize, prune

__all__ = [
    "NAME_ATTR",
    "SHAPE_ATTR",
    "ShardData",
    "ShardParam",
    "copies_whole_into",
    "first_among",
    "is_collective",
    "not_a_dtensor",
    "raw_data",
    "set_raw_data",
    "whole_beside",
    "whole_beside_piece",
]

T = TypeVar("T")

NAME_ATTR = "_shardwrap_name"  # on a shard parameter: its name in the model, for messages
SHAPE_ATTR = "_shardwrap_shape"  # on a shard parameter: the whole parameter's shape

_DATA = TensorBase.data  # torch's accessor: a fresh version counter, rebinding on assignment


def raw_data(p: Tensor) -> Tensor:
    """``p.data`` as torch makes it, for any tensor: writes through it are not counted."""
    return _DATA.__get__(p)


def set_raw_data(p: Tensor, value: Tensor) -> None:
    """``p.data = value`` as torch does it, for any tensor: ``p`` now uses ``value``'s memory."""
    _DATA.__set__(p, value)


# In-place random draws, and the initialisers of ``torch.nn.init`` that hand their tensor to
# ``__torch_function__`` before drawing (the others draw through the methods).
_DRAWS = frozenset(
    {
        Tensor.uniform_,
        Tensor.normal_,
        Tensor.bernoulli_,
        Tensor.cauchy_,
        Tensor.exponential_,
        Tensor.geometric_,
        Tensor.log_normal_,
        Tensor.random_,
        nn.init.uniform_,
        nn.init.normal_,
        nn.init.kaiming_uniform_,
    }
)

# The initialisers of ``torch.nn.init`` that read the tensor's shape and write without a draw
# on it or a ``__torch_function__`` of their own (an identity through ``out=``, an orthogonal
# matrix drawn elsewhere and copied in, a Dirac delta after zeroing): each asks ``dim()``
# first, from its own code, and is known there by that code.
_SHAPED_INITS = {f.__code__: f for f in (nn.init.eye_, nn.init.orthogonal_, nn.init.dirac_)}
_DIM = frozenset({Tensor.dim, Tensor.ndimension})


_DTENSOR_ONLY = frozenset({"full_tensor", "to_local", "redistribute", "placements", "device_mesh"})


def not_a_dtensor(self: Tensor, name: str) -> NoReturn:
    """The pieces' ``__getattr__``, called only for an attribute one lacks: a DTensor's own
    (FSDP2's ``p.full_tensor()``, ``sd[k].full_tensor()``) raise naming what gives the whole
    values here."""
    message = f"'{type(self).__name__}' object has no attribute '{name}'"
    if name in _DTENSOR_ONLY:
        message += (
            ": a sharded model's parameters, their .grad and the values of its state_dict() "
            "are this rank's pieces, plain tensors, not DTensors. For whole values call "
            "model.full_state_dict() on every rank (shardwrap.full_optimizer_state_dict for "
            "the optimizer's), or read the modules' attributes inside "
            "`with model.gathered():` (with_grads=True for whole gradients; a gradient's "
            "norm, p.grad.norm(), is the whole one's already). See docs/fsdp.md"
        )
    raise AttributeError(message)


class ShardParam(nn.Parameter):
    """A shard parameter: a ``Parameter`` whose ``data`` writes count as writes to it (see the
    module's note), and on which a random or shape-reading initialiser is refused.

    An initialiser run on a piece reads the piece's shape, ``(1, ..., n)``: a fan-based one
    (``kaiming_*``, ``xavier_*``) scales its draws by ``n`` instead of the parameter's fans,
    and every rank's piece draws the same numbers from the same generator. Refused before it
    writes, naming where it runs right: before wrapping, or on the full parameters inside
    ``model.gathered(modifier_rank=0)``.

    Gradients with respect to pieces are refused too, naming ``loss.backward()``: forward
    computes with the full parameters gathered for it, never with the pieces, so no model's
    graph holds a piece. ``loss.backward(inputs=pieces)`` would leave their ``.grad`` as it was
    without a word; ``torch.autograd.grad(loss, pieces)`` would say only that they are unused
    (a graph built on a piece itself, a penalty on it, is differentiated as usual).
    """

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        _refuse_on_piece(ShardParam, func, args, kwargs)
        if func is torch.autograd.backward:  # would leave every piece's .grad as it was
            raise RuntimeError(_differentiated(func, first_among(ShardParam, args, kwargs)))
        if func is torch.autograd.grad:  # fine where a piece is in the graph (a penalty on it)
            return _grad_of_pieces(func, types, args, kwargs)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    @property
    def data(self) -> Tensor:  # type: ignore[override]
        """The piece's values outside autograd, under its version counter (a
        :class:`ShardData`)."""
        data = self.detach().as_subclass(ShardData)
        for attr in (NAME_ATTR, SHAPE_ATTR):
            if hasattr(self, attr):
                setattr(data, attr, getattr(self, attr))
        return data

    @data.setter
    def data(self, value: Tensor) -> None:
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            name = getattr(self, NAME_ATTR, "a shard parameter")
            raise ValueError(
                f"{name}.data = ... assigns a tensor of shape {tuple(value.shape)} "
                f"({value.dtype}, {value.device}) to this rank's piece of {name}, of shape "
                f"{tuple(self.shape)} ({self.dtype}, {self.device}). A sharded model's "
                "parameters are its pieces, views of their unit's flat shard: assign a tensor "
                "of the piece's shape, dtype and device (its values are copied in); write the "
                f"whole parameter with model.load_state_dict({{'{name}': value}}, strict=False) "
                "or inside model.gathered(writeback=True); change a dtype or a device before "
                "wrapping."
            )
        if value.data_ptr() == self.data_ptr() and value.stride() == self.stride():
            return  # the piece itself (Module._apply's no-op conversions assign it back)
        self.detach().copy_(value)

    __getattr__ = not_a_dtensor

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: see :func:`_pickled_piece`."""
        raise TypeError(_pickled_piece(self))

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """Refused: a copy of a submodule of a sharded model (``copy.deepcopy(model.block)``,
        ``fuse_conv_bn_eval``) would hold this rank's pieces and shardwrap's hooks, which gather
        the original model's units. ``copy.deepcopy(model)`` of the whole model makes a sharded
        copy and never copies a piece so."""
        raise TypeError(_copied_piece(self))


class ShardData(Tensor):
    """A shard parameter's ``data``: the piece's memory under its version counter, refusing
    what the parameter refuses (random draws, collectives) and pickling. What is computed from
    it is a plain tensor."""

    @classmethod
    def __torch_function__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        _refuse_on_piece(ShardData, func, args, kwargs)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    __getattr__ = not_a_dtensor

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: see :func:`_pickled_piece`."""
        raise TypeError(_pickled_piece(self))


def _refuse_on_piece(cls: type, func: Any, args: tuple, kwargs: dict) -> None:
    """Refuse a random draw or a collective on a piece (an instance of ``cls``), and a copy of
    a whole parameter's value into it."""
    if func in _DRAWS:
        raise ValueError(_drawn_on_piece(func, first_among(cls, args, kwargs)))
    if func in _DIM and (init := _SHAPED_INITS.get(sys._getframe(2).f_code)):  # the caller's
        raise ValueError(_drawn_on_piece(init, first_among(cls, args, kwargs)))
    if is_collective(func):
        raise TypeError(_sent_piece(func, first_among(cls, args, kwargs)))
    if func in _INDEXING and isinstance(args[0], cls) and not _elementwise(args[0], args[1]):
        raise IndexError(_indexed_piece(args[0]))
    if copies_whole_into(cls, func, args, SHAPE_ATTR):
        raise ValueError(_whole_into_piece(args[0]))
    if (piece := whole_beside_piece(cls, func, args, SHAPE_ATTR)) is not None:
        name = getattr(piece, NAME_ATTR, "a shard parameter")
        held = f"{name}, this rank's piece of it (shape {tuple(piece.shape)}),"
        raise ValueError(whole_beside(func, held, tuple(getattr(piece, SHAPE_ATTR))))
    if func is torch._weight_norm or (func in _MUL and sys._getframe(2).f_code is _APPLY_MASK):
        raise ValueError(_whole_only(func, first_among(cls, args, kwargs)))
    if getattr(func, "__self__", None) is _SHAPE and sys._getframe(2).f_code is _PARAMETRIZING:
        raise ValueError(_parametrized_piece(first_among(cls, args, kwargs)))


def copies_whole_into(cls: type, func: Any, args: tuple, shape_attr: str) -> bool:
    """Whether ``func`` is ``Tensor.copy_`` of a value of the whole tensor's shape (the piece's
    attribute ``shape_attr``) into a piece, an instance of ``cls`` of another shape."""
    if func is not Tensor.copy_ or len(args) < 2 or not isinstance(args[0], cls):
        return False
    piece, src = args[0], args[1]
    whole = getattr(piece, shape_attr, None)
    return (
        isinstance(src, Tensor)
        and whole is not None
        and src.shape != piece.shape
        and tuple(src.shape) == tuple(whole)
    )


_PLAIN = (Tensor, nn.Parameter)  # tensors without a __torch_function__ of their own


def whole_beside_piece(cls: type, func: Any, args: tuple, shape_attr: str) -> Tensor | None:
    """A piece (an instance of ``cls``, of more than one element in all) that ``args`` combine
    with a plain tensor of its whole tensor's shape, not its own (for a foreach call, an
    element of one list with the same element of another), or ``None``. Such a pair never
    lines up: where their shapes broadcast the call would blend other elements without a word.
    A whole of one element is left alone: beside its empty piece, or its piece of one element,
    every call computes what it would on the whole. A property's setter (``p.grad = g``) is
    left to its own checks. A plain tensor's shape costs nothing to read; a piece's is read
    only where a plain tensor has the whole's."""
    if len(args) < 2 or getattr(func, "__name__", None) == "__set__":
        return None
    if isinstance(args[0], (list, tuple)):
        rows: Any = zip(*(a for a in args if isinstance(a, (list, tuple))))
    else:
        rows = (args,)
    for row in rows:
        shapes = [t.shape for t in row if type(t) in _PLAIN]
        if not shapes:
            continue
        for piece in row:
            if isinstance(piece, cls) and getattr(piece, shape_attr, None) in shapes:
                whole = getattr(piece, shape_attr)
                with torch._C.DisableTorchFunctionSubclass():  # without the piece's own call
                    if piece.shape != whole and math.prod(whole) > 1:
                        return piece
    return None


_INDEXING = frozenset({Tensor.__getitem__, Tensor.__setitem__})


def _elementwise(piece: Tensor, index: Any) -> bool:
    """Whether ``index`` selects elements of the piece by what they hold, not where they sit:
    every element (``...``, ``:``), or a boolean mask of the piece's shape."""
    if isinstance(index, Tensor):
        return index.dtype == torch.bool and index.shape == piece.shape
    parts = index if isinstance(index, tuple) else (index,)
    return all(i is Ellipsis or (isinstance(i, slice) and i == slice(None)) for i in parts)


def is_collective(func: Any) -> bool:
    """Whether ``func`` is one of ``torch.distributed``'s collectives or point-to-point calls,
    which hand their tensors to ``__torch_function__`` before any communication."""
    return getattr(func, "__module__", None) == dist_c10d.__name__


def first_among(cls: type[T], args: tuple, kwargs: dict | None) -> T:
    """The first instance of ``cls`` among a call's arguments, or in a list or tuple there:
    the tensor a ``__torch_function__`` that refuses the call names."""
    for v in (*args, *(kwargs or {}).values()):
        for a in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(a, cls):
                return a
    raise LookupError(f"no {cls.__name__} among the call's arguments")


def _drawn_on_piece(func: Any, piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    module = getattr(func, "__module__", None)
    where = f"{module}.{func.__name__}" if module else f"Tensor.{func.__name__}"
    return (
        f"{where} on {name}, this rank's piece of it (shape {tuple(piece.shape)}): an "
        "initialiser on a piece reads the piece's shape (nn.init's kaiming_* and xavier_* would "
        "scale by it, not by the parameter's fans; eye_ and orthogonal_ would make the piece's "
        "own matrix), and every rank's piece would draw the same numbers. Initialise before "
        "wrapping (or build on the meta device and pass param_init_fn=), or initialise the "
        "full parameters as module attributes inside `with model.gathered(modifier_rank=0):` "
        "(e.g. nn.init.xavier_uniform_(block.attn.weight); model.parameters() stays the pieces "
        "there)."
    )


def _sent_piece(func: Any, piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"torch.distributed.{func.__name__} of {name}, this rank's piece of it (shape "
        f"{tuple(piece.shape)}): each rank holds other elements of a sharded parameter, so a "
        "collective over the pieces would mix different elements (or wait forever where their "
        "sizes differ). Nothing was sent. Every rank already starts from rank 0's weights "
        "(copied when wrapping, as DDP copies them) and ends each step alike: drop the call. "
        "To change the whole parameter on every rank, write it inside "
        "`with model.gathered(modifier_rank=0):` (rank 0's edits reach every rank)."
    )


def _indexed_piece(piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"indexing {name}, this rank's piece of it (shape {tuple(piece.shape)}): a position "
        "in the piece is not that position in the parameter (the piece's row 0 is this rank's "
        "whole range of the flattened parameter), so the rows, columns or elements it would "
        "read or write are other ones, different on each rank. Index the full parameter: the "
        "module's attribute inside `with model.gathered(writeback=True):` (e.g. "
        "emb.weight[pad_id].zero_()). Elementwise writes need no position: p[p.abs() < t] = 0 "
        "(a mask of the piece's shape) is allowed."
    )


def _whole_into_piece(piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"{name}.copy_(value) with a value of the whole parameter's shape "
        f"{getattr(piece, SHAPE_ATTR)} into this rank's piece of it (shape "
        f"{tuple(piece.shape)}): model.parameters() and named_parameters() are the pieces, "
        "also inside model.gathered(). Load whole values with "
        "model.load_state_dict(state_dict) (strict=False for some of them, or a submodule's "
        "own load_state_dict), which each rank cuts to its pieces; or, inside "
        "`with model.gathered(writeback=True):`, copy into the module's attribute (the full "
        "parameter), e.g. model.get_submodule('...').weight.copy_(value)."
    )


def whole_beside(func: Any, held: str, whole: tuple[int, ...]) -> str:
    """The refusal of ``func`` combining a piece (``held`` says which) with a tensor of its
    whole tensor's shape ``whole`` (see :func:`whole_beside_piece`)."""
    return (
        f"{getattr(func, '__name__', func)} combines {held} with a tensor of the whole "
        f"tensor's shape {whole}: a sharded model's parameters and state_dict() are this "
        "rank's pieces, so the two would blend different elements (without a word where "
        "their shapes broadcast). Nothing was changed. A copy of the model made before "
        "wrapping (an EMA such as timm's ModelEmaV3, made before the DDP wrapper there) holds "
        "whole tensors: make it after wrapping, from the sharded model "
        "(ModelEmaV3(sharded_model), AveragedModel(sharded_model): copy.deepcopy of a sharded "
        "model is a sharded copy, laid out alike), or read whole values with "
        "model.full_state_dict()."
    )


# What computes a whole weight from its parameters outside forward, where they are pieces:
# weight normalisation (``remove_weight_norm``; on an empty piece torch's kernel crashes the
# process) and pruning's mask (``prune.remove``), each known by its code.
_MUL = frozenset({Tensor.mul, Tensor.__mul__, Tensor.__rmul__})
_APPLY_MASK = prune.BasePruningMethod.apply_mask.__code__


# A parametrization registered on a piece: its list reads the original's shape first.
_SHAPE = Tensor.shape
_PARAMETRIZING = parametrize.ParametrizationList.__init__.__code__


def _parametrized_piece(piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"register_parametrization on this rank's piece of {name} (shape {tuple(piece.shape)}): "
        "after wrapping a sharded model's parameters are their pieces, and a parametrization "
        "would compute on them and register them anew, outside the shards. Register it before "
        "wrapping (parametrizations, weight_norm and spectral_norm train as on the plain model "
        "then). Nothing was changed."
    )


def _whole_only(func: Any, piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"{getattr(func, '__name__', func)} of this rank's piece of {name} (shape "
        f"{tuple(piece.shape)}): outside forward a sharded model's parameters are their "
        "pieces, views of their unit's flat shard. Removing a parametrization or weight norm "
        "(remove_parametrizations, remove_weight_norm, remove_spectral_norm) and pruning's "
        "prune.remove compute the whole weight and replace the parameter: do it before "
        "wrapping, or on the unwrapped model after loading model.full_state_dict() into it. "
        "Nothing was changed."
    )


def _copied_piece(piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"copy.deepcopy of a submodule holding {name}, this rank's piece (shape "
        f"{tuple(piece.shape)}) of a sharded model's parameter: the copy would hold the pieces "
        "and shardwrap's hooks, which gather the original model's units. copy.deepcopy(model) "
        "of the whole model makes a sharded copy; for a plain copy of a part, copy it before "
        "wrapping, or build one and load its keys of model.full_state_dict() (every rank "
        "calls it) into it."
    )


def _pickled_piece(piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"pickling {name} (torch.save), this rank's piece of it (shape {tuple(piece.shape)}): a "
        "file would hold it as if it were the whole parameter, and the other ranks' pieces "
        "would be lost. On every rank, call model.full_state_dict(rank0_only=True) and "
        "torch.save it on rank 0 (it loads into the unwrapped model), or call "
        "shardwrap.save_checkpoint(path, model, optimizer) (each rank writes its pieces). A "
        "copy of the piece for yourself (an EMA) is p.detach().clone()."
    )


def _grad_of_pieces(func: Any, types: Any, args: tuple, kwargs: dict) -> Any:
    """``torch.autograd.grad`` with pieces among its inputs: refused for a piece the graph does
    not hold, also where torch would answer ``None`` (``allow_unused``) or zeros
    (``materialize_grads``) for it, as it would for every parameter of the sharded model."""
    call = inspect.signature(torch.autograd.grad).bind(*args, **kwargs)
    materialize = bool(call.arguments.get("materialize_grads"))
    if not (materialize or call.arguments.get("allow_unused")):
        try:
            return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
        except RuntimeError as e:
            if "not have been used in the graph" not in str(e):
                raise
            piece = first_among(ShardParam, args, kwargs)
            raise RuntimeError(_differentiated(func, piece)) from e
    call.arguments.update(allow_unused=True, materialize_grads=False)
    grads = torch._C._disabled_torch_function_impl(func, types, call.args, call.kwargs)
    inputs = call.arguments["inputs"]
    inputs = (inputs,) if isinstance(inputs, Tensor) else tuple(inputs)
    for t, g in zip(inputs, grads):
        if g is None and isinstance(t, ShardParam):
            raise RuntimeError(_differentiated(func, t))
    if not materialize:
        return grads
    return tuple(torch.zeros_like(t) if g is None else g for t, g in zip(inputs, grads))


def _differentiated(func: Any, piece: Tensor) -> str:
    name = getattr(piece, NAME_ATTR, "a shard parameter")
    return (
        f"torch.autograd.{func.__name__} with respect to {name}, this rank's piece of it: a "
        "sharded model's forward computes with the full parameters gathered for it, never with "
        "the pieces, so no graph holds a piece. Call loss.backward() and read each parameter's "
        ".grad (this rank's piece of the gradient averaged over the ranks; p.grad.norm() and "
        "torch.nn.utils.clip_grad_norm_ give whole norms), or differentiate with respect to "
        "inputs or activations."
    )
