"""What a wrap produced, in a few lines: ranks, stage, units, dtypes, tier, memory per rank,
buckets.

Logged once at wrap time (logger ``"shardwrap"``, INFO, on global rank 0 only) and returned by
``ShardedModule.summary()`` on any rank. Everything is read from the built units and options:
no collective, no allocation. The memory lines are what the sharded state costs this rank
between steps and while a unit runs; the optimizer's state depends on the optimizer, built
later, so its line names the usual case and the planner for the whole picture.
"""

from __future__ import annotations

import logging

from torch import nn

from ..step.root import Root

__all__ = ["log_summary", "summarize"]

logger = logging.getLogger("shardwrap")


def summarize(model: nn.Module, root: Root) -> str:
    """The summary of ``model``, wrapped with ``root``, as this rank sees it."""
    mesh, strategy, home = root.mesh, root.strategy, root.home
    groups = [g for u in root.units for g in u.groups]
    total = sum(g.layout.numel for g in groups)
    total_bytes = sum(g.layout.numel * g.dtype.itemsize for g in groups)
    shard_bytes = sum(g.layout.shard_size * g.dtype.itemsize for g in groups)
    grad_bytes = sum(g.layout.shard_size * g.dtype.itemsize for g in groups if g.requires_grad)
    gathered = [
        sum(g.layout.padded_numel * g.compute_dtype.itemsize for g in u.groups) for u in root.units
    ]
    trainable = sum(g.layout.numel for g in groups if g.requires_grad)
    units = len(root.units) - 1  # the root's own unit holds what no unit took
    ranks = f"{mesh.world_size} rank" + ("s" if mesh.world_size != 1 else "")
    if mesh.replicate_size > 1:
        ranks += f" (shard {mesh.shard_size} x replicate {mesh.replicate_size})"
    stage = f"ZeRO stage {strategy.stage}"
    if strategy.stage == 3 and not strategy.reshard_after_forward:
        stage += ", gathered parameters kept from forward to backward"
    dtypes = sorted({str(g.dtype).removeprefix("torch.") for g in groups})
    compute = sorted({str(g.compute_dtype).removeprefix("torch.") for g in groups})
    full_grads = sum(
        g.layout.padded_numel * g.grad_dtype.itemsize for g in groups if g.requires_grad
    )
    lines = [
        f"shardwrap: {type(model).__name__} over {ranks} on {mesh.device}, {stage}",
        f"  {units} units and the root; {total / 1e6:.2f}M parameters ({_mb(total_bytes)}), "
        f"{trainable / 1e6:.2f}M trainable",
        f"  stored {'/'.join(dtypes)}, computed in {'/'.join(compute)}; offload: {home.offload}",
        f"  per rank: shards {_mb(shard_bytes)}, their gradients {_mb(grad_bytes)}",
    ]
    if strategy.keeps_params:
        kept = sum(
            g.layout.padded_numel * g.compute_dtype.itemsize
            for u in root.units
            for g in u.groups
            if g.requires_grad or not u.stage3_lifetime
        )
        lines.append(f"  full parameters kept between steps: {_mb(kept)}")
    else:
        lines.append(
            f"  while a unit runs: its gathered parameters, up to {_mb(max(gathered))} "
            f"({_mb(2 * max(gathered))} with the next prefetched)"
        )
    if strategy.defer_reductions:
        lines.append(f"  full gradients until the end of backward: {_mb(full_grads)}")
    bucket = root.schedule.bucket_bytes
    if bucket and mesh.world_size > 1:
        small = sum(1 for nbytes in gathered if nbytes <= bucket)
        lines.append(
            f"  buckets of up to {_mb(bucket)}: {small} of {units + 1} units fit one, and go "
            "several to an exchange (bucket_mb)"
        )
    lines.append(
        f"  optimizer state: made on the shards (AdamW: 2 x {_mb(grad_bytes)}); "
        "the whole plan: shardwrap.estimate_memory"
    )
    return "\n".join(lines)


def log_summary(model: nn.Module, root: Root) -> None:
    """Log the summary at INFO on global rank 0 (nothing is built when INFO is off)."""
    if root.mesh.rank == 0 and logger.isEnabledFor(logging.INFO):
        logger.info("%s", summarize(model, root))


def _mb(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
