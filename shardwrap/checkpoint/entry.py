"""What every checkpoint call does first: find the wrapped model's root, idle, in step with
its peers, and with no save of its ranks still writing."""

from __future__ import annotations

from torch import nn

from ..engine.step.root import Phase, Root
from .background import await_writes

__all__ = ["sharded_model", "wrapped_root", "writers_of"]


def wrapped_root(model: nn.Module, caller: str) -> tuple[nn.Module, Root]:
    """The sharded model (``model``, or the model ``torch.compile(model)`` compiled) and its
    root, once it is idle and every save of its ranks still writing in the background has
    ended; ``caller`` is entered on every rank alike."""
    model = sharded_model(model)
    root = vars(model).get("_shardwrap_root")
    if not isinstance(root, Root):
        raise TypeError(
            f"{caller} takes a model wrapped with ShardedModule, got {type(model).__name__}"
        )
    root.settle()
    if root.phase is not Phase.IDLE:
        raise RuntimeError(f"{caller} cannot run during forward or backward")
    root.check_state()
    await_writes(writers_of(root))
    root.schedule.enter(caller)
    return model, root


def sharded_model(model: nn.Module) -> nn.Module:
    """``model``, or for ``torch.compile(model)`` the model it compiled: its own names (the
    compiled module's carry an ``_orig_mod.`` prefix) are the ones checkpoints hold."""
    inner = model._modules.get("_orig_mod") if isinstance(model, nn.Module) else None
    return inner if inner is not None and "_shardwrap_root" in vars(inner) else model


def writers_of(root: Root) -> object:
    """What a save in flight is keyed by: one per control group (the writers share its writer
    group), else per model."""
    return root.mesh.control if root.mesh.control is not None else root
