"""A sharded model under ``accelerate`` (a plain loop, or the ``transformers`` Trainer on it).

A sharded model tells accelerate to hand it back as it is (``_is_accelerate_prepared``): no
DDP, no move, and no autocast or ``torch.compile`` wrapper either. The precision and
compilation accelerate was asked for (``Accelerator(mixed_precision=..., dynamo_backend=...)``,
``TrainingArguments(bf16=True, fp16=True, torch_compile=True)``) would therefore change
nothing; they are checked against what the model was wrapped with, when accelerate prepares
the model (and when ``shardwrap.hf.Trainer`` is built):

1. ``bf16``/``fp16`` with ``ShardedModule(..., mixed_precision=MixedPrecision(param_dtype=``
   the same dtype``))``: they agree, accepted. fp16's loss scaler becomes a
   :class:`shardwrap.ShardedGradScaler` of the same settings (torch's agrees across ranks as
   well, through the shard gradients).
2. ``bf16``/``fp16`` otherwise, and ``fp8``: refused, naming the ``mixed_precision=`` to wrap
   with.
3. Compilation with units compiled (``ShardedModule(..., compile=True)``): accepted; without:
   refused, naming ``compile=True``.

The settings are the same on every rank and the model's were agreed when it was wrapped, so
every rank raises alike, before any collective.

Saving. accelerate saves every model's ``state_dict()`` and every optimizer's state on rank 0
alone, which for a sharded model is rank 0's pieces; the accelerator that prepares one saves
it the sharded way instead:

- ``save_state(dir)`` writes each sharded model with the optimizer over its parameters as a
  shardwrap checkpoint, ``dir/shardwrap`` (``dir/shardwrap_1``, ... for further models;
  every rank writes its pieces), and everything else (schedulers, RNG states, scaler,
  other models) as accelerate does; ``load_state(dir)`` reads them back, at any world size.
  Its save and load hooks are not shown the sharded models.
- ``get_state_dict(model)`` returns ``model.full_state_dict()``: full tensors, on every rank.

HACK: accelerate hands a prepared model nothing that names the accelerator; the mark's
reader does (a few caller frames, read as accelerate reads the mark). Its save and load
hooks see neither the optimizers nor a way to leave them out, so the accelerator's own three
methods are wrapped, on that accelerator only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..checkpoint.load import load_checkpoint
from ..checkpoint.save import save_checkpoint
from ..engine.optim.callers import caller_frame
from ..engine.optim.grad_scaler import ShardedGradScaler
from ..engine.step.root import Root
from ..engine.wrap import extensions
from ..engine.wrap.sharded_module import ShardedModule

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
    frame = caller_frame(lambda f: _is_accelerator(type(f.f_locals.get("self"))), 8, skip=2)
    return None if frame is None else frame.f_locals["self"]


def _is_accelerator(cls: type) -> bool:
    return any(
        c.__name__ == "Accelerator" and c.__module__ == "accelerate.accelerator"
        for c in cls.__mro__
    )


def check_accelerator(accelerator: Any, model: nn.Module) -> None:
    """Check ``accelerator``'s settings against the sharded ``model`` and give fp16 loss
    scaling a :class:`ShardedGradScaler`.

    Raises:
        ValueError: as :func:`check_settings`; or an accelerator that sees one process while
            the model is sharded over several (under ``torchrun`` on CPUs without
            ``ACCELERATE_USE_CPU=1``): its data loaders would give every rank the whole batch.
    """
    root: Root = model._shardwrap_root  # type: ignore[assignment]
    world = root.mesh.world_size
    if accelerator.num_processes == 1 and world > 1:
        raise ValueError(
            f"accelerate sees one process ({accelerator.distributed_type}) while the model is "
            f"sharded over {world} ranks: its data loaders would give every rank the whole "
            f"batch ({world} times the work, each rank training on the same data) and "
            "gather_for_metrics would see one rank. On CPUs accelerate counts the processes "
            "that torchrun started only when told to: set ACCELERATE_USE_CPU=1 in the "
            "environment, or pass Accelerator(cpu=True) (accelerate launch sets it itself)."
        )
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
    _save_sharded(accelerator)


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


_SAVES = "_shardwrap_saves"
CHECKPOINT = "shardwrap"  # dir/shardwrap, dir/shardwrap_1, ...: one per sharded model


def _sharded_pairs(accelerator: Any) -> list[tuple[nn.Module, Any]]:
    """Each sharded model the accelerator prepared, with the prepared optimizer over its
    parameters (or ``None``).

    Raises:
        ValueError: an optimizer over the parameters of several models, or two optimizers
            over one sharded model (a shardwrap checkpoint holds one); before any file.
    """
    models = [m for m in accelerator._models if isinstance(m, ShardedModule)]
    owner = {id(p): i for i, m in enumerate(models) for p in m.parameters()}
    found: list[list[Any]] = [[] for _ in models]
    for optimizer in accelerator._optimizers:
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        mine = {owner[i] for i in ids if i in owner}
        if len(mine) > 1 or (mine and len(ids) != sum(i in owner for i in ids)):
            raise ValueError(
                "accelerator.save_state/load_state: an optimizer steps the parameters of a "
                "sharded model and of other models; a shardwrap checkpoint holds one model "
                "with its optimizer. Give each model its own optimizer, or call "
                "shardwrap.save_checkpoint(dir, model, optimizer) yourself."
            )
        for i in mine:
            found[i].append(optimizer)
    if any(len(f) > 1 for f in found):
        raise ValueError(
            "accelerator.save_state/load_state: several optimizers step one sharded model; a "
            "shardwrap checkpoint holds one. Use one optimizer (with parameter groups), or "
            "call shardwrap.save_checkpoint(dir, model, optimizer) yourself."
        )
    return [(m, f[0] if f else None) for m, f in zip(models, found)]


def _folder(directory: str | Path, index: int) -> Path:
    return Path(directory) / (CHECKPOINT if index == 0 else f"{CHECKPOINT}_{index}")


@contextmanager
def _set_aside(accelerator: Any, pairs: list[tuple[nn.Module, Any]]) -> Iterator[None]:
    """The accelerator without the sharded models and their optimizers, for the duration."""
    aside = {id(x) for pair in pairs for x in pair if x is not None}
    models, optimizers = accelerator._models, accelerator._optimizers
    accelerator._models = [m for m in models if id(m) not in aside]
    accelerator._optimizers = [o for o in optimizers if id(o) not in aside]
    try:
        yield
    finally:
        accelerator._models, accelerator._optimizers = models, optimizers


def _save_sharded(accelerator: Any) -> None:
    """Wrap ``accelerator``'s ``save_state``, ``load_state`` and ``get_state_dict`` (once)."""
    if getattr(accelerator, _SAVES, False):
        return
    setattr(accelerator, _SAVES, True)
    save_state, load_state = accelerator.save_state, accelerator.load_state
    get_state_dict = accelerator.get_state_dict

    def around(
        original: Callable[..., Any], register: Callable[[Callable[..., None]], Any], write: bool
    ) -> Callable[..., Any]:
        @functools.wraps(original)
        def run(*args: Any, **kwargs: Any) -> Any:
            pairs = _sharded_pairs(accelerator)
            if not pairs:
                return original(*args, **kwargs)

            def sharded(models: Any, *rest: Any) -> None:
                directory = rest[-1]  # (weights, output_dir) when saving, (input_dir) loading
                for i, (model, optimizer) in enumerate(pairs):
                    if write:
                        save_checkpoint(_folder(directory, i), model, optimizer)
                    else:
                        load_checkpoint(_folder(directory, i), model, optimizer)

            handle = register(sharded)
            try:
                with _set_aside(accelerator, pairs):
                    return original(*args, **kwargs)
            finally:
                handle.remove()

        return run

    @functools.wraps(get_state_dict)
    def state_dict(model: nn.Module, unwrap: bool = True) -> dict[str, Any]:
        inner = accelerator.unwrap_model(model) if unwrap else model
        if isinstance(inner, ShardedModule):
            return inner.full_state_dict()
        return get_state_dict(model, unwrap=unwrap)

    accelerator.save_state = around(save_state, accelerator.register_save_state_pre_hook, True)
    accelerator.load_state = around(load_state, accelerator.register_load_state_pre_hook, False)
    accelerator.get_state_dict = state_dict


def _on_prepare(model: nn.Module) -> None:
    accelerator = _accelerator_of_caller()
    if accelerator is not None:
        check_accelerator(accelerator, model)


extensions.register_prepare_check(_on_prepare)
