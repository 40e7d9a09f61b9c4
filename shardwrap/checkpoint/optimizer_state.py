"""The optimizer's part of a checkpoint: what a rank saves of it, and checks of what is loaded.

Per-parameter state is saved by parameter name, so an optimizer over a model wrapped at another
world size or policy, with its groups listing their parameters in another order, loads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from .files import few

__all__ = ["OptimizerPlan", "check_optimizer", "names_by_id", "optimizer_problem", "plan_optimizer"]


@dataclass
class OptimizerPlan:
    """What one rank saves of the optimizer: sharded tensors, and scalars and groups for rank 0."""

    cls: str  # the optimizer's class name
    sharded: dict[str, dict[str, Tensor]]  # name -> state key -> 1-D piece
    scalars: dict[str, dict[str, Any]]  # name -> state key -> 0-d tensor or number
    groups: list[dict[str, Any]]  # hyperparameters, "params": names


def names_by_id(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def plan_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> OptimizerPlan:
    names = names_by_id(model)
    plan = OptimizerPlan(type(optimizer).__name__, {}, {}, [])
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "save_checkpoint: the optimizer holds a parameter that is not one of the "
                    f"model's (shape {tuple(p.shape)}); build it from model.parameters() after "
                    "wrapping"
                )
            name = names[id(p)]
            group_names.append(name)
            sharded, scalars = {}, {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.shape == p.shape:
                    sharded[key] = value
                elif (isinstance(value, Tensor) and value.ndim == 0) or isinstance(
                    value, (int, float, bool)
                ):
                    scalars[key] = value
                else:
                    raise ValueError(
                        f"save_checkpoint: optimizer state '{key}' of '{name}' is a "
                        f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}, "
                        "neither shaped like the parameter nor a scalar; only elementwise "
                        "optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) can be saved sharded"
                    )
            if sharded or scalars or p in optimizer.state:
                plan.sharded[name], plan.scalars[name] = sharded, scalars
        plan.groups.append({**hyper, "params": group_names})
    return plan


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
            scalar = isinstance(value, (int, float)) or (
                isinstance(value, torch.Tensor) and value.dim() == 0
            )
            if not scalar:
                return (
                    f'"{key}" of "{name}" is a {type(value).__name__}, not a number or a 0-d tensor'
                )
    return None
