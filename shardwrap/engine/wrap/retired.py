"""Original parameters retired at wrap time: freed, and loud if an old optimizer steps them or
a module outside the wrapped model computes with them."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...tiers.shard_param import first_among
from ..shards.tensor_parallel import is_dtensor

__all__ = ["is_retired", "retire"]


def retire(p: nn.Parameter, name: str) -> None:
    """Free an original parameter, so that an optimizer still holding it fails loudly.

    The parameter's class becomes one whose ``.grad`` is always present and raises on any
    use: every optimizer reads the gradients of the parameters it steps, so an optimizer
    built before wrapping raises at its first ``step()``, naming the parameter, rather than
    silently never training the model. Nothing is registered outside the parameter.

    Any other computation with it raises too, naming it (reading its attributes does not): a
    module outside the wrapped model that still holds it (a weight tied across the wrapped
    module's boundary) would compute with an empty tensor, and its ``state_dict`` would hold
    one; ``requires_grad_`` through a reference taken before wrapping would change nothing.
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


def is_retired(p: Tensor) -> bool:
    """Whether ``p`` is a parameter that wrapping retired (a model holding it was wrapped)."""
    return isinstance(p, _Retired)


class _Retired:
    """What every retired parameter's class derives from besides its own."""

    _shardwrap_stale_grad: _StaleGrad


# Reading what a parameter is (a property, its size, its printout, its hash as a dict key) is
# no use of its values: allowed on a retired one. Anything else computes with them, or writes.
_READS = frozenset(
    {"__repr__", "__format__", "__hash__", "size", "dim", "numel", "nelement", "element_size"}
    | {"is_complex", "is_floating_point"}
)


def _refuse_use(cls: type, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
    name = getattr(func, "__name__", "")
    if name in _READS or (name == "__get__" and getattr(func, "__self__", None) is not None):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))
    retired = first_among(_Retired, args, kwargs)
    raise RuntimeError(
        f"shardwrap: parameter '{retired._shardwrap_stale_grad._shardwrap_name}' was moved into a "
        "ShardedModule when its model was wrapped, and this tensor, the parameter from before, "
        f"was freed; {name or func} used it here. An optimizer built before wrapping holds it "
        "(build the optimizer after wrapping: opt = torch.optim.AdamW(model.parameters())), or "
        "a module outside the wrapped model (a weight tied across the wrapped module's "
        "boundary, a module kept aside), which no longer has it: wrap the module that holds "
        "every use of it (the whole model, choosing units with auto_wrap)."
    )


def _stale_grad(self: nn.Parameter) -> Tensor:
    return self._shardwrap_stale_grad


def _ignore_grad(self: nn.Parameter, value: Tensor | None) -> None:
    """``zero_grad()`` sets ``None``: the trap stays."""


_RETIRED_CLASSES: dict[type, type] = {}


def _retired_class(cls: type) -> type:
    if cls not in _RETIRED_CLASSES:
        _RETIRED_CLASSES[cls] = type(
            f"Retired{cls.__name__}",
            (cls, _Retired),
            {
                "grad": property(_stale_grad, _ignore_grad),
                "__torch_function__": classmethod(_refuse_use),
            },
        )
    return _RETIRED_CLASSES[cls]
