"""``copy.deepcopy(model)`` of a sharded model: a sharded copy, as ``AveragedModel`` makes one.

Design note. An EMA or SWA copy (``torch.optim.swa_utils.AveragedModel(model)``, timm's
``ModelEmaV3``), a teacher (self-distillation) and a frozen reference model (DPO) are made with
``copy.deepcopy(model)``. A sharded model's parameters are this rank's pieces and its modules
hold shardwrap's hooks and state, so a copy of them would be neither a model nor trainable. So
the copy is wrapped anew:

1. the model's tree is deep-copied as the plain model it was wrapped from: its own class, each
   parameter a meta-device tensor of the whole parameter's shape (ties kept), buffers and the
   user's attributes and hooks copied as ``deepcopy`` copies them, and everything shardwrap
   added left out (its hooks, found by where their functions are defined, and the instance
   attributes it set, found as those the module did not have when it was wrapped);
2. that copy is wrapped with the same arguments, over the same process group, every parameter
   zero-filled as it is materialised one unit at a time;
3. each of its pieces, the same ranges of the same parameters, takes the original's values,
   and each buffer the original's.

The default generator is left as it was (materialising draws a seed from it), so random draws
after the copy (dropout) are those after a plain model's copy.

So the copy costs what the model's pieces cost, not the whole model, and needs no collective
beyond its wrapping. Every rank copies: the copy begins with the handshake of the calls every
rank makes together, so a copy on some ranks only raises on every rank. Refused, naming the
fix, with tensor parallelism and with the disk tier (whose files are the model's own).
"""

from __future__ import annotations

import copy
import functools
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

__all__ = ["CopyRecipe", "sharded_copy"]

# the attributes of ``nn.Module`` holding hooks, which may hold shardwrap's
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_hooks",
    "_backward_pre_hooks",
    "_backward_hooks",
    "_state_dict_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


class CopyRecipe(NamedTuple):
    """How a model was wrapped, to wrap a copy of it alike."""

    arguments: dict[str, Any]  # ShardedModule's, but for param_init_fn and sync_module_states
    plain_keys: dict[int, frozenset[str]]  # each module's instance attributes before wrapping


def plain_keys(module: nn.Module) -> dict[int, frozenset[str]]:
    """Each module's instance attributes, before wrapping adds shardwrap's."""
    return {id(m): frozenset(m.__dict__) for m in module.modules()}


class _Dropped:
    """What shardwrap's objects become in the copied tree, then removed from it."""


def sharded_copy(model: Any, root: Any, memo: dict[int, Any], wrap: Any) -> Any:
    """A sharded deep copy of ``model`` (see the note); ``wrap`` is ``ShardedModule``."""
    recipe: CopyRecipe = root.copy_recipe
    _refuse(root, recipe)
    root.schedule.enter("copy.deepcopy")
    plain = _plain_tree(model, root, recipe, memo)
    rng = torch.get_rng_state()  # materialising draws a seed: a copy leaves the stream alone
    try:
        copied = wrap(plain, **recipe.arguments, param_init_fn=_zeros)
    finally:
        torch.set_rng_state(rng)
    with torch.no_grad():
        for mine, theirs in zip(copied.parameters(), model.parameters(), strict=True):
            mine.copy_(theirs)
        for mine, theirs in zip(copied.buffers(), model.buffers(), strict=True):
            mine.copy_(theirs)
    return copied


def _refuse(root: Any, recipe: CopyRecipe) -> None:
    offload = recipe.arguments.get("offload")
    why = None
    if root.mesh.tp is not None:
        why = "with tensor parallelism (each rank holds one block of each split parameter)"
    elif offload is not None and offload.device == "disk":
        why = "on the disk tier (the copy's shards would need files of their own)"
    if why is not None:
        raise TypeError(
            f"copy.deepcopy(model) of a ShardedModule {why} is not supported. Copy the model "
            "before wrapping it (and wrap the copy too), or keep an EMA per piece: "
            "[p.detach().clone() for p in model.parameters()], updated elementwise after each "
            "step, and swapped in with p.copy_() under torch.no_grad()."
        )


def _zeros(module: nn.Module) -> None:
    """The copy's ``param_init_fn``: each parameter zero-filled, then overwritten with the
    original's pieces."""
    with torch.no_grad():
        for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
            t.zero_()


def _plain_tree(model: Any, root: Any, recipe: CopyRecipe, memo: dict[int, Any]) -> nn.Module:
    """``model``'s tree deep-copied as the plain model it was wrapped from, on meta."""
    dropped = _Dropped()
    for param in root.params:
        shard = param.shard
        whole = nn.Parameter(
            torch.empty(param.shape, dtype=shard.dtype, device="meta"),
            requires_grad=shard.requires_grad,
        )
        for key, value in vars(shard).items():
            if not key.startswith("_shardwrap"):  # the user's tags (p._no_weight_decay)
                setattr(whole, key, copy.deepcopy(value, memo))
        memo[id(shard)] = whole
    for unit in root.units:
        memo[id(unit)] = dropped
    memo[id(root)] = dropped
    for m in model.modules():
        for name in _HOOK_DICTS:
            for hook in getattr(m, name, {}).values():
                if _is_shardwraps(hook):
                    memo[id(hook)] = dropped
        before = recipe.plain_keys.get(id(m), frozenset())
        for key, value in vars(m).items():
            if key not in before and (callable(value) or isinstance(value, Tensor)):
                memo[id(value)] = dropped
    cls = type(model).__bases__[-1]  # the class the model had before wrapping
    plain = object.__new__(cls)
    memo[id(model)] = plain
    plain.__dict__.update(copy.deepcopy(vars(model), memo))
    for m in plain.modules():
        for key, value in list(vars(m).items()):
            if value is dropped:
                del m.__dict__[key]
            elif isinstance(value, dict):
                for k in [k for k, v in value.items() if v is dropped]:
                    del value[k]
    return plain


def _is_shardwraps(hook: Any) -> bool:
    """Whether a hook's function is defined in shardwrap (through partials, bound methods and
    torch's wrapper of load-state-dict hooks)."""
    fn = getattr(hook, "hook", hook)
    while isinstance(fn, functools.partial):
        fn = fn.func
    fn = getattr(fn, "__func__", fn)
    return (getattr(fn, "__module__", None) or "").split(".")[0] == "shardwrap"
