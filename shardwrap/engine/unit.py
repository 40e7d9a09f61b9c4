"""One wrapped module's flat groups and their shared SHARDED <-> GATHERED state machine.

A unit knows nothing of other units or of the order of collectives; the schedule decides
when to gather, and the root decides when to reshard.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum, auto

from torch import Tensor, nn

from ..comm.collectives import CommStats, Pending, all_gather
from .flat_group import FlatGroup, views_of

__all__ = ["ShardState", "Unit"]


class ShardState(Enum):
    SHARDED = auto()
    GATHERING = auto()
    GATHERED = auto()


class Unit:
    """A wrapped module: its flat groups and their shared SHARDED <-> GATHERED state.

    Args:
        module: the wrapped module.
        index: position in the pre-order of units (the root is 0); the schedule orders
            collectives by it, identically on every rank.
        groups: the unit's flat groups (possibly none).
        stats: collective counters shared by the whole model.
        stage3_lifetime: released after forward and after backward whatever the stage
            (``Strategy.stage3_lifetime``).
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        groups: list[FlatGroup],
        stats: CommStats,
        stage3_lifetime: bool = False,
    ) -> None:
        self.module = module
        self.stage3_lifetime = stage3_lifetime
        self.index = index
        self.groups = groups
        self.stats = stats
        self.state = ShardState.SHARDED
        self._pending: list[Pending] = []
        self.trainable = [g for g in groups if g.requires_grad]
        self.frozen = [g for g in groups if not g.requires_grad]

    @property
    def is_stale(self) -> bool:
        return any(g.is_stale for g in self.groups)

    def start_gather(self, exact: bool = False) -> None:
        """Issue the all-gathers; the unit is GATHERING until :meth:`finish_gather`.

        With ``exact`` the buffers hold the shards' own dtype rather than the compute dtype.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        self._pending = [g.gather(self.stats, exact) for g in self.groups]
        self.state = ShardState.GATHERING

    def finish_gather(self) -> None:
        for p in self._pending:
            p.wait()
        self._pending = []
        for g in self.groups:
            # A gather into a buffer the shard is a slice of may count as writing the shard.
            g.mark_gathered()
        self.state = ShardState.GATHERED

    def gather_apart(self) -> None:
        """Take part in a peer's gather of this unit while holding it gathered (its buffers
        stay as they are: see :meth:`FlatGroup.gather_apart`)."""
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        for g in self.groups:
            g.gather_apart(self.stats)

    def use_full(self, track_grad: bool) -> None:
        """Make the module's attributes the full parameters (the unit must be gathered)."""
        if self.state is not ShardState.GATHERED:
            raise RuntimeError(f"unit {self.index} is {self.state.name}, expected GATHERED")
        for g in self.groups:
            g.make_views(track_grad)

    def drop_views(self) -> None:
        """Let the module's attributes fall back to the shards, keeping the gathered buffers."""
        for g in self.groups:
            g.drop_views()

    def reshard(self) -> None:
        """Release the full buffers; the module's attributes fall back to the shards."""
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        for g in self.groups:
            g.release()
        self.state = ShardState.SHARDED

    @contextmanager
    def readable(self, group: FlatGroup) -> Iterator[list[Tensor]]:
        """Yield ``group``'s full parameters in the shards' dtype, for reading outside forward.

        Gathers into a buffer of its own, leaving the unit's state as it was.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        buffer = group.take_buffer(group.dtype)
        try:
            all_gather(
                buffer, group.home.gather_input(group.shard), group.mesh.shard, self.stats
            ).wait()
            yield views_of(buffer, group)
        finally:
            group.pool.give(buffer, keep=group.dtype == group.compute_dtype)

    def register_grad_hooks(self, on_grad: Callable[[Unit, FlatGroup], None]) -> None:
        """Call ``on_grad(unit, group)`` once a group's flat gradient is complete.

        The hooks live in autograd's C++ side, out of sight of Python's garbage collector,
        so they hold only weak references: a dropped model is freed.
        """
        unit_ref = weakref.ref(self)
        callback = weakref.WeakMethod(on_grad)  # type: ignore[arg-type]
        for i, g in enumerate(self.trainable):

            def hook(_full: Tensor, i: int = i) -> None:
                unit, fn = unit_ref(), callback()
                if unit is not None and fn is not None:
                    fn(unit, unit.trainable[i])

            g.full.register_post_accumulate_grad_hook(hook)
