"""Every rank starts from the same weights: rank 0's where they differ, as DDP makes them.

Weights that differ across ranks before wrapping (a seed per rank, as DDP scripts set it;
weights loaded on rank 0 only, the habit ``sync_module_states`` serves in other wrappers) would
otherwise become a patchwork: each rank keeps its own pieces of different values. DDP copies
rank 0's parameters and buffers to every rank when it wraps; so does shardwrap by default, for
the tensors that differ, with a warning naming them. :func:`differing_values` costs one pass
over the weights and one small all-reduce (three float64 numbers per tensor: its sum, its norm
and a sum weighted by position, which tells apart the same values in another order, a
transposed or flipped matrix);
:func:`copy_from_rank0` broadcasts parameters and buffers from the model's first rank, one
tensor at a time.

A tensor-parallel parameter (a DTensor) differs across tp ranks by design: each holds its
block. It is compared by the sums of its blocks (one more small all-reduce, over tp), and
copied block by block from the first rank of each tp rank's shard group.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...comm.collectives import all_reduce, as_sent, group_size
from ...comm.mesh import Mesh
from ..shards.tensor_parallel import is_dtensor

__all__ = ["copy_from_rank0", "differing_values", "warn_copied"]

# Identical tensors give identical float64 sums on identical code; the tolerance only absorbs
# a different reduction order (thread counts), far below any real difference in weights.
_RELATIVE = 1e-9


def _tensors(module: nn.Module) -> list[tuple[str, Tensor, bool]]:
    """Every parameter and buffer: name, tensor (a DTensor's local block), whether a block."""
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [
        (n, t.detach().to_local(), True) if is_dtensor(t) else (n, t.detach(), False)
        for n, t in named
    ]


_STATS = 3  # numbers compared per tensor: see _summary
_BLOCK = 1 << 20  # elements weighted at a time: a float64 copy of a block, never of the tensor


def _summary(t: Tensor) -> tuple[float, float, float]:
    """(sum, sum of squares, sum of each element times its position) of ``t``, accumulated in
    float64 in one pass over ``t``, a block at a time (never a float64 copy of ``t``)."""
    flat = as_sent(t).reshape(-1)  # a float8 tensor's bytes are summed, a complex one's parts
    sums = torch.zeros(_STATS, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _BLOCK):
        part = flat[start : start + _BLOCK].double()
        at = torch.arange(
            start + 1, start + 1 + part.numel(), dtype=torch.float64, device=part.device
        )
        sums += torch.stack([part.sum(), torch.dot(part, part), torch.dot(part, at)])
    total, squares, weighted = sums.tolist()
    return total, squares, weighted


def differing_values(module: nn.Module, mesh: Mesh) -> list[str]:
    """The names of the parameters and buffers whose values differ across ranks (the same
    list on every rank; a tensor-parallel block: where the sums of its blocks over tp do).
    Compared over the mesh's control group; the blocks summed over the tp group, on the
    compute device (NCCL takes no host tensor)."""
    if group_size(mesh.control) == 1:
        return []
    named = _tensors(module)
    summed = torch.tensor([v for _, t, _ in named for v in _summary(t)], dtype=torch.float64)
    tp = mesh.tp.get_group() if mesh.tp is not None else None
    if group_size(tp) > 1:
        blocks = torch.tensor([b for _, _, b in named for _ in range(_STATS)])
        over_tp = torch.where(blocks, summed, 0.0).to(mesh.device)
        all_reduce(over_tp, tp, dist.ReduceOp.SUM).wait()
        summed = torch.where(blocks, over_tp.cpu(), summed)
    sums = summed.clone()
    sums[1::_STATS] = summed[1::_STATS].sqrt()
    both = torch.cat([sums, -sums]).to(mesh.control_device)
    all_reduce(both, mesh.control, dist.ReduceOp.MIN).wait()
    low, high = both[: len(sums)].cpu(), -both[len(sums) :].cpu()
    differ = []
    for i, (name, t, _) in enumerate(named):
        at = _STATS * i
        norm, n = float(high[at + 1]), max(1.0, float(t.numel()))
        # |sum| <= norm * sqrt(n); |weighted sum| <= norm * n ** 1.5 (positions up to n)
        scale = torch.tensor([n**0.5, n**0.5, n**1.5], dtype=torch.float64) * norm + 1e-30
        if ((high[at : at + _STATS] - low[at : at + _STATS]).abs() > _RELATIVE * scale).any():
            differ.append(name)
    return differ


def warn_copied(module: nn.Module, names: list[str]) -> None:
    """Say that rank 0's values of ``names`` were copied to every rank, and how to choose."""
    total = len(_tensors(module))
    warnings.warn(
        f"ShardedModule: the weights differed across ranks in {len(names)} of {total} tensors "
        f"({names[:4]}{'...' if len(names) > 4 else ''}); rank 0's were copied to every rank, "
        "as DistributedDataParallel does. Seed every rank alike (or load the weights on every "
        "rank) to start alike without the copy, pass sync_module_states=True to copy rank 0's "
        "without this check and warning (weights loaded on rank 0 only), or "
        "sync_module_states=False where the weights are loaded after wrapping "
        "(load_pretrained, load_full_state_dict, load_checkpoint).",
        stacklevel=3,
    )


def copy_from_rank0(module: nn.Module, mesh: Mesh, names: list[str] | None = None) -> None:
    """Overwrite every parameter and buffer (or those of ``names``, the same on every rank)
    with the mesh's first rank's values, sent from the compute device (a model built in host
    memory is wrapped before it moves, and NCCL takes no host tensor).

    With hybrid sharding the values go first across the replicate groups from replica 0,
    then within every shard group from its first rank, then (but for tensor-parallel blocks)
    across the tp group from its first rank, so rank 0's reach every rank.
    """
    options = dist.BroadcastOptions()
    options.rootRank = 0
    tp = mesh.tp.get_group() if mesh.tp is not None else None
    groups = [g for g in (mesh.replicate, mesh.shard, tp) if g is not None and group_size(g) > 1]
    chosen = None if names is None else set(names)
    for name, t, block in _tensors(module):
        if chosen is not None and name not in chosen:
            continue
        staged = t.to(mesh.device).contiguous()
        wire = as_sent(staged)
        for group in groups:
            if not (block and group is tp):
                group.broadcast([wire], options).wait()
        if staged is not t:
            t.copy_(staged)
