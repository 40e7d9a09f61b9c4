"""A checkpoint's ``extra``: what each rank saves beside the model (step, scheduler and
data-loader state, RNG states), serialised once it is known that ``load_checkpoint`` will read
it back with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
from typing import Any

import torch

__all__ = ["extra_bytes_of"]


def extra_bytes_of(extra: dict[str, Any]) -> bytes:
    """``extra`` serialised, once checked that ``load_checkpoint`` will read it back.

    Raises:
        TypeError: naming each key whose value ``torch.load(weights_only=True)`` refuses.
    """
    buffer = io.BytesIO()
    torch.save(extra, buffer)
    if not _loads_back(buffer.getvalue()):
        refused = []
        for key, value in extra.items():
            leaf = _refused_leaf(value)
            if leaf is not None:
                refused.append(
                    f"'{key}' (holds a {type(leaf).__module__}.{type(leaf).__qualname__})"
                )
        raise TypeError(
            f"save_checkpoint: extra {', '.join(refused)} would not load back: "
            "load_checkpoint reads with torch.load(weights_only=True), which takes tensors, "
            "numbers, strings, and lists, tuples and dicts of them. Convert first, e.g. "
            "vars(args) for an argparse.Namespace, torch.from_numpy(a) or a.tolist() for a "
            "numpy array, and for numpy's RNG state its tuple with the array as a list."
        ) from None
    return buffer.getvalue()


def _loads_back(data: bytes) -> bool:
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception:  # any refusal: what is refused is found by _refused_leaf
        return False
    return True


def _refused_leaf(value: Any) -> Any | None:
    """The first value inside ``value`` that ``torch.load(weights_only=True)`` refuses."""
    children: Any = ()
    if isinstance(value, dict):
        children = [*value.keys(), *value.values()]
    elif isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        children = value
    for child in children:
        leaf = _refused_leaf(child)
        if leaf is not None:
            return leaf
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return None if _loads_back(buffer.getvalue()) else value
