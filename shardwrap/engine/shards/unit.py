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

from ...comm.buckets import Gathers
from ...comm.collectives import CommStats, Pending, all_gather
from .flat_group import FlatGroup, views_of

__all__ = ["ShardState", "Unit"]


class ShardState(Enum):
    """A unit's buffers; every transition goes through ``start_gather``, ``finish_gather`` or
    ``reshard``."""

    SHARDED = auto()  # only this rank's shards; the module's attributes are the shard params
    GATHERING = auto()  # all-gathers in flight into full buffers; nothing may read them yet
    GATHERED = auto()  # full buffers hold every rank's shards; views may stand for the params


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
        bucket_bytes: the most bytes of full buffers one gather exchange carries
            (``comm/buckets.py``).
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        groups: list[FlatGroup],
        stats: CommStats,
        stage3_lifetime: bool = False,
        bucket_bytes: int = 0,
    ) -> None:
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.stage3_lifetime = stage3_lifetime
        self.index = index
        self.groups = groups
        self.stats = stats
        self.state = ShardState.SHARDED
        self._pending: list[Pending] = []

    @property
    def trainable(self) -> list[FlatGroup]:
        """The groups that get a flat gradient (a frozen one may start to: see ``Root``)."""
        return [g for g in self.groups if g.requires_grad]

    @property
    def frozen(self) -> list[FlatGroup]:
        return [g for g in self.groups if not g.requires_grad]

    @property
    def gather_nbytes(self) -> int:
        """Bytes of the unit's full buffers in the compute dtype: what gathering it holds."""
        return sum(g.layout.padded_numel * g.compute_dtype.itemsize for g in self.groups)

    @property
    def is_stale(self) -> bool:
        return any(g.is_stale for g in self.groups)

    def start_gather(self, exact: bool = False, batch: Gathers | None = None) -> None:
        """Issue the all-gathers; the unit is GATHERING until :meth:`finish_gather`.

        With ``exact`` the buffers hold the shards' own dtype rather than the compute dtype.
        The plain gathers join ``batch`` (issued by the caller); without one, the unit's own
        groups go in one exchange while they fit in ``bucket_bytes``.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        own = batch is None
        batch = Gathers(self.stats, self.bucket_bytes) if batch is None else batch
        self._pending = [g.gather(self.stats, exact, batch) for g in self.groups]
        if own:
            batch.issue()
        self.state = ShardState.GATHERING

    def finish_gather(self) -> None:
        for p in self._pending:
            p.wait()
        self._pending = []
        for g in self.groups:
            # A gather into a buffer the shard is a slice of may count as writing the shard.
            g.mark_gathered()
        self.state = ShardState.GATHERED

    def gather_apart(self, batch: Gathers) -> Callable[[], None]:
        """Take part in a peer's gather of this unit while holding it gathered (its buffers
        stay as they are: see :meth:`FlatGroup.gather_apart`); returns what completes it
        once ``batch`` is issued."""
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        completions = [g.gather_apart(self.stats, batch) for g in self.groups]

        def done() -> None:
            for complete in completions:
                complete()

        return done

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

        Gathers into a buffer of its own, leaving the unit's state as it was. A
        tensor-parallel parameter is yielded whole, gathered over tp too.
        """
        if self.state is ShardState.GATHERING:
            self.finish_gather()
        buffer = group.take_buffer(group.dtype)
        try:
            all_gather(
                buffer, group.home.gather_input(group.shard), group.mesh.shard, self.stats
            ).wait()
            yield group.wholes(views_of(buffer, group))
        finally:
            group.pool.give(buffer, keep=group.dtype == group.compute_dtype)

    def register_grad_hook(
        self, group: FlatGroup, on_grad: Callable[[Unit, FlatGroup], None]
    ) -> None:
        """Call ``on_grad(unit, group)`` once ``group``'s flat gradient is complete.

        The hook lives in autograd's C++ side, out of sight of Python's garbage collector,
        so it holds only weak references: a dropped model is freed.
        """
        unit_ref, group_ref = weakref.ref(self), weakref.ref(group)
        callback = weakref.WeakMethod(on_grad)  # type: ignore[arg-type]

        def hook(_full: Tensor) -> None:
            unit, g, fn = unit_ref(), group_ref(), callback()
            if unit is not None and g is not None and fn is not None:
                fn(unit, g)

        group.full.register_post_accumulate_grad_hook(hook)
