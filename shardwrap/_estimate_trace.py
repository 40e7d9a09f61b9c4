"""What the memory planner measures on the meta device: units, activations, optimizer state.

Design note. Nothing here allocates the model. A meta-device twin of the model is split into
units and flat groups by the wrapping policy and the flat layout that ``ShardedModule`` uses,
then runs one forward and backward on meta inputs under a dispatch mode that counts the bytes of
every storage an op creates while it is alive (weakly referenced, as autograd frees them). The
run leaves a trace: the live bytes at each unit boundary (forward start and end, backward start)
and at each parameter's gradient, and the most live in between. The planner (``_estimate.py``)
replays that trace with each stage's buffer lifetimes added on top.

Parameter gradients are dropped as soon as autograd accumulates them, so the trace counts
activations and temporaries only; the planner accounts for the gradients as the engine holds
them (per unit, flat). The optimizer is measured the same way: one step over meta tensors shaped
like rank 0's shard parameters gives its state and its step's temporaries.
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

from ._layout import FlatLayout
from ._options import MixedPrecision
from ._wrap import AutoWrap, check_selects_something, group_key, place_parameters, resolve_policy

__all__ = ["GroupSpec", "Trace", "meta_twin", "optimizer_bytes", "trace"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class GroupSpec:
    """One flat group as a rank holds it: sizes from the flat layout, dtypes from the options."""

    unit: int
    layout: FlatLayout
    dtype: torch.dtype  # the shards', the optimizer's master copy
    compute_dtype: torch.dtype  # the gathered parameters'
    grad_dtype: torch.dtype  # the flat gradient's and its reduction's
    requires_grad: bool

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


@dataclass(frozen=True)
class Trace:
    """One meta forward and backward, as unit boundaries and live bytes.

    ``events`` holds ``(kind, index, live, most)``: ``kind`` is ``"fwd_pre"``, ``"fwd_post"``
    or ``"bwd_pre"`` (``index`` a unit) or ``"grad"`` (``index`` a parameter of ``param_group``,
    first gradient only); ``live`` the bytes alive at the event and ``most`` the most alive since
    the previous one. ``kept`` is what stays alive after backward (outputs, the loss).
    """

    units: list[str]  # each unit's module class, in pre-order (the root first)
    groups: list[GroupSpec]
    param_group: list[int]  # for each parameter, its group
    param_grad_bytes: list[int]  # for each parameter, its gradient's bytes as autograd makes it
    events: list[tuple[str, int, int, int]]
    kept: int
    end: int  # the most alive between the last event and the end of backward


class _LiveBytes(TorchDispatchMode):
    """Bytes of the storages that ops create, while alive; the most since the last ``mark``."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, tuple[StorageWeakRef, int]] = {}
        self.most = 0

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
    if (
        (dropout_p and not fused_dropout)
        or enable_gqa
        or query.shape[-1] != value.shape[-1]
        or query.ndim != 4
    ):
        return None
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return flash(query, key, value, 0.0, is_causal, attn_mask=attn_mask, scale=scale)[0]


def _plain(t: Any) -> bool:
    return isinstance(t, Tensor) and not t.is_sparse


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device (ties kept)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), p.requires_grad)
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
) -> Trace:
    """Split ``model`` (meta) into units as ``ShardedModule`` would and trace one training pass.

    ``loss_of(model)`` runs forward on meta inputs and returns the loss and what the caller
    keeps of the outputs through the optimizer step. Attention takes the fused kernel where
    the device would (with dropout only on CUDA: ``fused_dropout``).
    """
    model.train()
    policy = resolve_policy(model, auto_wrap)
    check_selects_something(model, policy, auto_wrap)
    placement = place_parameters(model, policy)
    groups: list[GroupSpec] = []
    params: list[nn.Parameter] = []
    param_group: list[int] = []
    for index, entries in enumerate(placement.params):
        by_key: dict[tuple[torch.dtype, bool], list[nn.Parameter]] = {}
        for _, p, _ in entries:
            by_key.setdefault(group_key(p), []).append(p)
        for (dtype, requires_grad), members in by_key.items():
            compute = precision.compute_dtype(dtype) if precision else dtype
            reduce = precision.gradient_dtype(dtype) if precision else compute
            layout = FlatLayout(tuple(p.numel() for p in members), world_size)
            groups.append(GroupSpec(index, layout, dtype, compute, reduce, requires_grad))
            params += members
            param_group += [len(groups) - 1] * len(members)
    for p, g in zip(params, param_group):  # compute as the gathered copies do
        p.data = p.data.to(groups[g].compute_dtype)
    return _run(placement.units, groups, params, param_group, loss_of, model, fused_dropout)


def _run(
    units: list[nn.Module],
    groups: list[GroupSpec],
    params: list[nn.Parameter],
    param_group: list[int],
    loss_of: Callable[[nn.Module], tuple[Tensor, Any]],
    model: nn.Module,
    fused_dropout: bool,
) -> Trace:
    events: list[tuple[str, int, int, int]] = []
    counter = _LiveBytes()

    def note(kind: str, index: int) -> None:
        events.append((kind, index, *counter.mark()))

    def pre(i: int) -> Callable[..., None]:
        return lambda module, args: note("fwd_pre", i)

    def post(i: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            note("fwd_post", i)
            for t in tree_flatten(output)[0]:
                if isinstance(t, Tensor) and t.requires_grad:
                    t.register_hook(lambda g: note("bwd_pre", i))

        return hook

    seen: set[int] = set()

    def on_grad(i: int) -> Callable[[Tensor], None]:
        def hook(p: Tensor) -> None:
            p.grad = None  # the planner holds gradients as the engine does
            if i not in seen:
                seen.add(i)
                note("grad", i)

        return hook

    handles = [u.register_forward_pre_hook(pre(i)) for i, u in enumerate(units)]
    handles += [u.register_forward_hook(post(i)) for i, u in enumerate(units)]
    handles += [
        p.register_post_accumulate_grad_hook(on_grad(i))
        for i, p in enumerate(params)
        if p.requires_grad
    ]
    try:
        with counter, _FusedAttention(fused_dropout):
            loss, kept = loss_of(model)
            loss.backward()
            kept_bytes, end = counter.mark()
    finally:
        for h in handles:
            h.remove()
    return Trace(
        units=[type(u).__name__ for u in units],
        groups=groups,
        param_group=param_group,
        param_grad_bytes=[p.numel() * p.dtype.itemsize for p in params],
        events=events,
        kept=kept_bytes,
        end=end,
    )


def optimizer_bytes(groups: list[GroupSpec], optimizer: OptimizerFactory | None) -> tuple[int, int]:
    """The optimizer's state on rank 0 (which holds the most), and the most its step holds.

    One step over meta shard parameters, shaped like rank 0's pieces (1-D, in the shards'
    dtype), each with a gradient; returns ``(state bytes, most alive during the step)``.
    """
    if optimizer is None:
        return 0, 0
    params = []
    for g in groups:
        if g.requires_grad:
            for piece in g.layout.local_pieces(0):
                p = nn.Parameter(torch.empty(piece.numel, dtype=g.dtype, device="meta"))
                p.grad = torch.empty_like(p)
                params.append(p)
    if not params:
        return 0, 0
    counter = _LiveBytes()
    with counter:
        opt = optimizer(params)
        opt.step()
        state = counter.live()
    _, most = counter.mark()
    del opt
    return state, most


def causal_loss(out: Any, targets: Tensor) -> Tensor:
    """The loss from what a model returned: itself if a scalar, else next-token cross-entropy
    over ``(batch, seq, vocab)`` logits, computed in fp32."""
    logits = out if isinstance(out, Tensor) else out[0]
    if logits.ndim == 0:
        return logits
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())
