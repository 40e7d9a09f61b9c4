"""Gradient norms over shards: ``torch.nn.utils.clip_grad_norm_`` on a sharded model is global.

Design note. Each shard parameter's ``.grad`` is a :class:`ShardGrad`: a view of the reduced
flat gradient whose type records the group it is sharded over. A norm taken over the whole of
one (``torch.linalg.vector_norm``, ``torch.norm``, ``Tensor.norm``, ``torch.linalg.norm``,
``torch._foreach_norm``: the first step of every clipping routine) yields a
:class:`PartialNorm`, this rank's part of that norm. Moving, stacking or copying partial norms
keeps them partial; reading one's value in any other way completes it with one all-reduce
over the shard group (the sum of p-th powers; max for inf, min for -inf, sum for 0). So
``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` sees the global norm, at the cost
of one small collective, and clips every rank alike, exactly as on the unwrapped model; a
per-parameter norm is that parameter's whole norm.

Completing is a collective: every rank must read the value, as every rank calls every other
collective. Metadata (shape, dtype, device) and ``repr`` never communicate.

The loss scaler's check is global the same way. ``torch.amp.GradScaler`` unscales the
gradients and looks for an inf or NaN with ``torch._amp_foreach_non_finite_check_and_unscale_``
(from ``unscale_``, and from ``step`` for an optimizer that unscales in its own fused kernel);
on pieces, an overflow would show on one rank only, which would skip the step while the others
took it. Given shard gradients, that call is followed by one all-reduce (max) of its flag over
each group they are sharded over (and, with hybrid sharding, over the replicas), so every rank
skips alike and lowers the scale alike, with torch's own scaler as with
:class:`~shardwrap.ShardedGradScaler`.

Any other operation on a ``ShardGrad`` (the optimizer's) runs as on a plain tensor, at the cost
of one Python call per torch call, and returns plain tensors; aliases of a ``ShardGrad``
(``.data``, ``detach()``, ``view(-1)``, dtype conversions) stay ``ShardGrad``, and so do
elementwise arithmetic of one with numbers or tensors of its shape (``1.0 * p.grad``,
``p.abs() * p.grad``: SAM's perturbation, whose norm is then the whole one), and
shard gradients of one group joined into one tensor (``torch.cat``: ``parameters_to_vector`` of
the gradients, whose norm is then the whole vector's). Zeroing one in
place (``zero_grad(set_to_none=False)``) is noted on it, for the engine's unreduced gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.collectives import CommStats, Group, all_reduce
from ...tiers.offload import count_fused_write
from ...tiers.shard_param import first_among, is_collective, not_a_dtensor

if TYPE_CHECKING:
    from ...tiers.home import Home

__all__ = [
    "INF_CHECK",
    "NORM",
    "WHOLE_STEP",
    "PartialNorm",
    "ShardGrad",
    "as_shard_grad",
    "as_shard_grads",
    "shard_grad_owner",
]

_DisableSubclass = torch._C.DisableTorchFunctionSubclass


NORM = "a gradient norm (clip_grad_norm_)"
INF_CHECK = "the loss scaler's inf/NaN check (GradScaler)"
WHOLE_STEP = "an optimizer's step of whole parameters (Muon, Adafactor)"


class _Owner:
    """The group a gradient is sharded over, the counters its completions add to, what every
    rank calls first to agree it is making a collective call (``enter``, given ``NORM``,
    ``INF_CHECK`` or ``WHOLE_STEP``), and the gradient's home (state an optimizer makes from it
    may belong there)."""

    def __init__(self, group: Group, stats: CommStats, home: Home, replicas: Group = None) -> None:
        self.group = group
        self.replicas = replicas  # hybrid sharding: the ranks holding the same shard
        self.stats = stats
        self.device = home.device  # where the group's collectives take tensors
        self.home = home
        self.enter: Callable[[str], None] = _nothing


def _nothing(call: str) -> None:
    return None


def as_shard_grad(view: Tensor, owner: _Owner) -> Tensor:
    """``view`` (sharing its memory) typed as a :class:`ShardGrad` of ``owner``'s group."""
    grad = view.as_subclass(ShardGrad)
    grad._shardwrap_owner = owner
    return grad


def as_shard_grads(views: list[Tensor], owners: list[_Owner]) -> list[Tensor]:
    """Each of ``views`` typed as by :func:`as_shard_grad` with its owner: one call for a
    group's parameters at the end of backward."""
    return [as_shard_grad(v, o) for v, o in zip(views, owners)]


def shard_grad_owner(group: Group, stats: CommStats, home: Home, replicas: Group = None) -> _Owner:
    """What :func:`as_shard_grad` records for gradients sharded over ``group`` (and replicated
    over ``replicas``, with hybrid sharding) that live in ``home``, whose collectives take
    tensors on its compute device (the gradients may be on the host)."""
    return _Owner(group, stats, home, replicas)


def _norm_order(func: Callable[..., Any], args: tuple, kwargs: dict) -> float | None:
    """The order of the norm ``func`` takes over *all* of its input, or ``None`` if it is
    not such a norm (another function, or a norm along given dimensions)."""

    def arg(i: int, name: str, default: Any) -> Any:
        return args[i] if len(args) > i else kwargs.get(name, default)

    if func is torch._foreach_norm:
        order = arg(1, "ord", 2.0)
    elif func is torch.linalg.vector_norm:
        if arg(2, "dim", None) is not None:
            return None
        order = arg(1, "ord", 2.0)
    elif func is torch.linalg.norm:
        if arg(2, "dim", None) is not None or args[0].dim() != 1:
            return None
        order = arg(1, "ord", None)
        order = 2.0 if order is None else order
    elif func in (torch.norm, Tensor.norm):
        if arg(2, "dim", None) is not None:
            return None
        order = arg(1, "p", "fro")
        order = 2.0 if order == "fro" else order
    else:
        return None
    return float(order) if isinstance(order, (int, float)) else None


# Calls whose result is an alias or a converted copy of their input: a ShardGrad's stays one.
_GRAD_ALIASES = {
    Tensor.detach,
    Tensor.view,
    Tensor.reshape,
    Tensor.flatten,
    Tensor.contiguous,
    Tensor.to,
    Tensor.float,
    Tensor.double,
    Tensor.half,
    Tensor.bfloat16,
    Tensor.clone,
    Tensor.data.__get__,  # type: ignore[attr-defined]
}


class _NoHome:
    """Where what is made from joined gradients lives: where torch makes it."""

    def made_from_grad(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        return None


class _Joined(_Owner):
    """Shard gradients joined into one tensor along its first dimension (``torch.cat``:
    ``parameters_to_vector`` of the gradients), each one's elements in turn: ``segments``, the
    owner and number of elements of each, whose groups may differ (a tensor-parallel model's
    split and replicated gradients). Its norm is each segment's completed over its own group,
    then combined."""

    def __init__(self, segments: list[tuple[_Owner, int]]) -> None:
        first = segments[0][0]
        self.group = None
        self.stats = first.stats
        self.device = first.device
        self.home = _NoHome()  # type: ignore[assignment]
        self.enter = _nothing
        self.segments = segments


# Calls that join tensors into one holding all of their elements (along the first dimension).
_JOINS = {
    torch.cat,
    torch.concat,
    torch.concatenate,
    torch.hstack,
    torch.stack,
    torch._C._nn.flatten_dense_tensors,
}


# Elementwise functions: from one parameter's shard gradient and numbers (or tensors of its
# piece's shape) they make a piece of that parameter, whose norm completes like the gradient's.
# SAM's perturbation scale is the norm of ``1.0 * p.grad`` (or ``|p| * p.grad``) over every
# parameter.
_ELEMENTWISE = frozenset(
    {
        *(Tensor.__mul__, Tensor.__rmul__, Tensor.mul, torch.mul),
        *(Tensor.__truediv__, Tensor.__rtruediv__, Tensor.div, torch.div),
        *(Tensor.__add__, Tensor.__radd__, Tensor.add, torch.add),
        *(Tensor.__sub__, Tensor.__rsub__, Tensor.sub, torch.sub),
        *(Tensor.__neg__, Tensor.neg, torch.neg, Tensor.__abs__, Tensor.abs, torch.abs),
        *(Tensor.__pow__, Tensor.pow, torch.pow, Tensor.square, torch.square),
        *(Tensor.sign, torch.sign),
    }
)


def _elementwise_owner(args: tuple, kwargs: dict, out: Tensor) -> _Owner | None:
    """The owner of the piece an elementwise function made, ``out``, where its tensors are
    shard gradients of one owner shaped as ``out`` and numbers or tensors of that shape; else
    ``None`` (a broadcast, gradients of several groups, ``out=``, a gradient standing in under
    ``no_sync``)."""
    if "out" in kwargs:
        return None
    owner = None
    for a in (*args, *kwargs.values()):
        if not isinstance(a, Tensor):
            continue
        mine = getattr(a, "_shardwrap_owner", None)
        if mine is not None and (owner not in (None, mine) or _stands_in(a)):
            return None
        if (mine is not None or a.ndim) and a.shape != out.shape:
            return None
        owner = mine if mine is not None else owner
    return owner


def _joined(func: Callable[..., Any], args: tuple, kwargs: dict) -> _Joined | None:
    """What shard gradients joined by ``func`` make: each one's elements in turn; ``None``
    where not every input is a shard gradient, or they are not joined along the first
    dimension (only then does each keep its elements together)."""
    tensors = list(args[0] if args else kwargs.get("tensors", ()))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", kwargs.get("axis", 0))
    if func is torch.hstack:
        dim = 0 if all(t.dim() == 1 for t in tensors) else 1
    elif func is torch._C._nn.flatten_dense_tensors:
        dim = 0
    if not tensors or dim != 0:
        return None
    segments: list[tuple[_Owner, int]] = []
    for t in tensors:
        owner = getattr(t, "_shardwrap_owner", None)
        if owner is None:
            return None
        segments += owner.segments if isinstance(owner, _Joined) else [(owner, t.numel())]
    return _Joined(segments)


class ShardGrad(Tensor):
    """The gradient of a shard parameter: this rank's piece of the averaged gradient."""

    _shardwrap_owner: _Owner

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if is_collective(func):
            raise TypeError(_sent_grad(func, first_among(ShardGrad, args, kwargs)))
        order = _norm_order(func, args, kwargs)
        if order is not None:
            return _local_norms(func, order, args, kwargs)
        if func is torch._amp_foreach_non_finite_check_and_unscale_:
            return _check_and_unscale(*args, **kwargs)
        owner = getattr(args[0], "_shardwrap_owner", None) if args else None
        if owner is not None:
            made = owner.home.made_from_grad(func, args, kwargs)
            if made is not None:
                return made
        with _DisableSubclass():
            out = func(*args, **kwargs)
        if func in _GRAD_ALIASES and owner is not None and isinstance(out, Tensor):
            return as_shard_grad(out, owner)  # an alias of a gradient, not x.to(grad)
        if func in _ELEMENTWISE and isinstance(out, Tensor):
            made = _elementwise_owner(args, kwargs, out)
            if made is not None:
                return as_shard_grad(out, made)
        if func in _JOINS and isinstance(out, Tensor):
            joined = _joined(func, args, kwargs)
            if joined is not None:
                return as_shard_grad(out, joined)
        if func in _ZEROING:
            _note_zeroed(args[0])
        count_fused_write(func, args)
        return out

    def __deepcopy__(self, memo: dict) -> Tensor:
        with _DisableSubclass():
            copied = self.detach().clone()
        return as_shard_grad(copied, self._shardwrap_owner)

    __getattr__ = not_a_dtensor

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as the plain tensor it is on this rank."""
        with _DisableSubclass():
            return self.detach().as_subclass(Tensor).__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with _DisableSubclass():
            return f"ShardGrad({self.as_subclass(Tensor)!r})"


def _sent_grad(func: Any, grad: Tensor) -> str:
    return (
        f"torch.distributed.{func.__name__} of a sharded parameter's .grad (this rank's piece, "
        f"shape {tuple(grad.shape)}): backward has already averaged every gradient over the "
        "ranks, as DDP does, and left each rank its piece, so a hand-written average (an "
        "average_gradients loop, all_reduce then divide by the world size) would add "
        "different ranks' pieces together, or wait forever where their sizes differ. Nothing "
        "was sent. Drop the loop; for the norm over all ranks call "
        "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) or p.grad.norm(), which "
        "complete over the ranks."
    )


# How zero_grad(set_to_none=False) zeroes gradients: one by one, or together (foreach).
_ZEROING = (Tensor.zero_, torch._foreach_zero_)


def _note_zeroed(grads: Tensor | list[Tensor]) -> None:
    """Count on each shard gradient among ``grads``, just zeroed, one more zeroing: the
    engine tells ``zero_grad(set_to_none=False)`` from other in-place changes by the count
    (``ShardGrads.cleared``)."""
    for g in grads if isinstance(grads, (list, tuple)) else [grads]:
        if isinstance(g, ShardGrad):
            g._shardwrap_zeroings = getattr(g, "_shardwrap_zeroings", 0) + 1


def _check_and_unscale(grads: list[Tensor], found_inf: Tensor, inv_scale: Tensor) -> None:
    """torch's unscale and inf/NaN check of ``grads``, then ``found_inf`` made the largest of
    every rank's: one all-reduce over each group the shard gradients among ``grads`` are
    sharded over, in the order they first appear (the same on every rank)."""
    with _DisableSubclass():
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
    owners: dict[int, _Owner] = {}
    for g in grads:
        owner = getattr(g, "_shardwrap_owner", None)
        if owner is not None and owner.group is not None:
            owners.setdefault(id(owner.group), owner)
    for owner in owners.values():
        owner.enter(INF_CHECK)
        with _DisableSubclass():
            flag = found_inf.to(owner.device, copy=True)
        all_reduce(flag, owner.group, dist.ReduceOp.MAX, owner.stats).wait()
        if owner.replicas is not None:  # a value one replica alone has: every replica skips
            all_reduce(flag, owner.replicas, dist.ReduceOp.MAX, owner.stats).wait()
        with _DisableSubclass():
            found_inf.copy_(flag)


def _local_norms(func: Callable[..., Any], order: float, args: tuple, kwargs: dict) -> Any:
    """``func``'s norms of this rank's pieces, as partial norms. An empty piece (a shard can
    be) adds nothing: its part is the identity of the combination, not an error, and real
    as every norm is (a complex piece's too)."""
    foreach = func is torch._foreach_norm
    grads = args[0] if foreach else [args[0]]
    if any(_stands_in(g) for g in grads):
        raise RuntimeError(_UNREDUCED_NORM)
    out = []
    for g in grads:
        owner = getattr(g, "_shardwrap_owner", None)
        if isinstance(owner, _Joined):
            out.append(_joined_norm(g, order, owner, kwargs.get("dtype")))
            continue
        if g.numel() == 0:
            n = _empty_norm(order, g, kwargs.get("dtype"))
        else:
            with _DisableSubclass():
                n = func([g] if foreach else g, *args[1:], **kwargs)
                n = n[0] if foreach else n
        out.append(n if owner is None else _partial(n, order, owner))
    return out if foreach else out[0]


def _empty_norm(order: float, piece: Tensor, dtype: torch.dtype | None) -> Tensor:
    """The norm of an empty piece (a shard can be): the identity of the combination, not an
    error, real as every norm is (a complex piece's too), where the piece is."""
    identity = float("inf") if order == float("-inf") else 0.0
    return torch.full((), identity, dtype=(dtype or piece.dtype).to_real(), device=piece.device)


def _stands_in(grad: Tensor) -> bool:
    """Whether ``grad`` stands in for a gradient a backward under ``no_sync`` left unreduced
    (``engine/shards/shard_grads.py``), not cleared since."""
    return getattr(grad, "_shardwrap_unreduced", False) and not grad._shardwrap_zeroings


_UNREDUCED_NORM = (
    "shardwrap: a gradient norm (clip_grad_norm_) between backwards under no_sync() (or "
    "require_backward_grad_sync=False): this rank's gradients since the last synced backward "
    "are unreduced and kept outside .grad (which holds zeros, or what it held before) until "
    "the synced backward, so the norm would be of none of them. Take the norm, and clip, after "
    "the synced backward (the last micro-batch's, outside no_sync()): once per optimizer step."
)


def _joined_norm(g: Tensor, order: float, joined: _Joined, dtype: torch.dtype | None) -> Tensor:
    """The norm of joined shard gradients ``g``: each segment's, completed over its group
    (several of a group with one all-reduce), combined as the parts of one norm are."""
    with _DisableSubclass():
        pieces = g.reshape(-1).split([n for _, n in joined.segments])
        parts = [
            _partial(
                torch.linalg.vector_norm(piece, order, dtype=dtype)
                if piece.numel()
                else _empty_norm(order, piece, dtype),
                order,
                owner,
            )
            for piece, (owner, _) in zip(pieces, joined.segments)
        ]
    _complete_together(parts)
    wholes = torch.stack([part.complete() for part in parts])
    # the segments' norms combined as torch's get_total_norm combines tensors' (an order-0
    # norm counts: the counts add up)
    return wholes.sum() if order == 0.0 else torch.linalg.vector_norm(wholes, order)


def _partial(local: Tensor, order: float, owner: _Owner | None) -> Tensor:
    norm = local.as_subclass(PartialNorm)
    norm._shardwrap_order = order
    norm._shardwrap_owner = owner
    norm._shardwrap_complete = None
    return norm


# Calls that move, stack or copy partial norms of one order: the result is partial too.
_KEEP_PARTIAL = {Tensor.to, Tensor.clone, Tensor.detach, torch.stack, torch.cat, Tensor.view}

# Calls that only read metadata: no values, so no collective.
_METADATA_NAMES = {
    "dim", "size", "numel", "__len__", "element_size", "is_floating_point", "is_complex",
    "is_contiguous", "stride", "storage_offset", "data_ptr", "get_device", "dtype", "shape",
    "device", "requires_grad", "ndim", "layout", "is_cuda", "is_cpu", "is_meta", "grad_fn",
    "is_leaf", "names", "is_sparse", "is_quantized", "is_nested", "_is_view", "grad",
}  # fmt: skip


def _name(func: Callable[..., Any]) -> str:
    if getattr(func, "__name__", "") == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "")
    return getattr(func, "__name__", "")


def _partials(values: Any) -> list[PartialNorm]:
    if isinstance(values, PartialNorm):
        return [values]
    if isinstance(values, (list, tuple)):
        return [p for v in values for p in _partials(v)]
    return []


def _all_partial(args: tuple) -> bool:
    """Whether every tensor among ``args`` (or in a list there) is a partial norm."""
    tensors = [a for v in args for a in (v if isinstance(v, (list, tuple)) else [v])]
    return all(isinstance(t, PartialNorm) for t in tensors if isinstance(t, Tensor))


def _completed(values: Any) -> Any:
    _complete_together(_partials(values))
    return _replaced(values)


def _replaced(values: Any) -> Any:
    if isinstance(values, PartialNorm):
        return values.complete()
    if isinstance(values, (list, tuple)):
        return type(values)(_replaced(v) for v in values)
    return values


def _complete_together(parts: list[PartialNorm]) -> None:
    """Complete ``parts`` with one all-reduce per owner, order and dtype rather than one each:
    norms of gradients sharded over different groups (a tensor-parallel model's) stacked by
    ``clip_grad_norm_`` are completed at once, in the order they first appear."""
    pending: dict[tuple[int, float, torch.dtype], list[PartialNorm]] = {}
    unique = {id(part): part for part in parts if part._shardwrap_complete is None}
    for part in unique.values():
        key = (id(part._shardwrap_owner), part._shardwrap_order, part.dtype)
        pending.setdefault(key, []).append(part)
    for same in pending.values():
        if len(same) > 1:
            for part, whole in zip(same, _complete(same)):
                part._shardwrap_complete = whole


class PartialNorm(Tensor):
    """This rank's part of the norm of a sharded gradient; its value is the whole norm."""

    _shardwrap_order: float
    _shardwrap_owner: _Owner | None
    _shardwrap_complete: Tensor | None

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if _name(func) in _METADATA_NAMES:
            with _DisableSubclass():
                return func(*args, **kwargs)
        parts = _partials((args, kwargs))
        orders = {p._shardwrap_order for p in parts}
        owners = {id(p._shardwrap_owner) for p in parts}
        if func in _KEEP_PARTIAL and len(orders) == 1 and len(owners) == 1 and _all_partial(args):
            with _DisableSubclass():
                out = func(*args, **kwargs)
            return _partial(out, parts[0]._shardwrap_order, parts[0]._shardwrap_owner)
        args, kwargs = _completed(args), _completed(kwargs)
        with _DisableSubclass():
            return func(*args, **kwargs)

    def complete(self) -> Tensor:
        """The whole norm: one all-reduce over the group its gradient is sharded over, on
        every rank, once."""
        if self._shardwrap_complete is None:
            self._shardwrap_complete = _complete([self])[0]
        return self._shardwrap_complete

    def __deepcopy__(self, memo: dict) -> Tensor:
        with _DisableSubclass():
            copied = self.detach().clone()
        return _partial(copied, self._shardwrap_order, self._shardwrap_owner)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled as the whole norm (so, like reading it, on every rank)."""
        return self.complete().__reduce_ex__(protocol)

    def __repr__(self, *, tensor_contents: Any = None) -> str:
        with _DisableSubclass():
            return (
                f"PartialNorm(this rank's part: {self.as_subclass(Tensor)!r}, "
                f"order {self._shardwrap_order}; read it on every rank for the whole norm)"
            )


def _complete(parts: list[PartialNorm]) -> list[Tensor]:
    """The whole norms of ``parts`` (one owner, order and dtype), with one all-reduce."""
    first = parts[0]
    order, owner = first._shardwrap_order, first._shardwrap_owner
    with _DisableSubclass():
        # at least float32 (low-precision partial sums lose the small parts), float64 kept
        dtype = torch.promote_types(first.dtype, torch.float32)
        device = owner.device if owner else None
        local = torch.cat([p.detach().reshape(-1).to(device, dtype, copy=True) for p in parts])
    local = _reduced(local, order, owner)
    with _DisableSubclass():
        wholes = local.split([p.numel() for p in parts])
        return [w.view(p.shape).to(p.device, p.dtype) for w, p in zip(wholes, parts)]


def _reduced(local: Tensor, order: float, owner: _Owner | None) -> Tensor:
    """Partial norms ``local`` (1-D) combined over ``owner``'s group."""
    if owner is None or owner.group is None:
        return local
    owner.enter(NORM)
    if order == float("inf"):
        all_reduce(local, owner.group, dist.ReduceOp.MAX, owner.stats).wait()
    elif order == float("-inf"):
        all_reduce(local, owner.group, dist.ReduceOp.MIN, owner.stats).wait()
    elif order == 0.0:
        all_reduce(local, owner.group, dist.ReduceOp.SUM, owner.stats).wait()
    else:
        local = local.pow_(order)
        all_reduce(local, owner.group, dist.ReduceOp.SUM, owner.stats).wait()
        local = local.pow_(1.0 / order)
    return local
