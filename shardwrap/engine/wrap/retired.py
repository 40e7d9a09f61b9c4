"""Original parameters retired at wrap time: freed, and loud if an old optimizer steps them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...tiers.shard_param import first_among
from ..shards.tensor_parallel import is_dtensor

__all__ = ["retire"]


def retire(p: nn.Parameter, name: str) -> None:
    """Free an original parameter, so that an optimizer still holding it fails loudly.

    The parameter's class becomes one whose ``.grad`` is always present and raises on any
    use: every optimizer reads the gradients of the parameters it steps, so an optimizer
    built before wrapping raises at its first ``step()``, naming the parameter, rather than
    silently never training the model. Nothing is registered outside the parameter.
    """
    with torch.no_grad():
        if is_dtensor(p):
            # NOTE: its memory is its local tensor's, which to_local() only aliases.
            p._local_tensor.data = torch.empty(0, dtype=p.dtype, device=p.device)
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    trap = torch.Tensor._make_subclass(_StaleGrad, torch.empty(0, dtype=p.dtype, device=p.device))
    trap._shardwrap_name = name
    object.__setattr__(p, "_shardwrap_stale_grad", trap)
    p.__class__ = _retired_class(type(p))


class _StaleGrad(Tensor):
    """The gradient of a retired parameter: any use raises, naming the parameter."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        trap = first_among(_StaleGrad, args, kwargs)
        raise RuntimeError(
            f"shardwrap: this optimizer holds parameter '{trap._shardwrap_name}' from before "
            "the model was wrapped; those parameters no longer train the model. Build the "
            "optimizer after wrapping: opt = torch.optim.AdamW(model.parameters())."
        )


def _stale_grad(self: nn.Parameter) -> Tensor:
    return self._shardwrap_stale_grad


def _ignore_grad(self: nn.Parameter, value: Tensor | None) -> None:
    """``zero_grad()`` sets ``None``: the trap stays."""


_RETIRED_CLASSES: dict[type, type] = {}


def _retired_class(cls: type) -> type:
    if cls not in _RETIRED_CLASSES:
        _RETIRED_CLASSES[cls] = type(
            f"Retired{cls.__name__}", (cls,), {"grad": property(_stale_grad, _ignore_grad)}
        )
    return _RETIRED_CLASSES[cls]
