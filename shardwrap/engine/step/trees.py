"""Tensors inside what a module takes and returns: nested containers, dataclasses, plain objects.

Design note. Mixed precision casts a unit's floating-point inputs, the root moves the model's
CPU inputs to the compute device, and the root hooks a unit's outputs for backward and keeps
them from aliasing buffers it releases. Inputs and outputs come
as torch's pytrees (tuples, lists, dicts, named tuples, Hugging Face's ``ModelOutput``), as
dataclasses (a batch of several tensors), and as plain objects holding tensors in attributes.
Inputs are the caller's: a dataclass is copied, never changed. Outputs are this call's own: a
dataclass or plain object is changed in place, so the caller gets the object forward made.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

__all__ = ["cast_floating", "map_inputs", "map_outputs", "to_device"]

# How deep dataclasses and objects inside each other are searched: a model's outputs rarely
# nest more, and an object graph (a cache, a config) must not be walked whole.
MAX_DEPTH = 4

TensorFn = Callable[[Tensor], Tensor]


def map_inputs(tree: Any, fn: TensorFn) -> Any:
    """``tree`` with ``fn`` applied to each tensor in it, dataclasses included (copied, so
    the caller's objects are left as they were)."""
    return _map(tree, fn, objects=False, depth=0)


def map_outputs(tree: Any, fn: TensorFn) -> Any:
    """``tree`` with ``fn`` applied to each tensor in it, dataclasses and plain objects'
    attributes included (changed in place)."""
    return _map(tree, fn, objects=True, depth=0)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor in it cast to ``dtype`` (differentiably)."""
    return map_inputs(tree, lambda t: t.to(dtype) if t.is_floating_point() else t)


def to_device(tree: Any, device: torch.device) -> Any:
    """``tree`` with every CPU tensor in it moved to ``device`` (differentiably): the model's
    inputs, as DDP and FSDP2 move them to the compute device."""
    return map_inputs(tree, lambda t: t.to(device) if t.device.type == "cpu" else t)


def _map(tree: Any, fn: TensorFn, objects: bool, depth: int) -> Any:
    def leaf(x: Any) -> Any:
        if isinstance(x, Tensor):
            return fn(x)
        if depth >= MAX_DEPTH or isinstance(x, (type, nn.Module)):
            return x
        if dataclasses.is_dataclass(x):
            names = [f.name for f in dataclasses.fields(x)]
        elif objects and _plain_object(x):
            names = list(vars(x))
        else:
            return x
        changed = {}
        for name in names:
            value = getattr(x, name, None)
            new = _map(value, fn, objects, depth + 1)
            if new is not value:
                changed[name] = new
        if not changed:
            return x
        target = x if objects else copy.copy(x)
        for name, new in changed.items():
            object.__setattr__(target, name, new)  # a frozen dataclass too
        return target

    return tree_map(leaf, tree)


def _plain_object(x: Any) -> bool:
    """An instance of a user class holding attributes (not a scalar, string or builtin)."""
    return hasattr(x, "__dict__") and type(x).__module__ != "builtins" and not callable(x)
