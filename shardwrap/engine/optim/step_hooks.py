"""The optimizers that step a model's offloaded shards, each given its own step pre-hook.

Design note. With an offload tier, work has to happen right before an optimizer steps the
shards (``tiers.offload.before_step``: check the disk tier's files, let the host tier's copies
finish, prefer the fused kernel). torch runs step pre-hooks registered on one optimizer or on
every optimizer in the process; shardwrap registers them per optimizer, so an optimizer over
other parameters never runs shardwrap code, and nothing stays registered once the model is
freed.

A model is not told which optimizers are built over its parameters, so it looks for them at
the end of each backward (an optimizer steps after a backward) and when a checkpoint call is
handed one. Looking is cheap when nothing changed: the references held to the shard
parameters are counted (``sys.getrefcount``), and only when that count moved, or an optimizer
found before was freed, are the references followed back with ``gc.get_referrers``: shard
parameter, the list in a parameter group, the group, ``param_groups``, the optimizer (about
0.1 s on a heap of 300k objects, once or twice per optimizer). An optimizer built after the
last backward and stepped before the next one takes that step without the hook: torch's
default kernel, the files checked at the end of that backward.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

__all__ = ["OptimizerHooks"]

StepPreHook = Callable[[Optimizer, Any, Any], None]


class OptimizerHooks:
    """One model's step pre-hook on every optimizer found holding its shard parameters.

    Args:
        params: the model's shard parameters.
        hook: run before each step of such an optimizer.
    """

    def __init__(self, params: list[Tensor], hook: StepPreHook) -> None:
        self._params = params
        self._hook = hook
        self._handles: weakref.WeakKeyDictionary[Optimizer, RemovableHandle] = (
            weakref.WeakKeyDictionary()
        )
        self._refs = -1  # the references counted when last looked
        self._known = 0  # optimizers hooked then

    def find(self) -> None:
        """Hook every optimizer now holding the shard parameters that is not hooked yet."""
        refs = sum(sys.getrefcount(p) for p in self._params)
        if refs == self._refs and len(self._handles) == self._known:
            return
        for optimizer in _holding(self._params):
            self.add(optimizer)
        self._refs = refs
        self._known = len(self._handles)

    def add(self, optimizer: Optimizer) -> None:
        """Hook ``optimizer`` (once)."""
        if optimizer not in self._handles:
            self._handles[optimizer] = optimizer.register_step_pre_hook(self._hook)

    def close(self) -> None:
        """Remove every hook (the model is being freed)."""
        for handle in list(self._handles.values()):
            handle.remove()
        self._handles.clear()


def _holding(params: list[Tensor]) -> list[Optimizer]:
    """Every optimizer with a parameter group holding any of ``params``."""
    if not params:
        return []
    lists = _referrers(params, lambda r: type(r) is list)
    ids = {id(x) for x in lists}
    groups = _referrers(lists, lambda r: isinstance(r, dict) and id(r.get("params")) in ids)
    ids = {id(x) for x in groups}
    group_lists = _referrers(groups, lambda r: type(r) is list and any(id(g) in ids for g in r))
    ids = {id(x) for x in group_lists}
    found: dict[int, Optimizer] = {}
    attrs = []  # optimizers' instance dicts, where Python made one
    for r in _referrers(group_lists, lambda r: isinstance(r, Optimizer | dict)):
        if isinstance(r, Optimizer) and id(r.param_groups) in ids:
            found[id(r)] = r
        elif isinstance(r, dict) and id(r.get("param_groups")) in ids:
            attrs.append(r)
    for r in _referrers(attrs, lambda r: isinstance(r, Optimizer)):
        if any(r.__dict__ is a for a in attrs):
            found[id(r)] = r
    return list(found.values())


def _referrers(objs: list[Any], keep: Callable[[Any], bool]) -> list[Any]:
    """The objects holding any of ``objs`` that ``keep`` accepts, each once."""
    if not objs:
        return []
    out: dict[int, Any] = {}
    for r in gc.get_referrers(*objs):
        if keep(r):
            out[id(r)] = r
    return list(out.values())
