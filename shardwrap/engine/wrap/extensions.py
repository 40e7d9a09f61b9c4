"""Where integrations plug into the engine.

Design note. The engine (``ShardedModule`` and what it builds) imports no integration: the
Hugging Face habits, checkpoints, export and the Logbook sit above it and import it, never the
reverse. An integration that changes how a model is wrapped registers a callable here when it
is imported (``shardwrap/__init__.py`` imports each, so a user sees every integration without
asking for it), and the engine calls what is registered at the points below, in order of
registration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from ..shards.unit import Unit
    from ..step.root import Root

__all__ = [
    "checkpoint_unit",
    "check_move",
    "check_prepare",
    "class_habits",
    "may_train",
    "param_replaced",
    "register_class_habits",
    "register_may_train",
    "register_move_check",
    "register_param_replaced",
    "register_prepare_check",
    "register_unit_checkpointer",
]

_class_habits: list[Callable[[type], tuple[type, ...]]] = []
_unit_checkpointers: list[Callable[[Root, Unit], bool]] = []
_move_checks: list[Callable[[nn.Module], None]] = []
_prepare_checks: list[Callable[[nn.Module], None]] = []
_may_train: list[Callable[[nn.Module], set[str]]] = []
_param_replaced: list[Callable[[nn.Parameter, nn.Parameter], None]] = []


def register_class_habits(habits: Callable[[type], tuple[type, ...]]) -> None:
    """``habits(cls)``: classes a wrapped model of class ``cls`` gains, ahead of ``cls``."""
    _class_habits.append(habits)


def register_unit_checkpointer(checkpointer: Callable[[Root, Unit], bool]) -> None:
    """``checkpointer(root, unit)``: checkpoint ``unit``'s activations its own way, and say
    whether it did (else the next one, and finally shardwrap's own, is asked)."""
    _unit_checkpointers.append(checkpointer)


def register_move_check(check: Callable[[nn.Module], None]) -> None:
    """``check(model)``: called as a sharded ``model`` is moved or cast (``.to()`` and friends),
    before anything changes; it raises to refuse the move."""
    _move_checks.append(check)


def register_prepare_check(check: Callable[[nn.Module], None]) -> None:
    """``check(model)``: called as a training library reads the mark that has it hand a
    sharded ``model`` back unwrapped (accelerate's ``prepare``); it raises to refuse."""
    _prepare_checks.append(check)


def register_may_train(names: Callable[[nn.Module], set[str]]) -> None:
    """``names(model)``: the parameters (by name) frozen now that ``model`` may make trainable
    after wrapping; they are sharded with the trainable ones, gradients and all."""
    _may_train.append(names)


def register_param_replaced(carry: Callable[[nn.Parameter, nn.Parameter], None]) -> None:
    """``carry(original, shard_param)``: called as wrapping replaces each parameter by its shard
    parameter, to carry over what a library keyed on the original object."""
    _param_replaced.append(carry)


def param_replaced(original: nn.Parameter, shard_param: nn.Parameter) -> None:
    """Tell every registered integration that ``shard_param`` replaces ``original``."""
    for carry in _param_replaced:
        carry(original, shard_param)


def may_train(model: nn.Module) -> set[str]:
    """Every registered integration's names of parameters ``model`` may train later."""
    return set().union(*(names(model) for names in _may_train))


def class_habits(cls: type) -> tuple[type, ...]:
    """The classes every integration adds to a wrapped model of class ``cls``."""
    return tuple(h for habits in _class_habits for h in habits(cls))


def checkpoint_unit(root: Root, unit: Unit) -> bool:
    """Whether an integration checkpointed ``unit`` its own way."""
    return any(checkpointer(root, unit) for checkpointer in _unit_checkpointers)


def check_move(model: nn.Module) -> None:
    """Run every registered move check on ``model``."""
    for check in _move_checks:
        check(model)


def check_prepare(model: nn.Module) -> None:
    """Run every registered prepare check on ``model``."""
    for check in _prepare_checks:
        check(model)
