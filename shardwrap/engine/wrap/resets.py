"""Initialisers on a wrapped module: run on full parameters, refused on pieces.

Design note. A wrapped module's parameters are this rank's pieces, shaped ``(1, ..., n)``, so an
initialiser that reads a parameter's shape computes from the piece: ``nn.Linear``'s and the
convolutions' ``reset_parameters()`` (Kaiming, from the fan-in) would draw from a range set by
``n`` instead of the input width, far too narrow for a large layer, and ``nn.Embedding``'s would
zero the piece's first row instead of the padding row. The habit comes from a model re-initialised
after wrapping (``for m in model.modules(): m.reset_parameters()``, as after ``to_empty()``), and
would train from the wrong weights without a word. So each module holding pieces gets an instance
attribute in place of its class's ``reset_parameters`` (and ``_reset_parameters``): inside
``model.gathered(...)``, where its attributes are the full parameters, it runs the class's own;
otherwise it raises ``ValueError`` naming the module and the two ways that initialise the full
parameters.

A ``transformers`` model initialises through its own ``_init_weights(module)``, one module at a
time (``model.apply(model._init_weights)``): on pieces it draws every rank's piece alike, and an
embedding's padding row, ``weight[padding_idx]``, is the whole piece when ``padding_idx`` is 0
(the table zeroed on every rank) and out of range otherwise. Each module whose class has one gets
the same guard, judging the module it is handed.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from ...tiers.shard_param import ShardParam

__all__ = ["guard_resets"]

RESETS = ("reset_parameters", "_reset_parameters")
INIT_WEIGHTS = "_init_weights"  # transformers' initialiser of the module it is handed


def guard_resets(model: nn.Module) -> None:
    """Guard the initialisers of each module of ``model`` that holds shard parameters, and
    each module's ``_init_weights(module)``."""
    for name, module in model.named_modules():
        own = getattr(type(module), INIT_WEIGHTS, None)
        if callable(own) and INIT_WEIGHTS not in module.__dict__:
            module.__dict__[INIT_WEIGHTS] = _guarded_init_weights(weakref.ref(module), own, name)
        if not any(isinstance(p, ShardParam) for p in module._parameters.values()):
            continue
        for method in RESETS:
            own = getattr(type(module), method, None)
            if callable(own) and method not in module.__dict__:
                module.__dict__[method] = _guarded(weakref.ref(module), own, name, method)


def _pieces(module: nn.Module) -> list[str]:
    """The names of ``module``'s own parameters that show this rank's pieces now (inside
    ``gathered()`` they show the full parameters)."""
    return [
        attr
        for attr, p in module._parameters.items()
        if isinstance(p, ShardParam) and getattr(module, attr) is p
    ]


def _where(name: str) -> str:
    """How a message names the module at ``name`` from the model (``""``: the model itself)."""
    return f"model.get_submodule({name!r})" if name else "model"


def _refusal(call: str, pieces: list[str], fix: str) -> ValueError:
    return ValueError(
        f"shardwrap: {call} would initialise this rank's pieces of {', '.join(pieces)}, and an "
        "initialiser reads the shape of what it fills (a piece's is not the parameter's: "
        "Kaiming's range would come from the piece's length, and row i of an embedding is not "
        "the piece's row i). Re-initialise the full parameters: with model.gathered("
        f"modifier_rank=0): {fix} (rank 0's values go to every rank), or build the model on "
        "the meta device and let wrapping initialise it (param_init_fn=... for an initialiser "
        "of your own)."
    )


def _guarded(
    ref: Callable[[], nn.Module | None], own: Callable[..., Any], name: str, method: str
) -> Callable[..., Any]:
    """The class's ``own`` initialiser, run only while the module shows full parameters (the
    module held weakly: the guard is the module's own attribute)."""

    def reset(*args: Any, **kwargs: Any) -> Any:
        module = ref()
        pieces = _pieces(module)
        if pieces:
            where = _where(name)
            raise _refusal(f"{where}.{method}()", pieces, f"{where}.{method}()")
        return own(module, *args, **kwargs)

    return reset


def _guarded_init_weights(
    ref: Callable[[], nn.Module | None], own: Callable[..., Any], name: str
) -> Callable[..., Any]:
    """The class's ``_init_weights(target)``, run only while ``target`` shows full parameters."""

    def init_weights(target: nn.Module, *args: Any, **kwargs: Any) -> Any:
        model = ref()
        pieces = _pieces(target)
        if pieces:
            where = _where(name)
            inside = next((n for n, m in model.named_modules() if m is target), None)
            path = ".".join(n for n in (name, inside) if n)
            handed = type(target).__name__ if inside is None else _where(path)
            raise _refusal(
                f"{where}._init_weights({handed})", pieces, f"{where}.apply({where}._init_weights)"
            )
        return own(model, target, *args, **kwargs)

    return init_weights
