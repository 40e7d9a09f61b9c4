"""The order of collectives: agreed across ranks, so ranks that run different modules never hang.

Design note. Collectives on one process group pair up by issue order, so every rank must
issue the same sequence. Ranks that take different branches, skip a module or call one
twice would not; ZeRO-3 implementations that issue collectives straight from module hooks
hang or, worse, pair the all-gather of one unit with that of another.

Here each rank, before it gathers a unit that is not already gathered, takes part in a
handshake: one all-reduce (MIN) of a few integers. Each rank puts in

1. the priority of what it wants next: a unit's index in forward, its reverse index in
   backward, or an end-of-phase marker (which sorts last);
2. how many reduce-scatters, in the canonical order, it has gradients ready for;
3. in backward, for every trainable flat group, whether it used the group at all.

All ranks then gather the unit with the smallest priority (those that wanted something
else serve the request and ask again), and issue the reduce-scatters that every rank has
ready. Reduce-scatters go in one canonical order, reverse unit index, which is also the
usual order in which backward completes, so on the common path nothing waits. A rank that
never used a unit sends zeros for it at the end of backward; a group no rank used keeps a
``None`` gradient, as in plain PyTorch.

With world size 1 there is nobody to agree with: gathers and reductions go straight out.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._collectives import CommStats, Group, Pending, all_reduce, group_size
from ._flat_group import FlatGroup
from ._unit import ShardState, Unit

__all__ = ["Schedule"]

# Each reduction in flight holds a unit's full-size flat gradient. One overlaps the next
# unit's backward (a reduction takes less time than a unit's backward) at the least memory.
MAX_REDUCTIONS_IN_FLIGHT = 1


class Schedule:
    """Orders one model's gathers and gradient reductions identically on every rank.

    Args:
        units: every unit of the model; ``units[i].index == i``.
        control: the group that carries handshakes (``None`` for world size 1). Ideally a
            group of its own over the same ranks, so that a handshake never queues behind
            bulk transfers; the data group itself works too.
        stats: collective counters shared by the whole model.
        device: where the handshake tensor lives (the control group backend's device).
    """

    def __init__(
        self, units: list[Unit], control: Group, stats: CommStats, device: torch.device
    ) -> None:
        self.units = units
        self.control = control
        self.world = group_size(control)
        self.stats = stats
        self.device = device
        n = len(units)
        self.end_forward_priority = 2 * n
        self.end_backward_priority = 2 * n + 1
        self.reduce_order: list[FlatGroup] = [
            g for u in sorted(units, key=lambda u: -u.index) for g in u.trainable
        ]
        self._position = {id(g): i for i, g in enumerate(self.reduce_order)}
        self.sync = True
        self._reset_backward()

    def _reset_backward(self) -> None:
        self._ready = [False] * len(self.reduce_order)
        self._used = [False] * len(self.reduce_order)
        self._issued = 0
        self._pending: list[tuple[int, Pending, torch.Tensor, torch.Tensor]] = []
        self._landed: list[tuple[int, torch.Tensor]] = []  # reduced shard gradients, 1-D padded/N

    # gathers -------------------------------------------------------------------------

    def gather(self, unit: Unit, backward: bool) -> None:
        """Start gathering ``unit`` once every rank has agreed to."""
        if self.world > 1:
            n = len(self.units)
            self._negotiate(2 * n - 1 - unit.index if backward else unit.index)
        unit.start_gather()

    def end_forward(self) -> None:
        """Serve peers' remaining gathers of this forward before moving on."""
        if self.world > 1:
            self._negotiate(self.end_forward_priority)

    def _negotiate(self, want: int) -> None:
        while True:
            ready = self._ready_prefix()
            t = torch.tensor([want, ready] + [-int(u) for u in self._used], dtype=torch.int64)
            t = t.to(self.device)
            all_reduce(t, self.control, dist.ReduceOp.MIN, self.stats, kind="handshake").wait()
            agreed, ready, *neg_used = t.tolist()
            self._issue_reductions(ready)
            if agreed == want:
                self._used_anywhere = [u < 0 for u in neg_used]
                return
            if agreed >= self.end_forward_priority:
                raise RuntimeError(
                    "shardwrap: ranks disagree on the training phase: some ranks finished "
                    "forward while others finished backward. Every rank must run the same "
                    "number of forward and backward passes, and enter no_sync() alike."
                )
            self._serve(agreed)

    def _serve(self, priority: int) -> None:
        n = len(self.units)
        unit = self.units[priority if priority < n else 2 * n - 1 - priority]
        was_sharded = unit.state is ShardState.SHARDED
        unit.start_gather()
        unit.finish_gather()
        if was_sharded:
            unit.reshard()

    # reductions ----------------------------------------------------------------------

    def grad_ready(self, group: FlatGroup) -> None:
        """Note that ``group``'s flat gradient for this backward is complete."""
        i = self._position[id(group)]
        self._ready[i] = self._used[i] = True
        if self.world == 1:
            self._issue_reductions(self._ready_prefix())

    def _ready_prefix(self) -> int:
        if not self.sync:
            return len(self.reduce_order)
        n = self._issued
        while n < len(self._ready) and self._ready[n]:
            n += 1
        return n

    def _issue_reductions(self, upto: int) -> None:
        if not self.sync:
            return
        for i in range(self._issued, upto):
            while len(self._pending) >= MAX_REDUCTIONS_IN_FLIGHT:
                self._complete_oldest()
            self._pending.append((i, *self.reduce_order[i].reduce_grad(self.stats)))
        self._issued = max(self._issued, upto)

    def drain(self) -> None:
        """Land every reduction in flight, freeing the full-size gradients they hold."""
        while self._pending:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        """Wait for the oldest reduction and land it, freeing its full-size gradient."""
        i, work, out, _grad = self._pending.pop(0)
        work.wait()
        self._landed.append((i, out))

    def finish_backward(self) -> None:
        """End of backward: reduce what is left (zeros where unused) and wait for all of it."""
        self._ready = [True] * len(self.reduce_order)
        self._used_anywhere = list(self._used)
        if self.world > 1:
            self._negotiate(self.end_backward_priority)
        else:
            self._issue_reductions(len(self.reduce_order))
        while self._pending:
            self._complete_oldest()
        for i, out in self._landed:
            if self._used_anywhere[i]:
                self.reduce_order[i].accumulate(out)
        self._reset_backward()
