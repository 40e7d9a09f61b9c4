"""A step over gradients a backward under ``no_sync`` left unreduced, refused.

Design note. Between a backward under ``no_sync()`` (or ``require_backward_grad_sync=False``)
and the synced one, a rank's accumulated gradients are unreduced and kept in each group's flat
gradient, not in ``.grad``, which holds zeros (or what it held before) meanwhile
(``engine/shards/shard_grads.py``). An optimizer stepping then would apply nothing of them,
weight decay and momentum alone, without a word; on a plain model or under DDP it would step on
local gradients. So the step is refused, on every rank alike (every rank steps where the others
do), before it changes anything. Checked from the process-wide step pre-hook
(``whole_params.py``): one look per shard parameter, a few microseconds for a model's. A step
given a closure is checked once the closure has run, before the update: the closure computes
the gradients inside the step (Lightning runs the synced backward of a step with gradient
accumulation so), after the hook, so the hook hands the step the closure followed by the check.
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer

from .pieces import PIECE_ATTR

__all__ = ["refuse_unreduced"]


def refuse_unreduced(
    optimizer: Optimizer, args: tuple, kwargs: dict[str, Any]
) -> tuple[tuple, dict[str, Any]] | None:
    """Refuse a step of ``optimizer`` (``optimizer.step(*args[1:], **kwargs)``) over shard
    parameters whose gradients a backward under ``no_sync`` left unreduced. A step given a
    closure, which computes them, is checked once it has run: returned are the step's
    arguments with the closure followed by the check (what a step pre-hook returns to change
    them); ``None`` where it is checked now.

    Raises:
        RuntimeError: naming the optimizer, a parameter and the fix; nothing is changed.
    """
    closure = args[1] if len(args) > 1 else kwargs.get("closure")  # args[0]: the optimizer
    if closure is None:
        _check(optimizer)
        return None

    def checked(*a: Any, **k: Any) -> Any:
        loss = closure(*a, **k)
        _check(optimizer)
        return loss

    if len(args) > 1:
        return (args[0], checked, *args[2:]), kwargs
    return args, {**kwargs, "closure": checked}


def _check(optimizer: Optimizer) -> None:
    for param_group in optimizer.param_groups:
        for p in param_group["params"]:
            piece = getattr(p, PIECE_ATTR, None)
            group = piece[0]() if piece is not None else None
            if group is not None and group.shard_grads.stands_in(piece[1]):
                raise RuntimeError(
                    f"shardwrap: {type(optimizer).__name__}.step() after a backward under "
                    "no_sync() (or require_backward_grad_sync=False): this rank's gradients "
                    "since the last synced backward are unreduced and kept outside .grad (the "
                    f".grad of {group.names[piece[1]]} holds none of them), so the step would "
                    "apply nothing of them. Step after the synced backward (the last "
                    "micro-batch's, outside no_sync()). Nothing was changed."
                )
