"""One wrapped module's flat groups and their shared SHARDED <-> GATHERED state machine.

A unit knows nothing of other units or of the order of collectives; the schedule decides
when to gather, and the root decides when to reshard after forward. In backward the unit
owns its gradients' first steps: its hooks release each group once its flat gradient is
complete, reshard the unit once backward is done with it (``BackwardProgress``), and hand
the gradient to the reductions.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Protocol

from torch import Tensor, nn

from ...comm.buckets import Gathers
from ...comm.collectives import CommStats, Pending, all_gather
from .eager import eager
from .flat_group import FlatGroup, views_of
from .profile import label

__all__ = ["BackwardDriver", "BackwardProgress", "GradSink", "ShardState", "Unit"]


class ShardState(Enum):
    """A unit's buffers; every transition goes through ``start_gather``, ``finish_gather`` or
    ``reshard``."""

    SHARDED = auto()  # only this rank's shards; the module's attributes are the shard params
    GATHERING = auto()  # all-gathers in flight into full buffers; nothing may read them yet
    GATHERED = auto()  # full buffers hold every rank's shards; views may stand for the params


class GradSink(Protocol):
    """Where a unit hands each flat gradient once complete (the reductions)."""

    def grad_ready(self, group: FlatGroup) -> None: ...


class BackwardDriver(Protocol):
    """What a unit's gradient hook asks of the root: to begin backward, where no pre-backward
    hook of the unit has (a module called on its own)."""

    def enter_backward(self) -> None: ...


@dataclass
class BackwardProgress:
    """How far one backward has come through a unit; forgotten when it ends, however it ends."""

    began: bool = False  # the unit's pre-backward hook ran: it is in this backward's order
    grads_done: set[int] = field(default_factory=set)  # ids of groups with a complete gradient
    # Forward calls whose input gradients backward has yet to compute: a frozen group has no
    # gradient to tell when backward is done with it. Counted from forward on.
    inputs_pending: int = 0


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
        release_after_backward: give the full buffers back once backward is done with them
            (``Strategy.release_after_backward``, or ``stage3_lifetime``); else only the views
            go, and the buffers stay for the next step.
    """

    def __init__(
        self,
        module: nn.Module,
        index: int,
        groups: list[FlatGroup],
        stats: CommStats,
        stage3_lifetime: bool = False,
        bucket_bytes: int = 0,
        release_after_backward: bool = False,
    ) -> None:
        self.module = module
        self.bucket_bytes = bucket_bytes
        self.stage3_lifetime = stage3_lifetime
        self.index = index
        self.groups = groups
        self.stats = stats
        self.state = ShardState.SHARDED
        self._pending: list[Pending] = []
        self.release_after_backward = release_after_backward
        for g in groups:
            g.release_after_backward = release_after_backward
        self.progress = BackwardProgress()
        self._driver: Callable[[], BackwardDriver | None] = lambda: None
        self._sink: Callable[[], GradSink | None] = lambda: None

    @property
    def holds_buffers(self) -> bool:
        """Whether every group holds its full buffer: a group releases its own once a
        backward last reads its views, while another graph (retained, run through later in the
        same backward) may still read saved views of it."""
        return all(g.is_allocated for g in self.groups)

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
        if self.state is ShardState.GATHERING:  # a gather in flight writes the buffers it replaces
            self.finish_gather()
        own = batch is None
        batch = Gathers(self.stats, self.bucket_bytes) if batch is None else batch
        try:
            self._pending = [g.gather(self.stats, exact, batch) for g in self.groups]
            if own:
                batch.issue()
        except BaseException:
            self.abandon_gather()
            raise
        self.state = ShardState.GATHERING

    def abandon_gather(self) -> None:
        """Forget a gather that raised before its exchange went out: each group is stale, so
        that it is gathered afresh before it is next read, as after a step. Left GATHERING, the
        next :meth:`finish_gather` would find nothing to wait for and take as gathered buffers
        nothing was gathered into (at stages 1 and 2, resident buffers whose other ranks'
        slices are old values or garbage, for every later forward)."""
        self._pending = []
        for g in self.groups:
            g.mark_stale()
        held = any(g.is_allocated for g in self.groups)  # released as a gathered unit's
        self.state = ShardState.GATHERED if held else ShardState.SHARDED

    def land_gather(self) -> None:
        """Finish the gather in flight, leaving stale the groups whose shard changed since it
        began (a rank that took part in a peer's gather of a unit it skipped, then stepped the
        optimizer): they are gathered afresh before use, as a stale unit is."""
        stale = [g for g in self.groups if g.is_stale]
        self.finish_gather()
        for g in stale:
            g.mark_stale()

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
            self.land_gather()
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

    def hide_views(self) -> None:
        """Let the module's attributes fall back to the pieces until the unit is used again,
        keeping its buffers and views (backward may hold them)."""
        for g in self.groups:
            g.hide_views()

    def reshard(self) -> None:
        """Release the full buffers; the module's attributes fall back to the shards."""
        if self.state is ShardState.GATHERING:  # a buffer goes back to the pool only once landed
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
            self.land_gather()
        buffer = group.take_buffer(group.dtype)
        try:
            all_gather(
                buffer, group.home.gather_input(group.shard), group.mesh.shard, self.stats
            ).wait()
            yield group.wholes(views_of(buffer, group))
        finally:
            group.pool.give(buffer, keep=group.dtype == group.compute_dtype)

    # backward ------------------------------------------------------------------------

    def hook_grads(self, driver: BackwardDriver, sink: GradSink) -> None:
        """Hand each trainable group's flat gradient to ``sink`` once complete, after releasing
        what backward no longer reads; ``driver`` begins backward where nothing else has.

        The hooks live in autograd's C++ side, out of sight of Python's garbage collector, so
        they hold the unit, its groups, ``driver`` and ``sink`` only weakly: a dropped model is
        freed.
        """
        self._driver, self._sink = weakref.ref(driver), weakref.ref(sink)
        for g in self.trainable:
            self.hook_grad(g)

    def hook_grad(self, group: FlatGroup) -> None:
        """Hook one group (a frozen group that starts to train, too) as :meth:`hook_grads`."""
        unit_ref, group_ref = weakref.ref(self), weakref.ref(group)

        @eager
        def hook(_full: Tensor) -> None:
            unit, g = unit_ref(), group_ref()
            if unit is not None and g is not None:
                unit._grad_done(g)

        group.full.register_post_accumulate_grad_hook(hook)

    def _grad_done(self, group: FlatGroup) -> None:
        driver, sink = self._driver(), self._sink()
        if driver is None or sink is None:
            return
        with label("post_backward"):
            if not self.progress.began:  # no pre-backward hook ran here: begin, if none has
                driver.enter_backward()
            self.progress.grads_done.add(id(group))
            if not self.release_if_done():  # the unit's release covers the group's
                group.after_backward()
            # Last: where the reduction goes out at once, the group's views are gone by then.
            sink.grad_ready(group)

    def begin_backward(self) -> bool:
        """Note that backward reached the unit; ``False`` where it already had."""
        began, self.progress.began = self.progress.began, True
        return not began

    def release_if_done(self) -> bool:
        """Release the unit once backward reads none of its groups again: every trainable
        group's gradient is complete and every forward call's input gradients are computed.

        Returns:
            Whether it released the unit now.
        """
        progress = self.progress
        if self.state is ShardState.SHARDED or progress.inputs_pending > 0:
            return False
        if not all(id(g) in progress.grads_done for g in self.trainable):
            return False
        self.after_backward()
        return True

    def after_backward(self) -> None:
        """Backward is done with the unit: release its buffers, or only its views (see
        ``release_after_backward``)."""
        if self.release_after_backward:
            self.reshard()
        else:
            self.drop_views()

    def end_backward(self) -> None:
        """Forget what one backward counted, however it ended."""
        self.progress = BackwardProgress()
        for g in self.trainable:
            g.end_backward()
