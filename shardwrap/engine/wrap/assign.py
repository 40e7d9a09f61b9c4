"""Parameters and modules assigned to a wrapped model after wrapping.

Design note. A plain model takes ``model.head.weight = nn.Parameter(w)`` at any time (a re-init,
a weight loaded by hand). On a sharded model the registered parameter is this rank's piece of a
flat shard, and a forward computes with the gathered buffer, never with the registered object:
a parameter swapped in would be ignored by forward while ``state_dict()`` showed it. So torch's
process-wide registration hooks (registered while any sharded model lives) see every parameter
and module assigned to a module of a wrapped model:

1. a parameter of the shape and dtype it replaces: its value is copied into this rank's piece of
   the shard, and the shard parameter stays registered (so an optimizer holding it steps the new
   value); its ``requires_grad`` is taken (a frozen parameter unfrozen this way trains from the
   next forward on). The value's fingerprint is folded into the hash every handshake checks, so
   ranks that assigned different values, or only some ranks, raise at their next forward;
2. refused, before anything changes, where the shard cannot follow: another shape or dtype (a
   resize), a tie or untie between parameters, a new parameter name, or a module swapped in or
   out that holds parameters. Each must happen before wrapping. A wrapper put around a module
   (torch's ``apply_activation_checkpointing`` after wrapping, as FSDP scripts order it) is
   named as such, with ``checkpoint_activations`` as the fix. A module taken because it held
   no parameter (an activation, an empty container) is watched like the others from then on,
   so a container filled later is refused too; and ``torch.nn.utils.weight_norm`` or
   ``spectral_norm``, which delete the weight before registering its replacements, find it
   put back when they are refused.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections.abc import Callable

from torch import nn
from torch.utils.hooks import RemovableHandle

from ..shards.flat_group import FlatGroup
from ..shards.tensor_parallel import is_dtensor
from ..shards.unit import Unit
from ..step.edits import fingerprint
from .checks import SHARD_ATTR

__all__ = ["Assignments", "install", "release"]

_registry: weakref.WeakKeyDictionary[nn.Module, Assignments] = weakref.WeakKeyDictionary()
_lock = threading.Lock()
_models = 0
_handles: list[RemovableHandle] = []


class Assignments:
    """What one wrapped model does with parameters and modules assigned to it after wrapping.

    It holds the model's groups and its root only weakly: the registry, which holds it, must not
    keep a dropped model alive.

    Args:
        model: the wrapped model; each of its modules is registered with the hooks.
        units: its units, whose flat groups hold every parameter it had.
        on_change: a bound method called with a value's fingerprint when one is taken
            (``Root.note_change``).
    """

    def __init__(self, model: nn.Module, units: list[Unit], on_change: Callable[[int], None]):
        self._slots: dict[tuple[int, str], tuple[weakref.ref[FlatGroup], int]] = {
            (id(module), attr): (weakref.ref(g), i)
            for u in units
            for g in u.groups
            for i, slots in enumerate(g.slots)
            for module, attr in slots
        }
        self._names = {id(m): name for name, m in model.named_modules()}
        self._on_change = weakref.WeakMethod(on_change)  # type: ignore[arg-type]
        for module in model.modules():
            _registry[module] = self

    def parameter(self, module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        """``module.<name> = param`` (see the note above): the parameter to register instead,
        or ``None`` to register ``param`` itself.

        Raises:
            ValueError: an assignment the shards cannot follow, naming it and the fix.
        """
        where = f"{self._names.get(id(module), type(module).__name__)}.{name}".lstrip(".")
        slot = self._slots.get((id(module), name))
        if slot is None:
            replaced = self._put_back_replaced(module, name)
            if replaced is not None:
                raise ValueError(
                    f"{where}: torch.nn.utils.weight_norm or spectral_norm on a sharded model "
                    f"replaces {where.removesuffix(name)}{replaced} by new parameters, which "
                    "cannot join the flat shards after wrapping. Apply it before wrapping (it "
                    "trains as on the plain model then). Nothing was changed."
                )
            raise ValueError(
                f"{where} = nn.Parameter(...) adds a parameter to a sharded model: it would live "
                "whole on each rank, outside the shards, and train there alone. Add it to the "
                "model before wrapping it."
            )
        ref, i = slot
        group, on_change = ref(), self._on_change()
        if group is None or on_change is None:  # the model is being freed
            return None
        current = group.shard_params[i]
        if param is current:
            return None
        if getattr(param, SHARD_ATTR, False):
            raise ValueError(
                f"{where}: assigning another sharded parameter ties the two after wrapping, "
                "which the flat shards cannot follow. Tie parameters before wrapping (shardwrap "
                "places a tied parameter in the unit enclosing all its uses)."
            )
        if len(group.slots[i]) > 1:
            raise ValueError(
                f"{where}: assigning a new parameter unties it from "
                f"{len(group.slots[i]) - 1} other use(s) sharing one flat shard. Untie before "
                "wrapping, or write the new value into the shared parameter inside "
                "model.gathered(writeback=True)."
            )
        if is_dtensor(param):
            raise ValueError(
                f"{where}: the new parameter is a DTensor (tensor parallelism applied after "
                "wrapping, parallelize_module(model, ...) on the sharded model): wrapping "
                "already cut every parameter into this rank's flat shard, which a later split "
                "cannot follow. Apply tensor parallelism first, then wrap over the mesh: "
                "parallelize_module(model, mesh['tp'], plan), then ShardedModule(model, "
                "process_group=mesh)."
            )
        shape, dtype = tuple(group.shapes[i]), group.dtype
        if tuple(param.shape) != shape or param.dtype != dtype:
            raise ValueError(
                f"{where}: the new parameter is {tuple(param.shape)} {param.dtype}, and the "
                f"sharded one is {shape} {dtype}: a resize or a cast changes the flat layout "
                "every rank shares. Resize or cast the model before wrapping it (e.g. "
                "resize_token_embeddings, then ShardedModule)."
            )
        group.assign(i, param.detach())
        current.requires_grad_(param.requires_grad)
        on_change(fingerprint(param.detach())[1])
        return current

    def _put_back_replaced(self, module: nn.Module, name: str) -> str | None:
        """Where ``name`` is what ``torch.nn.utils.weight_norm`` (``<w>_g``) or
        ``spectral_norm`` (``<w>_orig``) registers after deleting the shard parameter ``<w>``
        from ``module``: put ``<w>`` back, so that the refusal changes nothing, and return it."""
        for suffix in ("_g", "_orig"):
            base = name.removesuffix(suffix)
            slot = self._slots.get((id(module), base))
            if base == name or slot is None or base in module._parameters:
                continue
            group = slot[0]()
            if group is not None:
                module._parameters[base] = group.shard_params[slot[1]]
                return base
        return None

    def module(self, parent: nn.Module, name: str, new: nn.Module) -> None:
        """``parent.<name> = new``: allowed where neither the module replaced nor ``new`` holds
        parameters (an activation swapped, an empty ``nn.ParameterDict``). ``new`` and its
        modules are then the model's like the others: a parameter later added to them (a
        container filled) is refused as on any module of the model.

        Raises:
            TypeError: a module that holds parameters swapped in or out, naming the fix.
        """
        old = parent._modules.get(name)
        if old is new:
            return
        held = old is not None and any(
            (id(m), attr) in self._slots for m in old.modules() for attr in m._parameters
        )
        where = f"{self._names.get(id(parent), type(parent).__name__)}.{name}".lstrip(".")
        if held or any(True for _ in new.parameters()):
            if old is not None and _encloses(new, old):
                raise TypeError(_wrapped_after(where, old, new))
            raise TypeError(
                f"{where} = {type(new).__name__}(...) swaps a module holding parameters in or out "
                "of a sharded model, whose flat shards cannot follow: the new parameters would "
                "train on each rank alone. Build the model as it will train, then shard it "
                "(adapters first: ShardedModule(get_peft_model(model, config), auto_wrap=...)); "
                "to change weights after wrapping, assign parameters of the same shape, or edit "
                "them inside model.gathered(writeback=True)."
            )
        for inner_name, inner in new.named_modules(prefix=where):
            _registry[inner] = self
            self._names[id(inner)] = inner_name


def _encloses(new: nn.Module, old: nn.Module) -> bool:
    """Whether ``new`` is a wrapper around ``old``: it holds ``old`` and no other parameter."""
    return any(m is old for m in new.modules()) and {id(p) for p in new.parameters()} == {
        id(p) for p in old.parameters()
    }


def _wrapped_after(where: str, old: nn.Module, new: nn.Module) -> str:
    """The refusal of a wrapper put around a module of a sharded model, naming the fix."""
    message = (
        f"{where} = {type(new).__name__}({where}) puts a wrapper around a module of a sharded "
        "model: the flat shards hold its parameters by their names, which the wrapper would "
        "change. Put the wrapper on before ShardedModule"
    )
    wrappers = sys.modules.get("torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
    if wrappers is not None and isinstance(new, wrappers.ActivationWrapper):
        return (
            f"{message} (apply_activation_checkpointing(model, ...), then ShardedModule), or let "
            "shardwrap recompute the activations inside its sharding hooks, reusing the "
            f"backward gather: ShardedModule(model, auto_wrap=..., checkpoint_activations="
            f"{type(old).__name__})."
        )
    return message + "."


def install() -> None:
    """Register the registration hooks while a sharded model lives (a model calls this when
    built and :func:`release` when freed)."""
    global _models
    with _lock:
        if _models == 0:
            modules = nn.modules.module
            _handles.append(modules.register_module_parameter_registration_hook(_on_parameter))
            _handles.append(modules.register_module_module_registration_hook(_on_module))
        _models += 1


def release() -> None:
    """A sharded model was freed; with the last one, the hooks are removed."""
    global _models
    with _lock:
        _models -= 1
        if _models == 0:
            for handle in _handles:
                handle.remove()
            _handles.clear()


def _on_parameter(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
    owner = _registry.get(module)
    return None if owner is None else owner.parameter(module, name, param)


def _on_module(parent: nn.Module, name: str, new: nn.Module) -> None:
    owner = _registry.get(parent)
    if owner is not None:
        owner.module(parent, name, new)
