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
    and not on the others. After unscaling, the ranks agree (one all-reduce of a flag) and
    either all step or all skip, and all lower the scale; the scale therefore stays the same
    on every rank. The same holds for optimizers that unscale inside their own step
    (``fused=True``). Use it exactly like ``torch.amp.GradScaler``::

        scaler = ShardedGradScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    Args:
        device: where the scale lives (the gradients' device type); defaults to ``"cuda"``
            when CUDA is available, else ``"cpu"``.
        process_group: the ranks the model is sharded over; defaults to the default group
            when ``torch.distributed`` is initialised, else none (one rank).
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
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.process_group: Group = process_group

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale this rank's gradient shards, then agree with every rank on inf/NaN."""
        super().unscale_(optimizer)
        if self.is_enabled():
            self._agree(self._per_optimizer_states[id(optimizer)]["found_inf_per_device"])

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[torch.device, Tensor]:
        """The check a fused optimizer's step makes instead of ``unscale_``, agreed alike."""
        found = super()._check_inf_per_device(optimizer)
        self._agree(found)
        return found

    def _agree(self, found: dict[torch.device, Tensor]) -> None:
        """Make every rank's inf/NaN flags the largest of all ranks' (one all-reduce)."""
        scale = self._scale
        assert scale is not None  # set before any check
        flag = torch.zeros((), dtype=torch.float32, device=scale.device)
        for value in found.values():
            flag = torch.maximum(flag, value.to(scale.device))
        all_reduce(flag, self.process_group, dist.ReduceOp.MAX).wait()
        if not found:
            found[scale.device] = flag
        for device, value in found.items():
            value.copy_(flag.to(device))
