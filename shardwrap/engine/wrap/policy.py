"""Which submodules become units, and which unit holds each parameter.

Pure module-tree logic: no tensors are moved and nothing is communicated here.

- ``auto_wrap`` selects units: a class, a tuple (or set, frozenset, list) of classes, a callable
  ``(module) -> bool`` or an int (minimum parameter count, counted bottom-up so a selected
  child's parameters do not count again for its parent). The root is always a unit.
- The auto-wrap policies written for ``torch.distributed.fsdp.FullyShardedDataParallel`` work
  unchanged: a policy object (``ModuleWrapPolicy``, ``CustomPolicy``) selects the modules it
  returns, and a callable taking ``(module, recurse, nonwrapped_numel)``
  (``transformer_auto_wrap_policy``, ``size_based_auto_wrap_policy`` and the like, bound with
  ``functools.partial``) is asked as that wrapper asks it, descending from the root.
- A parameter belongs to the innermost unit whose subtree holds every place it is used:
  the lowest common ancestor of those places. Tied parameters (an embedding shared with the
  output head) therefore land in the unit that encloses both uses, automatically.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ...options import MixedPrecision
from ..shards.tensor_parallel import is_dtensor

__all__ = [
    "AutoWrap",
    "Placement",
    "check_selects_something",
    "place_parameters",
    "resolve_policy",
]

AutoWrap = (
    type[nn.Module]
    | tuple[type[nn.Module], ...]
    | set[type[nn.Module]]
    | frozenset[type[nn.Module]]
    | list[type[nn.Module]]
    | Callable[..., bool]
    | int
    | None
)


def resolve_policy(root: nn.Module, auto_wrap: AutoWrap) -> Callable[[nn.Module], bool]:
    """Turn ``auto_wrap`` into a predicate over submodules (the root is never asked)."""
    if auto_wrap is None:
        return lambda m: False
    if isinstance(auto_wrap, bool):
        raise TypeError(_bad_policy(auto_wrap))
    if isinstance(auto_wrap, nn.Module):
        raise TypeError(
            f"auto_wrap got a module instance ({type(auto_wrap).__name__}); pass its class: "
            f"auto_wrap={type(auto_wrap).__name__}."
        )
    if isinstance(auto_wrap, int):
        if auto_wrap < 1:
            raise ValueError(f"auto_wrap as a parameter count must be at least 1, got {auto_wrap}")
        return _size_policy(root, auto_wrap)
    if isinstance(auto_wrap, type):
        auto_wrap = (auto_wrap,)
    if isinstance(auto_wrap, (tuple, set, frozenset, list)):
        classes = tuple(auto_wrap)
        bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
        if bad:
            raise TypeError(_bad_policy(auto_wrap))
        return lambda m: isinstance(m, classes)  # none: refused naming the model's classes
    if hasattr(auto_wrap, "_run_policy"):
        return _policy_object(root, auto_wrap)
    if callable(auto_wrap):
        if _asks_recurse(auto_wrap):
            return _recursing_policy(root, auto_wrap)
        return auto_wrap
    raise TypeError(_bad_policy(auto_wrap))


def _asks_recurse(policy: Callable[..., bool]) -> bool:
    """Whether ``policy`` takes the ``recurse`` argument of the recursing protocol."""
    try:
        return "recurse" in inspect.signature(policy).parameters
    except (TypeError, ValueError):
        return False


def _policy_object(root: nn.Module, policy: object) -> Callable[[nn.Module], bool]:
    """The modules a policy object (``ModuleWrapPolicy``, ``CustomPolicy``) selects.

    Raises:
        ValueError: the policy gives a module options of its own, which units do not take.
    """
    targets = policy._run_policy(root, set(), {})  # type: ignore[attr-defined]
    for module, options in targets.items():
        if options:
            name = next(n for n, m in root.named_modules() if m is module) or "the root"
            raise ValueError(
                f"auto_wrap={policy!r} gives {name} ({type(module).__name__}) options of its "
                f"own ({', '.join(sorted(options))}); every unit takes ShardedModule's options. "
                "Make the policy return True for the modules to wrap, or pass "
                "auto_wrap=lambda m: isinstance(m, Block) for them."
            )
    selected = {id(m) for m in targets if m is not root}
    return lambda m: id(m) in selected


def _recursing_policy(root: nn.Module, policy: Callable[..., bool]) -> Callable[[nn.Module], bool]:
    """Ask a ``(module, recurse, nonwrapped_numel)`` policy over the tree, as its wrapper does.

    From the root down, a module's children are visited only where the policy says
    ``recurse=True`` for the module's whole parameter count; after them, the module (never the
    root) is selected where the policy says ``recurse=False`` for the count its selected
    descendants leave. A selected module's whole count is then taken from its parent's.
    """
    selected: set[int] = set()

    def visit(module: nn.Module) -> int:
        total = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, nonwrapped_numel=total):
            return 0
        taken = sum(visit(child) for child in module.children())
        if module is not root and policy(
            module=module, recurse=False, nonwrapped_numel=total - taken
        ):
            selected.add(id(module))
            return total
        return taken

    visit(root)
    return lambda m: id(m) in selected


def check_selects_something(
    root: nn.Module, policy: Callable[[nn.Module], bool], auto_wrap: AutoWrap
) -> None:
    """A policy that selects no submodule would make the whole model one unit: refuse it.

    Raises:
        ValueError: naming the module classes the model does contain, most frequent first.
    """
    if auto_wrap is None or any(policy(m) for m in root.modules() if m is not root):
        return
    counts: dict[str, int] = {}
    for m in root.modules():
        if m is not root and has_forward(m) and any(True for _ in m.parameters()):
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
    present = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    listed = ", ".join(f"{name} (x{n})" for name, n in present) or "no submodule with parameters"
    raise ValueError(
        f"auto_wrap={_describe(auto_wrap)} selects no submodule of {type(root).__name__}: the "
        f"whole model would be one unit, gathered whole (no memory saving). It contains {listed}. "
        "Pass the class of its repeated block, e.g. auto_wrap=TransformerBlock, or "
        "auto_wrap=None to make it one unit on purpose."
    )


def _describe(auto_wrap: AutoWrap) -> str:
    if isinstance(auto_wrap, type):
        return auto_wrap.__name__
    if isinstance(auto_wrap, (tuple, set, frozenset, list)):
        return "(" + ", ".join(getattr(c, "__name__", repr(c)) for c in auto_wrap) + ")"
    return repr(auto_wrap)


def _bad_policy(value: object) -> str:
    return (
        f"auto_wrap got {value!r} ({type(value).__name__}); it takes a module class, a tuple "
        "of module classes (or a set or list of them), a callable (module) -> bool, an "
        "auto-wrap policy of torch's FullyShardedDataParallel, an int (minimum parameter "
        "count) or None. Example: ShardedModule(model, auto_wrap=TransformerBlock)."
    )


def _size_policy(root: nn.Module, min_params: int) -> Callable[[nn.Module], bool]:
    selected: set[int] = set()
    numel = {id(p): p.numel() for p in root.parameters()}

    def visit(module: nn.Module) -> tuple[int, set[int]]:
        seen: set[int] = {id(p) for p in module.parameters(recurse=False)}
        for child in module.children():
            _, child_seen = visit(child)
            if id(child) not in selected:
                seen |= child_seen
        if module is not root and has_forward(module) and sum(numel[i] for i in seen) >= min_params:
            selected.add(id(module))
        return len(seen), seen

    visit(root)
    return lambda m: id(m) in selected


@dataclass
class Placement:
    """Units in pre-order (root first) and, for each, the parameters it holds.

    ``params[i]`` lists ``(name, parameter, slots)`` for unit ``i``: the canonical name, the
    parameter, and every ``(module, attribute)`` that holds it.
    """

    units: list[nn.Module]
    params: list[list[tuple[str, nn.Parameter, list[tuple[nn.Module, str]]]]] = field(
        default_factory=list
    )


def place_parameters(root: nn.Module, policy: Callable[[nn.Module], bool]) -> Placement:
    """Select units and give every parameter to the lowest unit that encloses all its uses."""
    units: list[nn.Module] = [root]
    unit_index = {id(root): 0}
    chains: dict[int, tuple[int, ...]] = {}  # id(param) -> unit chain of its LCA so far
    slots: dict[int, list[tuple[nn.Module, str]]] = {}
    first_seen: dict[int, tuple[str, nn.Parameter]] = {}

    def walk(module: nn.Module, prefix: str, chain: tuple[int, ...]) -> None:
        for attr, p in module._parameters.items():
            if p is None:
                continue
            key = id(p)
            places = slots.setdefault(key, [])
            if not any(m is module and a == attr for m, a in places):
                places.append((module, attr))
            if key not in first_seen:
                first_seen[key] = (prefix + attr, p)
                chains[key] = chain
            else:
                chains[key] = _common_prefix(chains[key], chain)
        for name, child in module._modules.items():
            if child is None:
                continue
            child_chain = chain
            if child is not root and policy(child) and _would_hold(child, policy):
                if not has_forward(child):
                    raise ValueError(
                        f"auto_wrap selected '{prefix}{name}' ({type(child).__name__}), a "
                        "container whose forward is never called, so its parameters could never be "
                        "gathered. Select the modules inside it instead, e.g. the block class."
                    )
                if id(child) not in unit_index:
                    unit_index[id(child)] = len(units)
                    units.append(child)
                child_chain = chain + (unit_index[id(child)],)
            walk(child, f"{prefix}{name}.", child_chain)

    walk(root, "", (0,))
    placement = Placement(units=units, params=[[] for _ in units])
    for key, (name, p) in first_seen.items():
        placement.params[chains[key][-1]].append((name, p, slots[key]))
    return placement


def _would_hold(module: nn.Module, policy: Callable[[nn.Module], bool]) -> bool:
    """Whether ``module``, selected, would hold parameters of its own: a container without a
    forward whose parameters all lie in selected modules (a policy that selects every module,
    as FSDP's ``always_wrap_policy``, selects ``nn.ModuleList`` and the blocks in it alike) or
    that holds none (a module of buffers) is not made a unit."""
    if has_forward(module):
        return True

    def holds(m: nn.Module) -> bool:
        if any(p is not None for p in m._parameters.values()):
            return True
        return any(
            c is not None and not (policy(c) and has_forward(c)) and holds(c)
            for c in m._modules.values()
        )

    return holds(module)


def has_forward(module: nn.Module) -> bool:
    """False for containers such as ``nn.ModuleList`` that are iterated, never called."""
    return type(module).forward is not nn.Module.forward


def _common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


def grad_dtype_of(p: torch.Tensor) -> torch.dtype:
    """The dtype ``p.grad`` takes: ``p.grad_dtype`` where set (torch lets a parameter keep
    gradients in another dtype than its own, e.g. float32 gradients of bfloat16 weights),
    else ``p``'s own dtype (also where ``grad_dtype`` is ``None``, "any dtype")."""
    return p.grad_dtype or p.dtype


def reduce_dtype_of(
    dtype: torch.dtype, grad_dtype: torch.dtype, precision: MixedPrecision | None
) -> torch.dtype:
    """The dtype ranks average a group's gradients in: ``MixedPrecision.reduce_dtype`` where
    given; else the parameters' gradient dtype where set apart from ``dtype`` (their own);
    else the dtype they compute in (``MixedPrecision.gradient_dtype``)."""
    if grad_dtype != dtype and (precision is None or precision.reduce_dtype is None):
        return grad_dtype
    return precision.gradient_dtype(dtype) if precision is not None else dtype


def group_key(
    p: torch.Tensor, may_train: bool = False
) -> tuple[torch.dtype, bool, bool, torch.dtype]:
    """Parameters share a flat buffer when they share dtype, ``requires_grad``, whether the
    tp ranks hold different blocks of them (a ``Shard`` DTensor) and their gradients' dtype
    (:func:`grad_dtype_of`); a frozen parameter the model may make trainable later
    (``may_train``: an inactive PEFT adapter) groups with the trainable ones.

    NOTE: blocks and parameters every tp rank holds alike go in flat buffers apart, so that
    what the tp ranks hold alike stays alike through compressed collectives (a quantization
    block's scale is its largest element's, and a block would otherwise mix both).
    """
    split = is_dtensor(p) and any(q.is_shard() for q in p.placements)
    return p.dtype, p.requires_grad or may_train, split, grad_dtype_of(p)
