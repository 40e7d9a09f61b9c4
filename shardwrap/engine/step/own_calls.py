"""Modules called on their own, outside their unit's forward.

``generate()`` calls a model's encoder by itself, users call ``get_input_embeddings()`` or an
inner ``model.model``: the module's parameters then belong to a unit whose forward is not
running. Each module holding a unit's parameters (other than the unit's own module, whose hooks
gather it) gets hooks that gather the unit first, agreed across ranks like any gather, and
release it after, as the strategy says. Inside the unit's forward the unit is already gathered
and the hooks do nothing; inside ``gathered()`` (``paused``) every parameter is already full.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.utils.hooks import RemovableHandle

from ..optim.callers import caller_frame
from ..shards.eager import eager, untransformed
from ..shards.saved import SavedViews
from ..shards.unit import ShardState, Unit

__all__ = ["Driver", "OwnCalls", "given_hint", "piece_hint", "precision_hint", "ready"]


class Driver(Protocol):
    """What the own-call hooks ask of the root that drives the units (``step/root.py``)."""

    saved: SavedViews

    @property
    def root(self) -> Unit: ...

    @property
    def idle(self) -> bool: ...

    @property
    def in_backward(self) -> bool: ...

    def settle(self) -> None: ...

    def ensure_gathered(self, unit: Unit, backward: bool) -> None: ...

    def gather_for_recompute(self, unit: Unit, grad: bool) -> None: ...

    def release_after_forward(self, unit: Unit, grad: bool) -> bool: ...


class OwnCalls:
    """The own-call hooks of one model's modules, driven by its root."""

    def __init__(self, root: Driver, units: list[Unit]) -> None:
        self._root = root
        self.paused = False  # gathered() exposes exact full parameters: leave them be
        # id(module) -> the units its call gathered, and those it showed in full
        self._called_alone: dict[int, tuple[list[Unit], list[Unit]]] = {}
        self._hooks: dict[int, list[RemovableHandle]] = {}  # id(module) -> its call hooks
        owners: dict[int, tuple[nn.Module, list[Unit]]] = {}
        for unit in units:
            for g in unit.groups:
                for slots in g.slots:
                    for module, _ in slots:
                        if module is not unit.module:
                            entry = owners.setdefault(id(module), (module, []))
                            if unit not in entry[1]:
                                entry[1].append(unit)
        for module, units in owners.values():
            self._hooks[id(module)] = [
                module.register_forward_pre_hook(eager(untransformed(self._hook_pre_call(units)))),
                module.register_forward_hook(eager(untransformed(self._hook_post_call(units)))),
            ]

    def unhook(self, module: nn.Module) -> None:
        """Remove the own-call hooks of ``module`` and every module inside it."""
        for inner in module.modules():
            for handle in self._hooks.pop(id(inner), []):
                handle.remove()

    def _hook_pre_call(self, units: list[Unit]) -> Callable[[nn.Module, Any], None]:
        def hook(module: nn.Module, args: Any) -> None:
            if isinstance(module, parametrize.ParametrizationList):
                _refuse_removal(module)
            root = self._root
            grad = torch.is_grad_enabled()
            if self.paused or all(ready(u, grad) for u in units):
                return
            root.settle()
            if root.in_backward:  # recomputation under activation checkpointing
                for unit in units:
                    if not ready(unit, grad):
                        root.gather_for_recompute(unit, grad)
                return
            if grad:
                root.saved.start(module)
            gathered, shown = [], []
            for unit in units:
                if unit.state is not ShardState.GATHERED or unit.is_stale:
                    gathered.append(unit)
                if not ready(unit, grad):
                    root.ensure_gathered(unit, backward=False)
                    unit.use_full(grad)
                    shown.append(unit)
            self._called_alone[id(module)] = (gathered, shown)

        return hook

    def _hook_post_call(self, units: list[Unit]) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            root = self._root
            called = self._called_alone.pop(id(module), None)
            if called is None:
                return
            gathered, shown = called
            if module is root.saved.owner:
                root.saved.stop()
            grad = torch.is_grad_enabled()
            for unit in gathered:
                if unit is not root.root and root.release_after_forward(unit, grad) and root.idle:
                    unit.reshard()
            if root.idle:  # outside forward a module's parameters are its pieces again
                for unit in shown:
                    unit.hide_views()

        return hook


_REMOVE = parametrize.remove_parametrizations.__code__


def _refuse_removal(module: nn.Module, depth: int = 12) -> None:
    """Raise where ``remove_parametrizations`` computes the weight of ``module``, a module's
    parametrization, to replace its parameters: it would then register a new parameter, which a
    sharded model refuses only once the parametrization is gone, and the weight with it."""
    if caller_frame(lambda f: f.f_code is _REMOVE, depth, skip=2) is not None:
        raise ValueError(
            "remove_parametrizations on a sharded model: it replaces the parametrized "
            "parameters by a new one, which cannot join the model's shards after wrapping. "
            "Remove it before wrapping, or on the unwrapped model after loading "
            "model.full_state_dict() into it. Nothing was changed."
        )


def ready(unit: Unit, grad: bool) -> bool:
    """Whether ``unit``'s module attributes are its current full parameters, as ``grad`` needs
    (views that track gradients serve a ``no_grad`` call as well)."""
    return (
        unit.state is ShardState.GATHERED
        and not unit.is_stale
        and all(
            g.shown and (g.views_track_grad or not (grad and g.requires_grad)) for g in unit.groups
        )
    )


def given_hint(units: list[Unit], error: BaseException) -> str | None:
    """What to say when a forward failed computing with tensors given in place of parameters
    (``torch.func.functional_call``, which swaps ``module._parameters`` for the call) shaped
    unlike them: this rank's pieces, from ``model.state_dict()`` or copies of
    ``model.parameters()``. ``None`` where no tensor given has another shape."""
    found = []
    for unit in units:
        for g in unit.groups:
            for name, p, shape, spec, slots in zip(
                g.names, g.shard_params, g.shapes, g.specs, g.slots
            ):
                for module, attr in slots:
                    given = module._parameters.get(attr)
                    if given is None or given is p or spec is not None:
                        continue
                    if tuple(given.shape) != tuple(shape):
                        found.append(f"{name} (given {tuple(given.shape)}, is {tuple(shape)})")
    if not found:
        return None
    return (
        f"shardwrap: forward failed computing with tensors given for {', '.join(found[:4])}"
        f"{' and more' if len(found) > 4 else ''} (torch.func.functional_call): the module "
        "computes with whole parameters, and model.state_dict(), model.parameters() and copies "
        "of them are this rank's pieces. Give whole values: model.full_state_dict() (every rank "
        "calls it), or the model's own parameters, dict(model.named_parameters()). "
        f"The error: {error}"
    )


def piece_hint(units: list[Unit], error: BaseException) -> str | None:
    """What to say when a forward failed on a parameter read outside its unit's forward.

    Outside its unit's forward (and any module holding it called on its own) a parameter is
    this rank's piece of it, shape ``(1, k)``: code that reads ``block.weight`` from another
    module's forward gets the piece, and torch fails on its shape. Where ``error``'s message
    shows a piece's shape, this names the parameter and the fixes; else ``None``.
    """
    message = str(error)
    found = []
    for unit in units[1:]:
        for g in unit.groups:
            for name, p in zip(g.names, g.shard_params):
                if any(pattern in message for pattern in _shape_patterns(tuple(p.shape))):
                    found.append(f"{name} (its piece here: {tuple(p.shape)})")
    if not found:
        return None
    return (
        f"shardwrap: forward failed on a shape that is this rank's piece of {', '.join(found)}. "
        "A parameter read outside its unit's forward (e.g. F.linear(h, self.block.weight) in "
        "another module's forward) is only this rank's piece of it: its unit gathers it for its "
        "own forward. Use it inside that unit's forward (call the module that holds it), or make "
        "a module enclosing both uses the unit (auto_wrap), or share the parameter by tying it "
        f"before wrapping. The error: {message}"
    )


# How torch's dtype errors name the low-precision compute dtypes, and float32 (whole words:
# "BFloat16" holds "Float", "bfloat16" "float16").
_SPELLINGS = {
    torch.bfloat16: re.compile(r"\bBFloat16\b|\bbfloat16\b"),
    torch.float16: re.compile(r"\bHalf\b|\bfloat16\b"),
    torch.float32: re.compile(r"\bFloat\b|\bfloat32\b|\(float\)"),
}


def precision_hint(precision: Any, error: BaseException) -> str | None:
    """What to say when a forward under mixed precision failed on mixing float32 with the
    compute dtype: the dtype taken from ``model.parameters()`` (the float32 pieces), where
    inside forward the unit computes with parameters gathered in the compute dtype. ``None``
    where there is no mixed precision, or ``error`` names no such pair."""
    compute = getattr(precision, "param_dtype", None)
    if compute is None or compute not in _SPELLINGS or compute == torch.float32:
        return None
    message = str(error)
    if "type" not in message or not all(
        _SPELLINGS[d].search(message) for d in (compute, torch.float32)
    ):
        return None
    name = str(compute).removeprefix("torch.")
    return (
        f"shardwrap: forward failed on mixing float32 with {name}, under "
        f"MixedPrecision(param_dtype=torch.{name}): inside forward each unit computes with its "
        f"parameters gathered in {name}, but model.parameters() (and each module's "
        "parameters()) are this rank's float32 pieces everywhere, so code taking the compute "
        "dtype from them (next(self.parameters()).dtype, a Hugging Face model's self.dtype) "
        f"gets float32. Read it from the module's own attribute inside forward "
        f"(self.linear.weight.dtype, {name} there), or cast the inputs to {name} yourself. "
        f"The error: {message}"
    )


def _shape_patterns(shape: tuple[int, ...]) -> list[str]:
    """How torch's messages write ``shape`` (a piece: ``(1, ..., k)``, ``(k,)`` or ``()``)."""
    if not shape or shape[-1] <= 1:
        return []
    if len(shape) == 1:
        return [f"[{shape[0]}]", f"({shape[0]})"]
    k, ones = shape[-1], len(shape) - 1
    listed = ", ".join(["1"] * ones + [str(k)])
    return [f"1x{k}", f"{k}x1", f"[{listed}]", f"({listed})", f"({k})"]
