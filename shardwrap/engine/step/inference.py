"""Whether a model's units may stay gathered through a generation or an evaluation.

Design note. Training releases each unit's gathered parameters once its forward is done (at
stage 3), which is right when a backward follows and wrong when forwards without a graph come
one after the other: ``generate()`` runs the decoder once per token, and each run would gather
every unit again (a 5M-parameter T5 decoding 64 rows with beam 4 gathered 520 times, 1.5 GB a
rank). Inside ``keep_gathered()`` such forwards leave their units gathered, so each unit is
gathered once for the whole block, at the memory of the whole model in its compute dtype.

Whether that memory is there is decided on every rank from the same rule and then agreed (the
smallest answer wins, in one small all-reduce), since ranks that decided differently would
gather different units and wait on each other: the units not gathered yet must fit in half the
memory free now (the other half is left to activations and the generation's caches). Free
memory is the device's free memory on a GPU and the system's available memory on a CPU.

Generation then goes further (:func:`decoding_alone`): every unit is gathered up front, one
agreed gather each, after which no forward of the block issues a collective, not even the
handshake that ends a forward. Each rank then decodes on its own, as the unwrapped model does
under DDP: no all-reduce per token to ask whether every rank is done, no rank waiting for the
slowest one at every token, and a rank whose rows end early simply stops.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

from ...comm.collectives import all_reduce
from ..shards.unit import ShardState
from .root import Root

__all__ = ["decoding_alone", "fits_gathered", "gathered_bytes"]


def gathered_bytes(root: Root) -> int:
    """Bytes the units not gathered now would take, gathered in their compute dtypes."""
    return sum(
        g.layout.padded_numel * g.compute_dtype.itemsize
        for u in root.units
        if u.state is ShardState.SHARDED
        for g in u.groups
    )


def fits_gathered(root: Root) -> bool:
    """Whether every rank has room to keep all its units gathered (agreed on every rank)."""
    device = root.mesh.device
    fits = gathered_bytes(root) <= _free_bytes(device) // 2
    mesh = root.mesh
    if mesh.world_size == 1:
        return fits
    flag = torch.tensor([1.0 if fits else 0.0], device=mesh.control_device)
    all_reduce(flag, mesh.control, dist.ReduceOp.MIN, root.stats).wait()
    return flag.item() > 0


@contextmanager
def decoding_alone(root: Root) -> Iterator[bool]:
    """Inside a ``keep_gathered()`` block that keeps units gathered: gather every unit now, so
    that the forwards in this block need no collective and each rank may run as many as it
    likes. Yields whether it did (not where units are not kept, or on one rank).

    The forwards run here are not counted among the passes the ranks agree on (each rank may
    run a different number); the count is restored when the block ends. Every rank enters
    alike; nothing in the block may change the shards (an optimizer step, a load).
    """
    schedule = root.schedule
    if (
        not (root.keeping and root.keep_decided)
        or schedule.decoding_alone
        or root.mesh.world_size == 1
    ):
        yield False
        return
    for unit in root.units:
        root.ensure_gathered(unit, backward=False)
    passes = schedule.passes
    schedule.decoding_alone = True
    try:
        yield True
    finally:
        schedule.decoding_alone = False
        schedule.passes = passes


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
