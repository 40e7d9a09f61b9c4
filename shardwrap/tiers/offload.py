"""Offload: where a rank's training state lives when it does not fit in memory.

Design note. The options (:class:`~shardwrap.Offload`, in ``options.py``) choose a home for
the shards, their gradients and the optimizer state: pinned host memory (``"cpu"``) or files on
disk (``"disk"``); the homes themselves, and how each reaches the compute device, are in
``tiers/home.py``. Here is what the optimizer meets of them.

Optimizer state is placed without knowing the optimizer: every torch optimizer creates its
per-parameter state with ``torch.zeros_like(param)`` (Adam, AdamW, RMSprop; Muon of the
gradient), ``full_like`` (Adagrad), a clone of the gradient (SGD momentum) or a new tensor made
from it (Adafactor's ``grad.new_zeros`` row and column factors). The disk tier's shard
parameters (:class:`StoredParam`) and their gradients (``engine.optim.shard_grad.ShardGrad``, also
the whole gradient an owner steps, ``engine/optim/whole_params.py``) are typed so that those calls
allocate in their home's files instead.

Optimizer steps: torch picks its fast multi-tensor path only for plain ``Parameter`` types
on an accelerator, so for the disk tier's shard parameters, and for the host tier's (plain,
but on the CPU), it would fall back to a per-tensor loop several times slower. A step
pre-hook on each optimizer over such shard parameters (``engine/optim/step_hooks.py``) turns on the
fused kernel for their groups that left ``fused`` and ``foreach`` unset (:func:`prefer_fused`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .shard_param import ShardParam

__all__ = [
    "HOME_ATTR",
    "StoreError",
    "StoredParam",
    "before_step",
    "count_fused_write",
    "grads_in_own_dtype",
    "prefer_fused",
    "stored_param",
]


class StoreError(RuntimeError):
    """A file of the disk tier was deleted, replaced or truncated while its model lives.

    Raised on the rank that sees it, before the file is read; the model's state can no longer
    be trusted. Other ranks wait in their next collective and raise
    :class:`~shardwrap.CollectiveFailed` once the process group's timeout passes.
    """


# torch's fused optimizer kernels, which write their parameters (argument 0) in place
_FUSED_STEPS = frozenset(
    getattr(torch, name)
    for name in ("_fused_adam_", "_fused_adamw_", "_fused_sgd_", "_fused_adagrad_")
    if hasattr(torch, name)
)


def count_fused_write(func: Callable[..., Any], args: tuple) -> None:
    """After one of torch's fused optimizer kernels (``torch._fused_adamw_``, ...): count its
    write to the parameters (argument 0) in their version counters.

    NOTE: those kernels write without counting it, and a version counter is how a unit that
    stays gathered, or a copy staged for the host tier, learns that its shard changed. The
    shard parameters' and shard gradients' torch-function handlers, whichever torch calls,
    count it here.
    """
    if func in _FUSED_STEPS and args:
        if isinstance(args[0], (list, tuple)):
            torch.autograd.graph.increment_version([p for p in args[0] if isinstance(p, Tensor)])


# On a shard parameter of the host and disk tiers: its home (``tiers/home.py``), which state made
# "like" the parameter and the step pre-hook ask.
HOME_ATTR = "_shardwrap_home"


class StoredParam(ShardParam):
    """A shard parameter of the disk tier: state the optimizer makes "like" it is stored too."""

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], StoredParam):
            out = getattr(args[0], HOME_ATTR).made_like(func, args, kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        count_fused_write(func, args)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as the plain parameter it is on this rank."""
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.nn.Parameter(self.detach().clone(), self.requires_grad)
        return plain.__reduce_ex__(protocol)


def stored_param(data: Tensor, requires_grad: bool, home: Any) -> StoredParam:
    """A shard parameter over ``data``, a view of a file of ``home`` (``tiers.home.DiskHome``)."""
    param = StoredParam(data, requires_grad)
    setattr(param, HOME_ATTR, home)
    return param


# torch's optimizers that have a fused kernel for CPU tensors, and their subclasses.
_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def grads_in_own_dtype(params: list[Tensor]) -> bool:
    """Whether every parameter keeps its gradient in its own dtype (no other ``grad_dtype``),
    as torch's fused optimizer kernels require."""
    return all((p.grad_dtype or p.dtype) == p.dtype for p in params)


def prefer_fused(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Turn on the fused kernel for ``group`` where the user left the choice to torch.

    1. The optimizer is one of torch's with a fused CPU kernel (Adam, AdamW, SGD, Adagrad, or
       a subclass), the group left ``fused`` and ``foreach`` unset (``None``), is not
       ``differentiable`` (nor SGD with ``dampening``: see :func:`_complete_momentum`), and
       all its parameters are floating point on the CPU with their gradients in their own dtype
       (the fused kernels refuse another ``grad_dtype``): ``fused`` becomes ``True``. State
       made before (a step already taken, a checkpoint loaded) keeps working: each ``step``
       count becomes the fp32 tensor the fused kernels count in.
    2. Anything else, an explicit ``fused=False`` or ``foreach=...`` included: unchanged.
    """
    if (
        not isinstance(optimizer, _FUSED_OPTIMIZERS)
        or group.get("fused", False) is not None
        or group.get("foreach", False) is not None
        or group.get("differentiable", False)
        or group.get("dampening", 0)
        or not all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"])
        or not grads_in_own_dtype(group["params"])
    ):
        return
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state and "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)
    group["fused"] = True


def _complete_momentum(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Before a fused SGD step with momentum: give each parameter of ``group`` with a gradient
    and no momentum buffer, where another has one, a buffer of zeros. SGD's fused kernel makes
    buffers only where no parameter has one yet, and fails on a parameter's first gradient
    beside others' buffers (a block unfrozen mid-training); the kernel's update of zeros,
    ``momentum * 0 + grad``, is exactly the buffer torch's loop makes at a first gradient
    (``dampening`` would scale it, so :func:`prefer_fused` fuses no such group)."""
    if not (isinstance(optimizer, torch.optim.SGD) and group.get("fused") and group["momentum"]):
        return
    stepped = [p for p in group["params"] if p.grad is not None]
    buffers = [optimizer.state.get(p, {}).get("momentum_buffer") for p in stepped]
    if any(b is None for b in buffers) and any(b is not None for b in buffers):
        for p, b in zip(stepped, buffers):
            if b is None:
                optimizer.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)


def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step of an optimizer over offloaded shards (its own pre-hook, registered by
    ``engine/optim/step_hooks.py``): for groups holding shard parameters of an offload tier, prefer
    the fused kernel; have each of their homes check itself (``Home.check``: the disk tier's
    files are checked, the host tier's copies in flight finish before the step writes the
    shards they read)."""
    homes: dict[int, Any] = {}
    groups = []
    for group in optimizer.param_groups:
        held = [getattr(p, HOME_ATTR) for p in group["params"] if hasattr(p, HOME_ATTR)]
        if held:
            homes.update((id(home), home) for home in held)
            groups.append(group)
    for home in homes.values():
        home.check()
    for group in groups:
        prefer_fused(optimizer, group)
        _complete_momentum(optimizer, group)
