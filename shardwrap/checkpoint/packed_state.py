"""Optimizer state held in tensor subclasses, saved as its plain parts.

Low-bit optimizers (torchao's ``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8``) keep each state
tensor as a subclass that wraps plain tensors: codes, block scales, a lookup table. A file of
plain tensors cannot hold the subclass, and saving it dequantized would load it back as float32
state, at four times the memory. So each such state tensor is saved as its parts, as the
subclass itself lists them (``__tensor_flatten__``): ``exp_avg`` as ``exp_avg.codes``,
``exp_avg.scale``, ... , with a record of the class and of the rest of what it flattened into;
loading rebuilds it from them (``__tensor_unflatten__``), the same codes and scales, so training
goes on exactly. The record is JSON (it goes into the metadata): the flattened attributes may be
numbers, strings, booleans, dtypes, and lists or tuples of them.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["pack", "unpack"]


def pack(key: str, value: Tensor) -> tuple[dict[str, Tensor], dict[str, Any] | None]:
    """State tensor ``key`` as the plain tensors to save, by key, and its record (``None`` for
    a plain tensor, saved as it is).

    Raises:
        ValueError: a subclass that does not flatten into plain tensors and JSON-able
            attributes, naming it.
    """
    if type(value) is Tensor or not hasattr(value, "__tensor_flatten__"):
        return {key: value}, None
    names, ctx = value.__tensor_flatten__()
    parts = {f"{key}.{n}": getattr(value, n) for n in names}
    cls = type(value)
    if any(type(t) is not Tensor for t in parts.values()):
        raise ValueError(
            f"save_checkpoint: optimizer state '{key}' is a {cls.__name__} whose parts are "
            "not plain tensors; it cannot be saved"
        )
    record = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "parts": list(names),
        "ctx": _encode(ctx, key, cls),
        "shape": list(value.shape),
        "stride": list(value.stride()),
    }
    return parts, record


def unpack(
    read: dict[str, Tensor],
    records: dict[str, dict[str, Any]],
    plain: Callable[[Tensor], Tensor],
    device: torch.device,
) -> dict[str, Tensor]:
    """One parameter's state by key, from the tensors ``read`` by saved key and the
    :func:`pack` records: each packed key rebuilt from its parts (on ``device``, in their saved
    dtypes), every other tensor through ``plain``.

    Raises:
        ValueError: a record naming a class that is not loaded or not a tensor subclass, or a
            part that was not read.
    """
    state = {}
    taken: set[str] = set()
    for key, record in records.items():
        cls = _class(record.get("class"), key)
        try:
            parts = {n: read[f"{key}.{n}"].to(device) for n in record["parts"]}
            ctx = _decode(record["ctx"])
            state[key] = cls.__tensor_unflatten__(
                parts, ctx, torch.Size(record["shape"]), tuple(record["stride"])
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"load_checkpoint: optimizer state '{key}' ({record.get('class')}) is recorded "
                f"with parts or attributes that were not saved: {e}"
            ) from e
        taken.update(f"{key}.{n}" for n in record["parts"])
    state.update((k, plain(v)) for k, v in read.items() if k not in taken)
    return state


def _class(name: Any, key: str) -> type:
    """The tensor subclass ``"module.QualName"``, from a module already loaded: the optimizer
    that made the state imported it; a checkpoint never makes shardwrap import a module."""
    module, _, qualname = str(name).rpartition(".")
    cls = getattr(sys.modules.get(module), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, Tensor)):
        raise ValueError(
            f"load_checkpoint: optimizer state '{key}' was saved as a {name}, which is not a "
            "loaded tensor subclass: build the optimizer that made it before loading"
        )
    return cls


def _encode(value: Any, key: str, cls: type) -> Any:
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, key, cls) for v in value]}
    if isinstance(value, list):
        return [_encode(v, key, cls) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ValueError(
        f"save_checkpoint: optimizer state '{key}' is a {cls.__name__} that flattens into a "
        f"{type(value).__name__}, which a checkpoint cannot record"
    )


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "dtype" in value:
        dtype = getattr(torch, str(value["dtype"]), None)
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{value['dtype']!r} is no dtype")
        return dtype
    if isinstance(value, dict):
        return tuple(_decode(v) for v in value["tuple"])
    if isinstance(value, list):
        return [_decode(v) for v in value]
    return value
