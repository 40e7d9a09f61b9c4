"""Every rank starts from the same weights: checked by default, or copied from rank 0.

Weights loaded on one rank only before wrapping (the habit ``sync_module_states`` serves in
other wrappers) would otherwise become a patchwork: each rank keeps its own pieces of
different values. :func:`check_same_values` costs one pass over the weights and one small
all-reduce (two float64 numbers per tensor); :func:`copy_from_rank0` broadcasts every
parameter and buffer from the model's first rank, one tensor at a time.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...comm.collectives import Group, all_reduce, group_size
from ...comm.mesh import Mesh

__all__ = ["check_same_values", "copy_from_rank0"]

# Identical tensors give identical float64 sums on identical code; the tolerance only absorbs
# a different reduction order (thread counts), far below any real difference in weights.
_RELATIVE = 1e-9


def _tensors(module: nn.Module) -> list[tuple[str, Tensor]]:
    named = list(module.named_parameters()) + list(module.named_buffers())
    return [(n, t.detach()) for n, t in named]


def _summary(t: Tensor) -> tuple[float, float]:
    """(sum, 2-norm) of ``t`` accumulated in float64, without a float64 copy of ``t``."""
    if _is_float8(t):  # torch sums no float8: its bytes are summed
        t = t.view(torch.uint8)
    if not (t.is_floating_point() or t.is_complex()):
        t = t.double()
    return (
        torch.sum(t, dtype=torch.float64).item(),
        torch.linalg.vector_norm(t, dtype=torch.float64).item(),
    )


def check_same_values(module: nn.Module, group: Group, device: torch.device) -> None:
    """Raise on every rank if any parameter or buffer differs across ranks.

    Raises:
        ValueError: naming the tensors that differ and the three ways to start alike.
    """
    if group_size(group) == 1:
        return
    named = _tensors(module)
    sums = torch.tensor([v for _, t in named for v in _summary(t)], dtype=torch.float64)
    both = torch.cat([sums, -sums]).to(device)
    all_reduce(both, group, dist.ReduceOp.MIN).wait()
    low, high = both[: len(sums)].cpu(), -both[len(sums) :].cpu()
    differ = []
    for i, (name, t) in enumerate(named):
        scale = float(high[2 * i + 1]) * max(1.0, math.sqrt(t.numel())) + 1e-30
        if ((high[2 * i : 2 * i + 2] - low[2 * i : 2 * i + 2]).abs() > _RELATIVE * scale).any():
            differ.append(name)
    if differ:
        raise ValueError(
            f"ShardedModule: the weights differ across ranks in {len(differ)} of {len(named)} "
            f"tensors ({differ[:4]}{'...' if len(differ) > 4 else ''}), so each rank would "
            "keep pieces of a different model. Load the weights on every rank (or seed every "
            "rank alike) before wrapping, or pass sync_module_states=True to copy rank 0's; "
            "if you load the weights after wrapping (load_pretrained, load_full_state_dict, "
            "load_checkpoint), pass sync_module_states=False."
        )


def copy_from_rank0(module: nn.Module, mesh: Mesh) -> None:
    """Overwrite every parameter and buffer with the mesh's first rank's values.

    With hybrid sharding the values go first across the replicate groups from replica 0,
    then within every shard group from its first rank, so rank 0's reach every rank.
    """
    options = dist.BroadcastOptions()
    options.rootRank = 0
    groups = [g for g in (mesh.replicate, mesh.shard) if g is not None and group_size(g) > 1]
    for _, t in _tensors(module):
        staged = t if t.is_contiguous() else t.contiguous()
        # gloo sends no float8: its bytes go as they are
        wire = staged.view(torch.uint8) if _is_float8(staged) else staged
        for group in groups:
            group.broadcast([wire], options).wait()
        if staged is not t:
            t.copy_(staged)


def _is_float8(t: Tensor) -> bool:
    return t.is_floating_point() and t.element_size() == 1
