"""What the memory planner measures of the optimizer step on the meta device: state, temporaries.

Design note. One step of the user's optimizer runs over meta tensors shaped like rank 0's shard
parameters, each with a gradient, under the dispatch mode that counts the trace's live bytes:
what is alive after it is the optimizer's state, the most alive during it the step's peak.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..tiers.offload import _FUSED_OPTIMIZERS as FUSED_OPTIMIZERS
from .trace import GroupSpec, LiveBytes

__all__ = ["OptimizerFactory", "optimizer_bytes"]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]


def optimizer_bytes(
    groups: list[GroupSpec], optimizer: OptimizerFactory | None, device: str, fuse: bool = False
) -> tuple[int, int]:
    """The optimizer's state on rank 0 (which holds the most), and the most its step holds.

    One step over meta shard parameters, shaped like rank 0's pieces (1-D, in the shards'
    dtype), each with a gradient; returns ``(state bytes, most alive during the step)``.
    Where a parameter group left ``fused`` and ``foreach`` unset, torch steps it as it would
    on ``device`` (one foreach step on CUDA, tensor by tensor on a CPU), and with ``fuse``
    (the offload tiers) the engine turns on torch's fused kernel for the optimizers that have
    one (``tiers.offload.prefer_fused``): a fused step updates in place and allocates nothing.
    """
    if optimizer is None:
        return 0, 0
    params = []
    for g in groups:
        if g.requires_grad:
            for piece in g.layout.local_pieces(0):
                p = nn.Parameter(torch.empty(piece.numel, dtype=g.dtype, device="meta"))
                p.grad = torch.empty_like(p)
                params.append(p)
    if not params:
        return 0, 0
    counter = LiveBytes()
    with counter:
        opt = optimizer(params)
        fused = []
        for group in opt.param_groups:
            unset = group.get("fused") is None and group.get("foreach") is None
            fused.append(bool(group.get("fused")) or (fuse and unset and _has_fused(opt)))
            # meta tensors have no fused kernel: step them per tensor, for the state
            if "foreach" in group:
                group["foreach"] = device == "cuda" if unset else bool(group["foreach"])
            if "fused" in group:
                group["fused"] = False
        opt.step()
        state = counter.live()
    _, most = counter.mark()
    del opt
    return state, state if all(fused) else most


def _has_fused(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(optimizer, FUSED_OPTIMIZERS)
