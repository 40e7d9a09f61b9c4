"""A sharded model under ``accelerate`` (a plain loop, or the ``transformers`` Trainer on it).

A sharded model tells accelerate to hand it back as it is (``_is_accelerate_prepared``): no
DDP, no move, and no autocast or ``torch.compile`` wrapper either. The precision and
compilation accelerate was asked for (``Accelerator(mixed_precision=..., dynamo_backend=...)``,
``TrainingArguments(bf16=True, fp16=True, torch_compile=True)``) would therefore change
nothing; they are checked against what the model was wrapped with, when accelerate prepares
the model (and when ``shardwrap.hf.Trainer`` is built):

1. ``bf16``/``fp16`` with ``ShardedModule(..., mixed_precision=MixedPrecision(param_dtype=``
   the same dtype``))``: they agree, accepted. fp16's loss scaler becomes a
   :class:`shardwrap.ShardedGradScaler` (torch's would skip steps on some ranks only).
2. ``bf16``/``fp16`` otherwise, and ``fp8``: refused, naming the ``mixed_precision=`` to wrap
   with.
3. Compilation with units compiled (``ShardedModule(..., compile=True)``): accepted; without:
   refused, naming ``compile=True``.

The settings are the same on every rank and the model's were agreed when it was wrapped, so
every rank raises alike, before any collective.

HACK: accelerate hands a prepared model nothing that names the accelerator; the mark's
reader does (a few caller frames, read as accelerate reads the mark).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

from ..engine import extensions
from ..engine.grad_scaler import ShardedGradScaler
from ..engine.root import Root

__all__ = ["check_settings", "check_trainer_arguments"]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_DTYPE_NAMES = {torch.bfloat16: "torch.bfloat16", torch.float16: "torch.float16"}


def check_settings(
    root: Root, precision: str, compiling: bool, precision_set: str, compile_set: str
) -> None:
    """Refuse a precision or compilation setting the sharded model would silently ignore.

    Args:
        root: the sharded model's root.
        precision: ``"no"``, ``"bf16"``, ``"fp16"`` or ``"fp8"``, as accelerate names it.
        compiling: whether ``torch.compile`` was asked for.
        precision_set, compile_set: how the user set them, for the message.

    Raises:
        ValueError: case 2 or 3 of the module, naming the ``ShardedModule`` keyword.
    """
    own = root.precision.param_dtype if root.precision is not None else None
    if precision == "fp8":
        raise ValueError(
            f"{precision_set}: a sharded model computes in the dtype it was wrapped with, and "
            "shardwrap has no fp8 compute. Drop it and pass mixed_precision="
            "shardwrap.MixedPrecision(param_dtype=torch.bfloat16) to ShardedModule."
        )
    wanted = _DTYPES.get(precision)
    if wanted is not None and own != wanted:
        computes = "/".join(
            sorted(
                {
                    str(g.compute_dtype).removeprefix("torch.")
                    for u in root.units
                    for g in u.groups
                    if g.dtype.is_floating_point
                }
            )
        )
        scaler = (
            " (loss scaling then uses shardwrap.ShardedGradScaler)" if precision == "fp16" else ""
        )
        raise ValueError(
            f"{precision_set} does not reach a sharded model: it is handed back as it was "
            f"wrapped and would compute in {computes}. Pass mixed_precision=shardwrap."
            f"MixedPrecision(param_dtype={_DTYPE_NAMES[wanted]}) to ShardedModule{scaler}, "
            f"or drop {precision_set}."
        )
    if compiling and root.compile_options is None:
        raise ValueError(
            f"{compile_set} does not reach a sharded model: it is handed back as it was "
            "wrapped, uncompiled. Pass compile=True (or compile={'mode': ...}) to "
            f"ShardedModule, which compiles each unit with the sharding hooks outside, or "
            f"drop {compile_set}."
        )


def check_trainer_arguments(root: Root, args: Any) -> None:
    """:func:`check_settings` for ``TrainingArguments``; also refuses ``bf16_full_eval`` and
    ``fp16_full_eval`` (evaluation would cast the sharded model, which it cannot be).

    Raises:
        ValueError: as :func:`check_settings`, naming the argument and the keyword.
    """
    for name, dtype in (("bf16_full_eval", "torch.bfloat16"), ("fp16_full_eval", "torch.float16")):
        if getattr(args, name, False):
            raise ValueError(
                f"TrainingArguments({name}=True) casts the model for evaluation, which a sharded "
                f"model cannot be. Pass mixed_precision=shardwrap.MixedPrecision(param_dtype="
                f"{dtype}) to ShardedModule (training and evaluation compute in it) instead."
            )
    precision = "bf16" if args.bf16 else "fp16" if args.fp16 else "no"
    check_settings(
        root,
        precision,
        bool(args.torch_compile),
        f"TrainingArguments({precision}=True)",
        "TrainingArguments(torch_compile=True)",
    )


def _accelerator_of_caller() -> Any:
    """The ``accelerate.Accelerator`` among the last few callers, or ``None``."""
    frame = sys._getframe(2)
    for _ in range(8):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if owner is not None and _is_accelerator(type(owner)):
            return owner
        frame = frame.f_back
    return None


def _is_accelerator(cls: type) -> bool:
    return any(
        c.__name__ == "Accelerator" and c.__module__ == "accelerate.accelerator"
        for c in cls.__mro__
    )


def check_accelerator(accelerator: Any, model: nn.Module) -> None:
    """Check ``accelerator``'s settings against the sharded ``model`` and give fp16 loss
    scaling a :class:`ShardedGradScaler`.

    Raises:
        ValueError: as :func:`check_settings`.
    """
    root: Root = model._shardwrap_root  # type: ignore[assignment]
    precision = str(accelerator.mixed_precision)
    dynamo = getattr(accelerator.state, "dynamo_plugin", None)
    backend = str(getattr(getattr(dynamo, "backend", None), "value", "no")).lower()
    check_settings(
        root,
        precision,
        backend != "no",
        f"Accelerator(mixed_precision={precision!r})",
        f"Accelerator(dynamo_backend={backend!r})",
    )
    _share_scaler(accelerator)


def _share_scaler(accelerator: Any) -> None:
    """Replace the loss scaler accelerate made for fp16 (on an accelerator device) with a
    :class:`ShardedGradScaler` of the same settings, also in the optimizers it prepared."""
    scaler = getattr(accelerator, "scaler", None)
    if scaler is None or isinstance(scaler, ShardedGradScaler):
        return
    handler = getattr(accelerator, "scaler_handler", None)
    settings = handler.to_kwargs() if handler is not None else {}
    sharded = ShardedGradScaler(device=accelerator.device.type, **settings)
    accelerator.scaler = sharded
    for optimizer in accelerator._optimizers:
        if getattr(optimizer, "scaler", None) is scaler:
            optimizer.scaler = sharded


def _on_prepare(model: nn.Module) -> None:
    accelerator = _accelerator_of_caller()
    if accelerator is not None:
        check_accelerator(accelerator, model)


extensions.register_prepare_check(_on_prepare)
