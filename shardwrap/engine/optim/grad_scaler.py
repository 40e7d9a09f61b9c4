"""Loss scaling for float16 training of a sharded model."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.collectives import Group, all_reduce

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` for sharded gradients: every rank skips a step alike.

    Each rank holds only its shard of the gradients, so an inf or NaN may show on one rank
    and not on the others. The shard gradients agree by themselves: the scaler's check over
    them is followed by one all-reduce of its flag over the ranks they are sharded over
    (``engine/optim/shard_grad.py``), so ``torch.amp.GradScaler`` skips the step on every rank
    alike and lowers the scale alike, for an optimizer that unscales in its own step
    (``fused=True``) too. This class is that scaler with one addition: a ``process_group`` to
    agree over as well, for gradients that are not a shardwrap model's. Use it exactly like
    ``torch.amp.GradScaler``::

        scaler = ShardedGradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    Args:
        device: where the scale lives (the gradients' device type); defaults to ``"cuda"``
            when CUDA is available, else ``"cpu"``.
        process_group: a group every rank of which checks the same optimizer at the same
            time, to agree over beyond the groups of the shard gradients (which always agree);
            default none.
        init_scale, growth_factor, backoff_factor, growth_interval, enabled: as for
            ``torch.amp.GradScaler``.
    """

    def __init__(
        self,
        device: str | None = None,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        super().__init__(
            device,
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self.process_group: Group = process_group

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: Tensor,
        found_inf: Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, Tensor]:
        """torch's unscale and check (``unscale_``, and ``step`` for a fused optimizer), then
        the flags agreed over ``process_group`` where one was given."""
        found = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
        if self.process_group is None:
            return found
        flag = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        for value in found.values():
            flag = torch.maximum(flag, value.to(flag.device))
        all_reduce(flag, self.process_group, dist.ReduceOp.MAX).wait()
        found.setdefault(found_inf.device, flag)  # a rank without gradients still checked
        for device, value in found.items():
            value.copy_(flag.to(device))
        return found
