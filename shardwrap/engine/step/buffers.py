"""Buffers the same on every rank, as under DDP: rank 0's, from one training step to the next.

Design note. Buffers are not sharded: every rank holds each in full, and a module may change
its own in forward (BatchNorm's running statistics, each rank from its own batch). Left so, the
ranks' copies drift apart: an evaluation on rank 1 runs another model than the one rank 0
saves, and a run resumed from a checkpoint (which holds rank 0's) would differ on the other
ranks from one never stopped. ``DistributedDataParallel`` copies rank 0's buffers to every rank
before each forward that follows a training forward; a sharded model does the same, once per
step, at the end of each backward that reduces gradients (not under ``no_sync()``), which gives
the same values for the next forward, evaluation or save:

1. Each rank finds which buffers changed since they were last shared: a tensor's version
   counter moves at every in-place write, and a buffer assigned anew is another tensor. A
   module's buffers count as one: ``batch_norm`` writes the running statistics without moving
   their counters, but the module counts the batch in ``num_batches_tracked`` by ``add_``. A
   model whose buffers never change (rotary tables, masks) sends nothing.
2. Whether any rank found one rides on the end-of-backward handshake (``Schedule``), free.
3. If so, which ones is agreed in one small all-reduce (a rank's own edit counts too), and
   those go from the mesh's first rank to every rank, packed into one broadcast per dtype.

Buffers registered after wrapping are not followed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...comm.collectives import CommStats, all_reduce, as_sent
from ...comm.mesh import Mesh
from .edits import broadcast_from

__all__ = ["SharedBuffers"]


class SharedBuffers:
    """A model's buffers, copied from the mesh's first rank to every rank when they change.

    Args:
        model: the wrapped model; its buffers at wrapping are the ones followed.
        mesh: the model's groups.
        stats: collective counters shared by the whole model.
    """

    def __init__(self, model: nn.Module, mesh: Mesh, stats: CommStats) -> None:
        self.mesh = mesh
        self.stats = stats
        # (module, name) of every buffer, each tensor once: read afresh at each check, so a
        # buffer assigned anew (module.running_mean = ...) is the one sent.
        self._slots: list[tuple[nn.Module, str]] = []
        self._first: list[int] = []  # per slot: the index of its module's first slot
        seen: set[int] = set()
        for module in model.modules():
            first = len(self._slots)
            for name, b in module._buffers.items():
                if type(b) is Tensor and id(b) not in seen:  # not a DTensor block
                    seen.add(id(b))
                    self._slots.append((module, name))
                    self._first.append(first)
        self._shared = self._versions()  # as last shared (or as wrapped)

    def _versions(self) -> list[tuple[int, int]]:
        """Each buffer's identity and version now."""
        out = []
        for module, name in self._slots:
            b = module._buffers.get(name)
            out.append((-1, 0) if b is None else (id(b), b._version))
        return out

    def moved(self) -> list[bool]:
        """Per buffer, whether this rank changed it since it was last shared."""
        if self.mesh.world_size == 1:
            return []
        by_module: dict[int, bool] = {}
        for first, now, then in zip(self._first, self._versions(), self._shared):
            by_module[first] = by_module.get(first, False) or now != then
        return [by_module[first] for first in self._first]

    def share(self, moved: list[bool]) -> None:
        """Copy the first rank's values of every buffer some rank changed to every rank
        (called by every rank, at the end of a backward whose handshake found ``any(moved)``
        on some rank)."""
        flags = torch.tensor(moved, dtype=torch.int64, device=self.mesh.control_device)
        all_reduce(flags, self.mesh.control, dist.ReduceOp.MAX, self.stats, kind="handshake").wait()
        by_dtype: dict[torch.dtype, list[Tensor]] = {}
        for (module, name), changed in zip(self._slots, flags.tolist()):
            b = module._buffers.get(name)
            if changed and b is not None:
                by_dtype.setdefault(b.dtype, []).append(b)
        with torch.no_grad():
            for tensors in by_dtype.values():
                flat = torch.cat([t.reshape(-1).to(self.mesh.device) for t in tensors])
                broadcast_from(as_sent(flat), self.mesh, self.stats, 0, 0)
                for t, value in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(value.view_as(t))
        self._shared = self._versions()
