"""Whole gradients inside ``gathered(with_grads=True)``: each full parameter's ``.grad`` is its
whole gradient, averaged over the ranks, as the unwrapped model's ``.grad``.

Design note. After a backward that reduced, each rank holds its pieces of every flat group's
averaged gradient as its shard parameters' ``.grad``: together one contiguous range of the
group's flat gradient. Laid out in that range and all-gathered over the shard group, as the
parameters are, they are the flat gradient, whose views become the full parameters' ``.grad``
(the block's views: a tensor-parallel parameter's gradient is its tp block, as its value is).

The ranks first agree, in one all-reduce, which parameters have a gradient on some rank (where
a rank's ``.grad`` is ``None``, its range counts as zeros) and that no rank holds gradients not
yet reduced (accumulated under ``no_sync()``): those are each rank's own, no whole gradient
exists yet, and every rank raises. The whole gradients are copies: an edit to one is not
written back, and the block drops them when it ends.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.collectives import all_gather, all_reduce
from ..shards.flat_group import FlatGroup, views_of

__all__ = ["WITH_GRADS", "drop_full_grads", "show_full_grads"]

WITH_GRADS = "gathered(with_grads=True)"  # the call every rank makes, in the schedule's handshake


def show_full_grads(root: Any, groups: list[FlatGroup]) -> list[Tensor]:
    """Give the full parameters of ``groups`` (gathered, their views made) their whole
    gradients; every rank calls it. Returns the views given one, for :func:`drop_full_grads`.

    Raises:
        RuntimeError: on every rank, where some rank holds gradients not yet reduced.
    """
    flags = [int(g.has_grad) for g in groups]
    flags += [int(p.grad is not None) for g in groups for p in g.shard_params]
    agreed = torch.tensor(flags, dtype=torch.int64, device=root.mesh.control_device)
    if root.mesh.world_size > 1:
        all_reduce(agreed, root.mesh.control, dist.ReduceOp.MAX, root.stats).wait()
    unreduced = [n for g, f in zip(groups, agreed[: len(groups)].tolist()) if f for n in g.names]
    if unreduced:
        raise RuntimeError(_unreduced(unreduced))
    has = iter(agreed[len(groups) :].tolist())
    given = []
    for g in groups:
        wanted = [bool(next(has)) for _ in g.shard_params]
        if not any(wanted):
            continue
        grads = views_of(_flat_grad(g, root.stats), g)
        assert g.views is not None  # the block made them
        for view, want, grad, spec in zip(g.views, wanted, grads, g.specs):
            if want:
                if g.param_grad_dtype != view.dtype:
                    view.grad_dtype = g.param_grad_dtype
                view.grad = grad if spec is None else spec.as_param(grad)
                given.append(view)
    return given


def drop_full_grads(given: list[Tensor]) -> None:
    """Take back the whole gradients :func:`show_full_grads` gave."""
    for view in given:
        view.grad = None


def _flat_grad(g: FlatGroup, stats: Any) -> Tensor:
    """``g``'s flat gradient (padded numel, the shard params' gradient dtype), gathered from
    every rank's pieces."""
    device = g.home.device
    lo, hi = g.layout.shard_range(g.mesh.shard_rank)
    mine = torch.zeros(hi - lo, dtype=g.param_grad_dtype, device=device)
    for p, pc in zip(g.shard_params, g.pieces):
        if p.grad is not None and pc.numel:
            mine[pc.shard_offset : pc.shard_offset + pc.numel].copy_(p.grad.reshape(-1))
    flat = torch.empty(g.layout.padded_numel, dtype=g.param_grad_dtype, device=device)
    all_gather(flat, mine, g.mesh.shard, stats).wait()
    return flat


def _unreduced(names: list[str]) -> str:
    where = ", ".join(names[:4]) + ("..." if len(names) > 4 else "")
    return (
        f"gathered(with_grads=True): gradients of {where} are accumulated but not yet reduced "
        "(backward ran inside no_sync(), or with require_backward_grad_sync off): each rank "
        "holds its own, and no whole gradient exists yet. Enter the block after the backward "
        "that reduces them (the first one outside no_sync())."
    )
