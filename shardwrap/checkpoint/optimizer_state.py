"""The optimizer's part of a checkpoint: what a rank saves of it, and checks of what is loaded.

Per-parameter state is saved by parameter name, so an optimizer over a model wrapped at another
world size or policy, with its groups listing their parameters in another order, loads it.
Several optimizers over disjoint parameters (Muon for the matrices, AdamW for the rest) are
saved together: ``optimizer.pt`` then lists each one's class, groups and scalars, in order, and
the metadata says of each whether it stepped whole; per-parameter state stays keyed by name.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.optim.pieces import inner_optimizer, piece_of
from ..engine.optim.whole_params import stepped_whole
from .files import few
from .packed_state import pack

_ONE_BYTE_TABLE = 256  # a quantized state's lookup table: one entry per code of a byte

__all__ = [
    "OptimizerPlan",
    "Optimizers",
    "as_list",
    "check_count",
    "check_hyperparameters",
    "check_optimizer",
    "check_whole_state",
    "names_by_id",
    "optimizer_problem",
    "optimizer_record",
    "owned_summary",
    "owns",
    "plan_optimizers",
    "saved_optimizers",
    "whole_state_shapes",
]

# one optimizer, or several over disjoint parameters (Muon's matrices and AdamW's rest)
Optimizers = torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None


def _inner(optimizer: Any) -> Any:
    return inner_optimizer(optimizer) if isinstance(optimizer, torch.optim.Optimizer) else optimizer


def as_list(optimizer: Optimizers, caller: str) -> list[torch.optim.Optimizer]:
    """The optimizers passed: none, one, or each of a list or tuple of them; for a wrapper
    sharing its inner optimizer's groups (timm's ``Lookahead``), the inner one, which holds the
    state (:func:`~shardwrap.engine.optim.pieces.inner_optimizer`).

    Raises:
        TypeError: anything else, naming what was passed.
    """
    if optimizer is None:
        return []
    if not isinstance(optimizer, (list, tuple)) and hasattr(optimizer, "param_groups"):
        return [_inner(optimizer)]
    if (
        isinstance(optimizer, (list, tuple))
        and optimizer
        and all(isinstance(o, torch.optim.Optimizer) for o in optimizer)
    ):
        return [_inner(o) for o in optimizer]
    raise TypeError(
        f"{caller} takes an optimizer, or a list of optimizers over disjoint parameters (e.g. "
        f"[muon, adamw]), got {type(optimizer).__name__}"
    )


@dataclass
class OptimizerPlan:
    """What one rank saves of the optimizer: sharded tensors, and scalars and groups for rank 0.

    An optimizer that steps parameters whole (:func:`stepped_whole`) holds a parameter's state
    on its owner rank alone: there ``owned`` holds its tensors in their own shapes and
    ``scalars`` its scalars, and each writing owner hands both on (:func:`owned_summary`).
    """

    cls: str  # the optimizer's class name
    sharded: dict[str, dict[str, Tensor]]  # name -> state key -> 1-D piece
    scalars: dict[str, dict[str, Any]]  # name -> state key -> 0-d tensor or number
    groups: list[dict[str, Any]]  # hyperparameters, "params": names
    whole: bool = False  # stepped whole: ``owned`` and ``scalars`` are this rank's parameters'
    owned: dict[str, dict[str, Tensor]] = field(default_factory=dict)  # name -> key -> any shape
    packed: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> key -> its record


def names_by_id(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _is_scalar(value: Any) -> bool:
    """Whether ``value`` is kept as it is, alike on every rank: a 0-d tensor, a number, a
    flag, or ``None`` (state an optimizer keeps empty until it needs it)."""
    return (isinstance(value, Tensor) and value.ndim == 0) or isinstance(
        value, (int, float, bool, type(None))
    )


def plan_optimizer(
    model: nn.Module, optimizer: torch.optim.Optimizer, call: str = "save_checkpoint"
) -> OptimizerPlan:
    """What this rank saves of ``optimizer``'s state, by parameter name (for ``call``, which
    the errors name).

    Raises:
        ValueError: a parameter that is not the model's; state of an optimizer stepping pieces
            that is neither shaped like its piece nor a scalar; a refused optimizer (LBFGS).
    """
    names = names_by_id(model)
    whole = stepped_whole(optimizer) is not None
    plan = OptimizerPlan(type(optimizer).__name__, {}, {}, [], whole)
    for j, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        for key, value in hyper.items():
            if key not in optimizer.defaults and not _fits(value, _ANY):
                raise ValueError(
                    f"{call}: parameter group {j} holds '{key}' = {value!r} (a "
                    f"{type(value).__name__}), an entry of the group's own: a checkpoint keeps "
                    "those as plain values (numbers, bools, strings, None, 0-d tensors, and "
                    "lists, tuples and string-keyed dicts of them), which load back. Nothing "
                    "was written; keep such objects outside the optimizer"
                )
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    f"{call}: the optimizer holds a parameter that is not one of the "
                    f"model's (shape {tuple(p.shape)}); build it from model.parameters() after "
                    "wrapping"
                )
            name = names[id(p)]
            group_names.append(name)
            tensors, scalars, packed = {}, {}, {}
            for key, value in optimizer.state.get(p, {}).items():
                if _is_scalar(value):
                    scalars[key] = value
                elif isinstance(value, Tensor) and whole:  # a subclass as its plain parts
                    _check_declared_state(optimizer, p, name, key, value, call)
                    parts, packed[key] = pack(key, value)
                    tensors.update(parts)
                elif isinstance(value, Tensor) and value.shape == p.shape:
                    tensors[key] = value
                else:
                    shape = f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else ""
                    raise ValueError(
                        f"{call}: optimizer state '{key}' of '{name}' is a "
                        f"{type(value).__name__}{shape}, "
                        "neither shaped like the parameter nor a scalar; only elementwise "
                        "optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) and those that "
                        "step parameters whole (Muon, Adafactor, or declared with "
                        "shardwrap.declare_optimizer(cls, reads_shapes=True)) can be saved"
                    )
            if p in optimizer.state:  # stepped whole: on the parameter's owner alone
                plan.scalars[name] = scalars
                (plan.owned if whole else plan.sharded)[name] = tensors
                packed = {k: r for k, r in packed.items() if r is not None}
                if packed:
                    plan.packed[name] = packed
        plan.groups.append({**hyper, "params": group_names})
    return plan


def _check_declared_state(
    optimizer: torch.optim.Optimizer, p: Tensor, name: str, key: str, value: Tensor, call: str
) -> None:
    """Refuse, before anything is written, a declared optimizer's state tensor that
    :func:`check_whole_state` would refuse to load."""
    held = piece_of(p)
    shape = tuple(held[0]) if held is not None else tuple(p.shape)
    if whole_state_shapes(optimizer, shape) is None and not declared_state_fits(
        tuple(value.shape), shape
    ):
        raise ValueError(
            f"{call}: {type(optimizer).__name__} keeps state '{key}' of '{name}' with shape "
            f"{tuple(value.shape)}, for a parameter of shape {shape}: a checkpoint holds a "
            f"declared optimizer's state tensors {DECLARED_BOUND} (what a load checks before "
            "it takes memory for them), so this one would not load back. Nothing was written; "
            "save with shardwrap.full_optimizer_state_dict(model, optimizer) instead"
        )


def plan_optimizers(
    model: nn.Module, optimizers: list[torch.optim.Optimizer]
) -> list[OptimizerPlan]:
    """Each optimizer's :func:`plan_optimizer`.

    Raises:
        ValueError: as :func:`plan_optimizer`; or a parameter in two of the optimizers.
    """
    plans = [plan_optimizer(model, o) for o in optimizers]
    first: dict[str, int] = {}
    for i, plan in enumerate(plans):
        for name in (n for g in plan.groups for n in g["params"]):
            if first.setdefault(name, i) != i:
                raise ValueError(
                    f"save_checkpoint: parameter '{name}' is in optimizers {first[name]} "
                    f"({plans[first[name]].cls}) and {i} ({plan.cls}); a checkpoint keeps one "
                    "optimizer's state per parameter: give each parameter to one optimizer"
                )
    return plans


def owned_summary(plans: list[OptimizerPlan], file: str) -> list[dict[str, Any]]:
    """What a writing owner tells rank 0 of the whole-stepped state it writes into ``file``, per
    optimizer: its scalars, and each tensor's file and shape (merged into the metadata)."""
    return [
        {
            "scalars": plan.scalars,
            "packed_state": plan.packed,
            "whole_state": {
                name: {key: {"file": file, "shape": list(v.shape)} for key, v in state.items()}
                for name, state in plan.owned.items()
            },
        }
        for plan in plans
    ]


def optimizer_record(
    plans: list[OptimizerPlan], listed: bool, summaries: list[list[dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """What rank 0 writes of the optimizers: ``optimizer.pt``'s contents and the metadata's
    ``optimizer`` entry, from its own plans and every writing owner's :func:`owned_summary`.

    One optimizer passed alone is written as before optimizers could be listed.
    """
    saved, stepped = [], []
    meta: dict[str, Any] = {"state_keys": {}, "whole_state": {}, "packed_state": {}}
    for i, plan in enumerate(plans):
        scalars = plan.scalars
        if plan.whole:  # held by the owners alone
            scalars = {}
            for summary in summaries:
                scalars.update(summary[i]["scalars"])
                meta["whole_state"].update(summary[i]["whole_state"])
                meta["packed_state"].update(summary[i]["packed_state"])
        saved.append({"class": plan.cls, "param_groups": plan.groups, "state": scalars})
        meta["state_keys"].update({n: sorted(s) for n, s in plan.sharded.items()})
        stepped.append(plan.whole)
    if not listed:
        return saved[0], {**meta, "stepped_whole": stepped[0]}
    return {"optimizers": saved}, {**meta, "stepped_whole": stepped}


def saved_optimizers(saved: Any, meta: dict[str, Any]) -> tuple[list[Any], list[bool]] | str:
    """Each saved optimizer's ``optimizer.pt`` entry and whether it stepped whole, or what is
    wrong with them."""
    stepped = meta.get("stepped_whole", False)
    if not isinstance(stepped, list):
        return [saved], [stepped]
    entries = saved.get("optimizers") if isinstance(saved, dict) else None
    if not isinstance(entries, list) or len(entries) != len(stepped):
        return f'"optimizers" must list the {len(stepped)} optimizers the metadata names'
    return entries, stepped


def check_count(optimizers: list[torch.optim.Optimizer], saved: list[dict[str, Any]]) -> None:
    """Raise unless as many optimizers are loaded as were saved, naming both."""
    if len(saved) != len(optimizers):
        theirs = ", ".join(s["class"] for s in saved)
        mine = ", ".join(type(o).__name__ for o in optimizers)
        raise ValueError(
            f"load_checkpoint: optimizer mismatch: the checkpoint holds {len(saved)} "
            f"optimizer(s) ({theirs}), got {len(optimizers)} ({mine}); pass them all, in the "
            "order they were saved"
        )


def owns(stepping: Any, param: nn.Parameter) -> bool:
    """Whether this rank steps ``param`` whole, and so holds its optimizer state."""
    return stepping.owns(param)


def check_optimizer(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], names: dict[int, str]
) -> None:
    """Raise unless ``optimizer`` is of the saved class, over the model's parameters, in the
    saved parameter groups (by name; the order within a group is free)."""
    cls = type(optimizer).__name__
    if saved["class"] != cls:
        raise ValueError(
            f"load_checkpoint: optimizer mismatch: the checkpoint holds {saved['class']} "
            f"state, got {cls}"
        )
    if any(id(p) not in names for g in optimizer.param_groups for p in g["params"]):
        raise ValueError(
            "load_checkpoint: the optimizer holds a parameter that is not one of the model's"
        )
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    groups = saved["param_groups"]
    if len(groups) != len(current):
        raise ValueError(
            f"load_checkpoint: optimizer mismatch: the checkpoint has {len(groups)} parameter "
            f"groups, the optimizer {len(current)}"
        )
    for j, (mine, theirs) in enumerate(zip(current, groups)):
        if set(mine) != set(theirs["params"]):
            raise ValueError(
                f"load_checkpoint: optimizer mismatch in parameter group {j}: only in the "
                f"checkpoint {few(sorted(set(theirs['params']) - set(mine)))}, only in the "
                f"optimizer {few(sorted(set(mine) - set(theirs['params'])))}"
            )


def check_hyperparameters(
    optimizer: torch.optim.Optimizer, saved: dict[str, Any], where: str
) -> None:
    """Raise unless every hyperparameter ``optimizer.pt`` (``where``) gives a parameter group
    is of the kind the optimizer holds there: a number for a number (``lr`` may be a 0-d
    tensor), a bool for a bool, a string for a string, as many for a tuple; one the optimizer
    does not hold (a scheduler's ``initial_lr``, the user's own), a plain value, a 0-d tensor,
    or lists, tuples and string-keyed dicts of them (what a save writes, see
    :func:`plan_optimizer`). Checked before anything changes: ``load_state_dict`` takes
    any value, and a string ``lr`` failed only in the next step."""
    cls = type(optimizer).__name__
    for j, (live, group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        for key, value in group.items():
            if key in ("params", "param_names"):
                continue
            expected = live.get(key, _ANY)
            if not _fits(value, expected):
                holds = f"holds {expected!r}" if expected is not _ANY else "has no such option"
                raise ValueError(
                    f"load_checkpoint: {where} sets '{key}' of parameter group {j} to {value!r} "
                    f"(a {type(value).__name__}), where {cls} {holds}: the file was altered or "
                    "written by other code. Load an earlier checkpoint, or fix the value"
                )


_ANY = object()  # a hyperparameter the optimizer does not hold: any plain value


def _fits(value: Any, expected: Any) -> bool:
    """Whether a saved hyperparameter ``value`` may stand where the optimizer holds
    ``expected``."""
    number = (int, float)
    if expected is _ANY or expected is None:  # a choice left open (foreach=None, say)
        plain = (bool, *number, str, type(None))
        if isinstance(value, torch.Tensor):  # a tensor lr's initial_lr, a scale
            return value.dim() == 0 and not value.is_complex()
        if isinstance(value, dict):
            return all(isinstance(k, str) and _fits(v, _ANY) for k, v in value.items())
        return isinstance(value, plain) or (
            isinstance(value, (tuple, list)) and all(_fits(v, _ANY) for v in value)
        )
    if isinstance(expected, bool):
        return isinstance(value, bool)
    if isinstance(expected, (*number, torch.Tensor)) and not isinstance(expected, bool):
        if isinstance(value, torch.Tensor):
            return value.dim() == 0 and not value.is_complex()
        return isinstance(value, number) and not isinstance(value, bool)
    if isinstance(expected, (tuple, list)):
        return (
            isinstance(value, (tuple, list))
            and len(value) == len(expected)
            and all(_fits(v, e) for v, e in zip(value, expected))
        )
    return type(value) is type(expected)


def optimizer_problem(saved: object) -> str | None:
    """What is wrong with the structure of a saved ``optimizer.pt``, or ``None``.

    Scalar state (``step``) must be what ``save_checkpoint`` writes: a number or a 0-d tensor,
    so that nothing the optimizer would refuse is found only after the model is overwritten.
    """
    if not isinstance(saved, dict) or not isinstance(saved.get("class"), str):
        return 'it must be a dict with the optimizer\'s "class" name'
    groups = saved.get("param_groups")
    if not isinstance(groups, list) or any(
        not isinstance(g, dict)
        or not isinstance(g.get("params"), list)
        or not all(isinstance(n, str) for n in g["params"])
        for g in groups
    ):
        return '"param_groups" must be a list of groups, each listing its parameters by name'
    state = saved.get("state")
    if not isinstance(state, dict):
        return '"state" must map parameter names to their scalar state'
    for name, entry in state.items():
        if not isinstance(entry, dict):
            return f'the scalar state of "{name}" must be a dict'
        for key, value in entry.items():
            if not _is_scalar(value):
                return (
                    f'"{key}" of "{name}" is a {type(value).__name__}, not a number, a 0-d '
                    "tensor or None"
                )
    return None


def _steps_like(optimizer: torch.optim.Optimizer, name: str) -> bool:
    """Whether ``optimizer`` steps as torch's optimizer class ``name`` does (that class or a
    subclass keeping its ``step``), so that its state is made by that class's rule."""
    cls = getattr(torch.optim, name, None)
    return cls is not None and (inspect.unwrap(type(optimizer).step) is inspect.unwrap(cls.step))


_DECLARED_COPIES = 8  # a declared optimizer's state tensor: up to this many parameters' elements
# What a state tensor of a declared shape-aware optimizer may be, for a parameter of any shape.
DECLARED_BOUND = (
    "of at most as many dimensions as the parameter (or 2), none larger than its largest, or "
    f"of at most {_DECLARED_COPIES} times its elements, or of at most {_ONE_BYTE_TABLE} elements"
)


def declared_state_fits(got: Sequence[int], shape: Sequence[int]) -> bool:
    """Whether a state tensor of shape ``got`` is one a declared shape-aware optimizer may keep
    for a parameter of ``shape``: a preconditioner over its dimensions (no more dimensions than
    the parameter, at least 2, as a vector's is a matrix, none larger than its largest), a few
    moments or gradients kept flat or stacked (up to 8 times its elements), or a lookup table of
    one byte's codes. The bound a load checks before it takes any memory for the state."""
    size = math.prod(got)
    if size <= max(_ONE_BYTE_TABLE, _DECLARED_COPIES * math.prod(shape)):
        return True
    largest = max(shape, default=1)
    return len(got) <= max(len(shape), 2) and all(d <= largest for d in got)


def whole_state_shapes(
    optimizer: torch.optim.Optimizer, shape: tuple[int, ...]
) -> dict[str, tuple[int, ...]] | None:
    """The state tensors ``optimizer`` makes for a parameter of ``shape`` stepped whole, by key
    and shape, as torch's Muon and Adafactor make them; ``None`` for a class declared
    ``reads_shapes=True``, whose rule is its own."""
    if _steps_like(optimizer, "Muon"):
        return {"momentum_buffer": shape}
    if _steps_like(optimizer, "Adafactor"):
        if len(shape) > 1:  # factored: a row and a column of the second moment
            return {"row_var": (*shape[:-1], 1), "col_var": (*shape[:-2], 1, shape[-1])}
        return {"variance": shape}
    return None


def check_whole_state(
    optimizer: torch.optim.Optimizer,
    name: str,
    shape: tuple[int, ...],
    saved: dict[str, tuple[int, ...]],
    where: str,
    packed: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Raise unless the state a checkpoint holds for parameter ``name`` (of ``shape``) stepped
    whole, ``saved`` (key to shape, as the metadata ``where`` says), is what ``optimizer``
    makes: read before any memory is taken for it, so a crafted or mismatched file cannot make
    a load allocate what the model never would.

    1. Muon, Adafactor: each key one of theirs, at the shape they make it.
    2. A class declared ``reads_shapes=True``: :func:`declared_state_fits` (which its save
       checks too, so that what it writes loads).
    3. State saved as its parts (``packed``, see :mod:`.packed_state`): the tensor each record
       rebuilds is held to rule 2, and each part to as many elements as the parameter has, or
       256 (a lookup table of one byte's codes), whichever is more.
    """
    cls = type(optimizer).__name__
    expected = whole_state_shapes(optimizer, shape)
    records = (packed or {}).items()
    parts = {f"{key}.{n}": key for key, record in records for n in record.get("parts", ())}
    rebuilt = {key: tuple(record.get("shape", ())) for key, record in records}
    bound = max(math.prod(shape), _ONE_BYTE_TABLE)
    for key, got in [*saved.items(), *rebuilt.items()]:
        if key in parts:
            if math.prod(got) > bound:
                raise ValueError(
                    f"load_checkpoint: {where} holds {cls} state '{key}' of '{name}' with shape "
                    f"{got}, more than the {bound} elements a part of a parameter of shape "
                    f"{shape}'s state can have. The file was altered or written for another "
                    "model: load a checkpoint saved for this one"
                )
            continue
        if expected is not None:
            want = expected.get(key)
            if want == got:
                continue
            what = (
                f"of shape {want}"
                if want is not None
                else f"no state '{key}' ({few(sorted(expected))} only)"
            )
            raise ValueError(
                f"load_checkpoint: {where} holds {cls} state '{key}' of '{name}' with shape "
                f"{got}, but {cls} keeps for a parameter of shape {shape} {what}. The file was "
                "altered or written for another model: load a checkpoint saved for this one"
            )
        if not declared_state_fits(got, shape):
            raise ValueError(
                f"load_checkpoint: {where} holds {cls} state '{key}' of '{name}' with shape "
                f"{got}, larger than any state of a parameter of shape {shape} (a declared "
                f"optimizer's state tensors are {DECLARED_BOUND}). The file was altered or "
                "written for another model: load a checkpoint saved for this one"
            )
