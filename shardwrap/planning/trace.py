"""What the memory planner measures on the meta device: units, activations, optimizer state.

Design note. Nothing here allocates the model. A meta-device twin of the model is split into
units and flat groups by the wrapping policy and the flat layout that ``ShardedModule`` uses,
then runs one forward and backward on meta inputs under a dispatch mode that counts the bytes of
every storage an op creates while it is alive (weakly referenced, as autograd frees them). As in
the engine, each unit's forward shows its parameters as views of one buffer per flat group,
made by an autograd function whose backward receives every view's gradient at once: autograd
runs it when it would run the engine's, which then makes the group's flat gradient. Units cast
their floating inputs (and the root its outputs) as the engine's hooks do under mixed
precision, and attention takes the kernel the device would.

The run leaves a trace: the live bytes at each unit boundary (forward start and end, backward
start) and at each group's gradients, and the most live in between. The planner replays it
with the engine's buffers on top (``planning/replay.py``). The optimizer is measured the same
way (``planning/step.py``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

from ..engine.shards.layout import FlatLayout
from ..engine.step.trees import cast_floating
from ..engine.wrap.policy import (
    AutoWrap,
    check_selects_something,
    group_key,
    place_parameters,
    reduce_dtype_of,
    resolve_policy,
)
from ..options import MixedPrecision
from .python_ops import resolve_python_ops

__all__ = ["GroupSpec", "LiveBytes", "Trace", "meta_twin", "trace"]

Slot = tuple[nn.Module, str]  # a module attribute that holds a parameter


@dataclass(frozen=True)
class GroupSpec:
    """One flat group as a rank holds it: sizes from the flat layout, dtypes from the options."""

    unit: int
    layout: FlatLayout
    dtype: torch.dtype  # the shards', the optimizer's master copy
    compute_dtype: torch.dtype  # the gathered parameters'
    grad_dtype: torch.dtype  # the flat gradient's and its reduction's
    requires_grad: bool
    shapes: tuple[torch.Size, ...] = ()  # its parameters', in flat order
    param_grad_dtype: torch.dtype | None = None  # the shard params' .grad's (None: dtype)

    @property
    def full(self) -> int:
        """Bytes of the gathered flat buffer."""
        return self.layout.padded_numel * self.compute_dtype.itemsize

    @property
    def shard(self) -> int:
        """Bytes of this rank's shard (padding included)."""
        return self.layout.shard_size * self.dtype.itemsize

    @property
    def flat_grad(self) -> int:
        """Bytes of the flat gradient (trainable groups only)."""
        return self.layout.padded_numel * self.grad_dtype.itemsize if self.requires_grad else 0

    @property
    def shard_grad(self) -> int:
        """Bytes the reduce-scatter lands in."""
        return self.layout.shard_size * self.grad_dtype.itemsize if self.requires_grad else 0

    @property
    def kept_grad_dtype(self) -> torch.dtype:
        """The dtype of the shard params' ``.grad``."""
        return self.param_grad_dtype or self.dtype

    @property
    def kept_grad(self) -> int:
        """Bytes of the shard params' ``.grad`` (trainable groups only)."""
        return self.layout.shard_size * self.kept_grad_dtype.itemsize if self.requires_grad else 0


@dataclass(frozen=True)
class Trace:
    """One meta forward and backward, as unit boundaries and live bytes.

    ``events`` holds ``(kind, index, live, most)``: ``kind`` is ``"fwd_pre"``, ``"fwd_post"``
    or ``"bwd_pre"`` (``index`` a unit) or ``"grads"`` (``index`` a group: backward has made
    every gradient of its parameters, still alive; ``grad_bytes[index]`` of them); ``live`` the
    bytes alive at the event and ``most`` the most alive since the previous one. ``kept`` is
    what stays alive after backward (outputs, the loss).
    """

    units: list[str]  # each unit's module class, in pre-order (the root first)
    groups: list[GroupSpec]
    params: list[tuple[int, int]]  # the model's parameters in its order: (group, index in it)
    grad_bytes: dict[int, int]  # per group, its parameters' gradients as autograd made them
    events: list[tuple[str, int, int, int]]
    kept: int
    end: int  # the most alive between the last event and the end of backward


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create, while alive; the most since the last ``mark``."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.most = 0

    def __enter__(self) -> LiveBytes:
        resolve_python_ops()
        return super().__enter__()

    def live(self) -> int:
        dead = [k for k, (ref, _) in self.storages.items() if ref.expired()]
        for k in dead:
            del self.storages[k]
        return sum(n for _, n in self.storages.values())

    def mark(self) -> tuple[int, int]:
        """The bytes alive now and the most alive since the previous mark."""
        live = self.live()
        most, self.most = max(self.most, live), live
        return live, most

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # An output over an input's storage (a view, an in-place op) is nothing new.
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if _plain(t)}
        grew = False
        for t in tree_leaves(out):
            if _plain(t) and t.untyped_storage()._cdata not in inputs:
                storage = t.untyped_storage()
                known = self.storages.get(storage._cdata)
                if known is None or known[0].expired():
                    self.storages[storage._cdata] = (StorageWeakRef(storage), storage.nbytes())
                    grew = True
        if grew:
            self.most = max(self.most, self.live())
        return out


class _FusedAttention(TorchFunctionMode):
    """Attention as the fused CPU and GPU kernels compute it, keeping the output and one
    log-sum-exp per row for backward. On the meta device torch would take the unfused path,
    which keeps the (seq, seq) scores and so overstates activations. With dropout the CPU
    kernel is not fused; the CUDA one is (``dropout``)."""

    def __init__(self, dropout: bool) -> None:
        super().__init__()
        self.dropout = dropout

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            fused = _fused_attention(*args, **kwargs, fused_dropout=self.dropout)
            if fused is not None:
                return fused
        return func(*args, **kwargs)


def _fused_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    fused_dropout: bool = False,
) -> Tensor | None:
    """The fused kernel's output (its memory, not its numbers: dropout is not applied), or
    ``None`` where the device would not fuse (torch's own path then)."""
    if (dropout_p and not fused_dropout) or query.shape[-1] != value.shape[-1] or query.ndim != 4:
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _plain(t: Any) -> bool:
    return isinstance(t, Tensor) and not t.is_sparse


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (ties kept)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        twin = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
        twin.grad_dtype = p.grad_dtype
        memo[id(p)] = twin
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def trace(
    model: nn.Module,
    auto_wrap: AutoWrap,
    world_size: int,
    precision: MixedPrecision | None,
    loss_of: Callable[[nn.Module], tuple[Tensor, Any]],
    fused_dropout: bool = False,
    split: frozenset[int] = frozenset(),
) -> Trace:
    """Split ``model`` (meta) into units as ``ShardedModule`` would and trace one training pass.

    ``loss_of(model)`` runs forward on meta inputs and returns the loss and what the caller
    keeps of the outputs through the optimizer step. Attention takes the fused kernel where
    the device would (with dropout only on CUDA: ``fused_dropout``). ``split``: the ids of a
    tp rank's blocks of tensor-parallel parameters (``planning/tensor_parallel.py``), laid out
    apart from the rest as the engine lays them out.
    """
    model.train()
    policy = resolve_policy(model, auto_wrap)
    check_selects_something(model, policy, auto_wrap)
    placement = place_parameters(model, policy)
    groups: list[GroupSpec] = []
    members: list[list[tuple[nn.Parameter, list[Slot]]]] = []  # per group, in flat order
    for index, entries in enumerate(placement.params):
        by_key: dict[tuple[Any, ...], list[tuple[nn.Parameter, list[Slot]]]] = {}
        for _, p, slots in entries:
            dtype, trainable, _, grad_dtype = group_key(p)
            key = (dtype, trainable, id(p) in split, grad_dtype)
            by_key.setdefault(key, []).append((p, slots))
        for (dtype, requires_grad, _, grad_dtype), group in by_key.items():
            compute = precision.compute_dtype(dtype) if precision else dtype
            reduce = reduce_dtype_of(dtype, grad_dtype, precision)
            layout = FlatLayout(tuple(p.numel() for p, _ in group), world_size)
            shapes = tuple(p.shape for p, _ in group)
            groups.append(
                GroupSpec(index, layout, dtype, compute, reduce, requires_grad, shapes, grad_dtype)
            )
            members.append(group)
    where = {id(p): (i, j) for i, group in enumerate(members) for j, (p, _) in enumerate(group)}
    order = [where[id(p)] for p in model.parameters()]  # as the wrapped model lists them
    return _run(placement.units, groups, order, members, loss_of, model, fused_dropout, precision)


class _Views(torch.autograd.Function):
    """A group's parameters as views of its gathered buffer, as the engine makes them
    (``_FullParams``): autograd runs this backward once every view's gradient exists, in the
    order it runs the engine's, which is when the engine makes the group's flat gradient."""

    @staticmethod
    def forward(ctx: Any, leaf: Tensor, buffer: Tensor, shapes: Any, done: Any) -> Any:
        ctx.done = done
        return _views(buffer, shapes)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[None, None, None, None]:
        storages = {
            g.untyped_storage()._cdata: g.untyped_storage().nbytes() for g in grads if g is not None
        }
        ctx.done(sum(storages.values()))
        return None, None, None, None


def _views(buffer: Tensor, shapes: list[torch.Size]) -> tuple[Tensor, ...]:
    views, offset = [], 0
    for shape in shapes:
        views.append(buffer[offset : offset + shape.numel()].view(shape))
        offset += shape.numel()
    return tuple(views)


def _run(
    units: list[nn.Module],
    groups: list[GroupSpec],
    order: list[tuple[int, int]],
    members: list[list[tuple[nn.Parameter, list[Slot]]]],
    loss_of: Callable[[nn.Module], tuple[Tensor, Any]],
    model: nn.Module,
    fused_dropout: bool,
    precision: MixedPrecision | None,
) -> Trace:
    events: list[tuple[str, int, int, int]] = []
    grad_bytes: dict[int, int] = {}
    counter = LiveBytes()
    # Each group's gathered buffer (made outside the count, as the engine's are pooled) and
    # the leaf that stands for it in autograd.
    buffers = [
        torch.empty(g.layout.padded_numel, dtype=g.compute_dtype, device="meta") for g in groups
    ]
    leaves = [torch.empty(0, device="meta").requires_grad_(g.requires_grad) for g in groups]
    unit_groups = [[i for i, g in enumerate(groups) if g.unit == u] for u in range(len(units))]
    shown: set[int] = set()  # units whose views this forward shows

    def note(kind: str, index: int) -> None:
        events.append((kind, index, *counter.mark()))

    def done(index: int) -> Callable[[int], None]:
        def on_grads(nbytes: int) -> None:
            grad_bytes[index] = nbytes
            note("grads", index)
            counter.most -= nbytes  # freed as this backward returns, before anything else

        return on_grads

    def show(unit: int) -> None:
        """The unit's parameters become views of its buffers, as a gather makes them."""
        if unit in shown:
            return
        shown.add(unit)
        for i in unit_groups[unit]:
            shapes = [p.shape for p, _ in members[i]]
            if groups[i].requires_grad:
                views = _Views.apply(leaves[i], buffers[i], shapes, done(i))
            else:
                views = _views(buffers[i], shapes)
            for view, (_, slots) in zip(views, members[i]):
                for module, attr in slots:
                    module.__dict__[attr] = view

    # Every unit casts its floating inputs, and the root its outputs, as the engine's hooks do.
    input_dtype = precision.param_dtype if precision else None
    output_dtype = precision.output_dtype if precision else None

    def pre(i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            note("fwd_pre", i)
            show(i)
            return None if input_dtype is None else cast_floating((args, kwargs), input_dtype)

        return hook

    def post(i: int) -> Callable[..., Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            note("fwd_post", i)
            if i == 0 and output_dtype is not None:
                output = cast_floating(output, output_dtype)
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(lambda g: note("bwd_pre", i))
            return output

        return hook

    handles = [u.register_forward_pre_hook(pre(i), with_kwargs=True) for i, u in enumerate(units)]
    handles += [u.register_forward_hook(post(i)) for i, u in enumerate(units)]
    try:
        with counter, _FusedAttention(fused_dropout):
            loss, kept = loss_of(model)
            loss.backward()
            kept_bytes, end = counter.mark()
    finally:
        for h in handles:
            h.remove()
        for group in members:
            for _, slots in group:
                for module, attr in slots:
                    module.__dict__.pop(attr, None)
    return Trace(
        units=[type(u).__name__ for u in units],
        groups=groups,
        params=order,
        grad_bytes=grad_bytes,
        events=events,
        kept=kept_bytes,
        end=end,
    )


def causal_loss(out: Any, targets: Tensor) -> Tensor:
    """The loss from what a model returned: itself if a scalar, else next-token cross-entropy
    over ``(batch, seq, vocab)`` logits, computed in fp32."""
    logits = out if isinstance(out, Tensor) else out[0]
    if logits.ndim == 0:
        return logits
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
