"""Checks of ``ShardedModule``'s arguments, made before any parameter is moved.

Each names the problem and the fix. The only one that communicates, :func:`check_same_model`,
is one small all-reduce, so every rank raises alike instead of some hanging later.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._collectives import Group, all_reduce, group_size
from ._wrap import AutoWrap, resolve_policy

__all__ = [
    "check_device",
    "check_not_wrapped",
    "check_same_model",
    "checkpoint_policy",
    "resolve_compile",
]

ROOT_ATTR = "_shardwrap_root"
UNIT_ATTR = "_shardwrap_unit"
SHARD_ATTR = "_shardwrap_shard"


def check_not_wrapped(module: nn.Module) -> None:
    for name, m in module.named_modules():
        if hasattr(m, ROOT_ATTR) or hasattr(m, UNIT_ATTR):
            already_wrapped("the model" if not name else f"its submodule '{name}'")
    for name, p in module.named_parameters():
        if getattr(p, SHARD_ATTR, False):
            already_wrapped(f"its parameter '{name}' (part of a wrapped model)")


def already_wrapped(where: str) -> None:
    raise ValueError(
        f"ShardedModule: {where} is already wrapped. Wrap once, at the top, and let "
        "auto_wrap select the submodules: ShardedModule(model, auto_wrap=Block)."
    )


def check_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    devices: dict[torch.device, str] = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"'{n}' on {d}" for d, n in devices.items())
        raise ValueError(
            f"ShardedModule: parameters are on several devices ({listed}). Move the model to "
            "one device first, e.g. model.to('cpu'), and pass device= for where shards go."
        )
    if devices and not any(d.type == "meta" for d in devices):
        for name, b in module.named_buffers():
            if b.is_meta:
                raise ValueError(
                    f"ShardedModule: buffer '{name}' is on the meta device but the parameters "
                    "are not; build the whole model under `with torch.device('meta'):`, or "
                    "none of it."
                )
    if device is not None:
        return torch.device(device)
    if devices:
        only = next(iter(devices))
        if only.type not in ("cpu", "meta"):
            return only
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def checkpoint_policy(
    module: nn.Module, units: Callable[[nn.Module], bool], value: bool | AutoWrap
) -> Callable[[nn.Module], bool]:
    """Which units to checkpoint; a policy that selects no unit is an error, not a no-op."""
    if value is True or value is False:
        return lambda m: value
    if value is None:
        return lambda m: False
    try:
        selected = resolve_policy(module, value)
    except (TypeError, ValueError) as e:
        raise type(e)(f"checkpoint_activations: {e}") from None
    if not any(units(m) and selected(m) for m in module.modules() if m is not module):
        raise ValueError(
            f"checkpoint_activations={value!r} selects none of the units; it chooses among "
            "the modules auto_wrap selects. Pass checkpoint_activations=True to checkpoint "
            "every unit, or select a class that auto_wrap also selects."
        )
    return selected


def resolve_compile(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    if value is True:
        return {}
    if value is False or value is None:
        return None
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(
        f"compile takes True, False or a dict of torch.compile options, got {value!r}; "
        "e.g. compile={'mode': 'max-autotune'}."
    )


def _signature(name: str, p: Tensor) -> int:
    text = f"{name}|{tuple(p.shape)}|{p.dtype}|{p.requires_grad}".encode()
    return int.from_bytes(hashlib.sha1(text).digest()[:7], "little")


def check_same_model(
    module: nn.Module, group: Group, device: torch.device, options: dict[str, int]
) -> None:
    """One small all-reduce: every rank must hold the same parameter names, shapes and dtypes,
    and pass the same ``options`` (integers, such as the stage)."""
    if group_size(group) == 1:
        return
    named = list(module.named_parameters())
    sigs = [_signature(n, p) for n, p in named]
    digest = _signature("|".join(str(s) for s in sigs), torch.empty(0))
    values = list(options.values())
    t = torch.tensor(
        [len(sigs), digest, *values, -len(sigs), -digest, *(-v for v in values)],
        dtype=torch.int64,
        device=device,
    )
    all_reduce(t, group, dist.ReduceOp.MIN).wait()
    low, high = t.tolist()[: len(t) // 2], [-v for v in t.tolist()[len(t) // 2 :]]
    for (name, mine), lo, hi in zip(options.items(), low[2:], high[2:]):
        if lo != hi:
            raise ValueError(
                f"ShardedModule: ranks passed different {name}: this rank (rank "
                f"{group.rank()}) passed {mine}, others between {lo} and {hi}. Pass the same "
                "arguments on every rank."
            )
    if low[:2] == high[:2]:
        return
    longest = high[0]
    padded = sigs + [-1] * (longest - len(sigs))
    t = torch.tensor(padded + [-s for s in padded], dtype=torch.int64, device=device)
    all_reduce(t, group, dist.ReduceOp.MIN).wait()
    values = t.tolist()
    first = next(i for i in range(longest) if values[i] != -values[longest + i])
    if first < len(named):
        name, p = named[first]
        here = f"parameter #{first} '{name}' with shape {tuple(p.shape)} and dtype {p.dtype}"
    else:
        here = f"no parameter #{first} (this rank has only {len(named)})"
    raise ValueError(
        f"ShardedModule: the model differs across ranks; rank {group.rank()} has {here}, "
        "which differs on another rank. Build the same model on every rank (same config, "
        "same code path) before wrapping."
    )
