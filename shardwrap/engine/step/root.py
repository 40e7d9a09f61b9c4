"""The root's orchestration: hooks, execution order, prefetch and the end of backward.

Design note. Each unit gets a forward pre-hook (gather, make the full parameters visible)
and a forward hook (reshard, unless it is the root, ``reshard_after_forward`` is off or
backward starts with it, and hook the outputs so the unit is gathered again before autograd
needs it). Backward's gradients are the units' own (``Unit.hook_grads``): once a group's
flat gradient is complete, its unit releases it, reshards itself when backward is done with
it, and hands the gradient to the reductions. A callback queued on the autograd engine at the
start of backward releases whatever is still gathered, reduces what no hook reduced (unused
units send zeros) and waits for every reduction.

The order in which units ran in the previous forward and backward drives prefetch: when a
unit starts, the next one's all-gather is issued so that it overlaps this unit's compute; as
a unit is gathered, the shards' home is told which unit follows it (the host tier starts
copying that unit's shards to the device, ``tiers/home.py``).
Collectives go through :class:`~shardwrap.engine.step.schedule.Schedule`, which keeps every rank's
sequence identical.

When a gathered buffer is released is the strategy's decision (``engine/step/strategy.py``); the
hooks here ask it at each point. The root unit is not resharded after forward (backward needs it
first), nor after a ``no_grad`` forward, so decoding loops do not re-gather it on every call;
a gathered unit whose shard has changed since (an optimizer step, a load) is gathered afresh.
Views of gathered buffers that autograd saves are kept by address (``engine/shards/saved.py``).

Beside the root: the parameter index (``engine/shards/param_index.py``), the hooks of modules called
on their own (``engine/step/own_calls.py``) and recomputation and compilation
(``engine/step/recompute.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum, auto
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_flatten

from ...comm.collectives import CommStats
from ...comm.mesh import Mesh
from ...options import Compression, MixedPrecision
from ...tiers.home import Home
from ...tiers.offload import before_step
from ..optim.step_hooks import OptimizerHooks
from ..shards.eager import eager, untransformed
from ..shards.param_index import Param, index_params
from ..shards.pool import BufferPool
from ..shards.profile import label
from ..shards.saved import SavedViews
from ..shards.unit import ShardState, Unit
from .buffers import SharedBuffers
from .edits import EditMark, gathered_block
from .order import ExecutionOrder, unit_index
from .own_calls import OwnCalls
from .recompute import apart_from_replay
from .reduce import Reductions, reduction_order
from .schedule import Schedule
from .strategy import Strategy
from .trees import cast_floating, map_outputs, to_device

__all__ = ["TRACED", "Phase", "Root"]


class Phase(Enum):
    """Where the model is in a training step; the hooks check it before every transition."""

    IDLE = auto()  # outside forward and backward: saves, loads, gathered(), an optimizer step
    FORWARD = auto()  # from the root unit's pre-forward hook to its forward hook
    BACKWARD = auto()  # from the first pre-backward or gradient hook to the end of backward


# What torch.jit.trace, torch.jit.script and torch.export of a sharded model say.
TRACED = (
    "torch.jit.trace, torch.jit.script and torch.export of a sharded model are not supported: "
    "its forward gathers each unit's parameters from every rank, which a traced or exported "
    "graph cannot do. Trace or export the unwrapped model: load model.full_state_dict() "
    "(every rank calls it) into a plain copy of it on one rank, and trace or export that."
)


class Root:
    """Drives every unit of one sharded model.

    Args:
        units: all units in pre-order; ``units[0]`` wraps the root module.
        mesh: the groups and device of the model.
        stats: collective counters.
        strategy: when gathered buffers are released and reductions run.
        pool: the buffers units gather into.
        precision: mixed-precision casts of inputs and outputs, or ``None``.
        home: where the shards live (``tiers/home.py``); default: on the mesh's device.
        compile_options: the ``torch.compile`` options units were compiled with, or ``None``.
        compression: what the collectives quantize (the reductions, here), or ``None``.
        bucket_bytes: the most bytes one exchange carries for several units' gathers or
            several groups' reductions (``comm/buckets.py``); 0: one exchange each.
    """

    def __init__(
        self,
        units: list[Unit],
        mesh: Mesh,
        stats: CommStats,
        strategy: Strategy,
        pool: BufferPool,
        precision: MixedPrecision | None = None,
        home: Home | None = None,
        compile_options: dict[str, Any] | None = None,
        compression: Compression | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        self.units = units
        self.precision = precision
        self.compile_options = compile_options
        self.home = home or Home(mesh.device)
        self.input_dtype = precision.param_dtype if precision else None
        self.output_dtype = precision.output_dtype if precision else None
        self.pool = pool
        self._unit_of = {id(g): u for u in units for g in u.groups}
        self.saved = SavedViews(
            pool, lambda group: self.ensure_gathered(self._unit_of[id(group)], backward=True)
        )
        self.mesh = mesh
        self.stats = stats
        self.strategy = strategy
        self.params: list[Param]
        self.param_of: dict[int, Param]  # keyed by id(shard parameter)
        self.params, self.param_of = index_params(units)
        # Every group that can train, in the canonical order: a frozen one may be unfrozen after
        # wrapping, and a fixed order keeps every rank's handshakes the same size.
        order = reduction_order([[g for g in u.groups if g.can_train] for u in units])
        self.reductions = Reductions(
            order,
            mesh,
            stats,
            defer=strategy.defer_reductions,
            home=self.home,
            compression=compression,
            bucket_bytes=bucket_bytes,
        )
        self.schedule = Schedule(units, mesh, stats, self.reductions, bucket_bytes)
        # Weakly: shard grads hold their owner, and the model holds its grads (through C++,
        # where the garbage collector cannot follow a cycle back).
        schedule = weakref.ref(self.schedule)

        def enter(call: str) -> None:
            live = schedule()
            if live is not None:
                live.enter(call)

        for owner in self.reductions.grad_owners:
            owner.enter = enter
        mesh.set_whereabouts(self.whereabouts)
        weakref.finalize(self, self.home.close)
        self.optimizers: OptimizerHooks | None = None  # the offload tiers' optimizer hooks
        if self.home.hooks_optimizers:
            shards = [p for u in units for g in u.groups for p in g.shard_params]
            self.optimizers = OptimizerHooks(shards, before_step)
            weakref.finalize(self, self.optimizers.close)
        self.phase = Phase.IDLE
        self.keeping = 0  # keep_gathered() blocks entered
        self.gathered_depth = 0  # gathered() blocks entered (they nest)
        self.copy_recipe: Any = None  # how the model was wrapped: engine/wrap/copies.py
        self.edit_marks: list[EditMark] | None = None  # inside gathered(): engine/step/edits.py
        self.keep_decided: bool | None = None  # ShardedModule.keep_gathered's, while inside
        # the units the previous forward kept for backward: its final bucket's, and the unit
        # that ran last (comm/buckets.py)
        self._forward_kept: set[int] = set()
        self.order: ExecutionOrder[Unit] = ExecutionOrder(unit_index)  # drives prefetch
        # the frozen groups that may start to train (see ``_train_unfrozen``)
        self._frozen = [(u, g) for u in units for g in u.frozen if g.can_train]
        self._pre_hook_ids: list[int] = []  # per unit: its gathering pre-hook's handle id
        self._post_hook_ids: list[int] = []  # per unit: its post-forward hook's handle id
        for unit in units:
            pre_forward = eager(self._hook_pre_forward(unit))
            # First of the unit's pre-hooks: one registered before wrapping (pruning's, which
            # computes the weight from its parameters) sees the full parameters too.
            pre = unit.module.register_forward_pre_hook(pre_forward, prepend=True, with_kwargs=True)
            self._pre_hook_ids.append(pre.id)
            post = unit.module.register_forward_hook(eager(self._hook_post_forward(unit)))
            self._post_hook_ids.append(post.id)
            unit.hook_grads(self, self.reductions)
        self.own_calls = OwnCalls(self, units)
        self.buffers = SharedBuffers(self.root.module, mesh, stats)

    @property
    def root(self) -> Unit:
        return self.units[0]

    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    @property
    def idle(self) -> bool:
        return self.phase is Phase.IDLE

    def whereabouts(self) -> str:
        """This rank's forward pass and phase, for the message of a collective that failed."""
        return self.schedule.whereabouts(self.phase.name.lower())

    # forward -------------------------------------------------------------------------

    def _hook_pre_forward(self, unit: Unit) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: Any, kwargs: Any) -> Any:
            with label("pre_forward"):
                # Last of the module's forward hooks, so one registered after wrapping (weight
                # statistics, say) still sees the full parameters before they are released.
                hooks, post = module._forward_hooks, self._post_hook_ids[unit.index]
                if next(reversed(hooks)) != post:
                    hooks.move_to_end(post)
                if unit is self.root:
                    if torch.jit.is_tracing() or torch.compiler.is_exporting():
                        raise TypeError(TRACED)
                    self.gather_hooks_first()
                self._pre_forward(unit)
                if unit is self.root and self.mesh.device.type != "cpu":
                    args, kwargs = to_device((args, kwargs), self.mesh.device)
                if self.input_dtype is not None:
                    args, kwargs = cast_floating((args, kwargs), self.input_dtype)
                if unit.frozen and torch.is_grad_enabled() and self.phase is Phase.FORWARD:
                    self._hook_inputs(unit, (args, kwargs))
                return args, kwargs

        return hook

    def gather_hooks_first(self) -> None:
        """Put each unit's gathering pre-hook first again, ahead of any registered since with
        ``prepend=True``: so the units the root's forward calls gather before any pre-hook of
        their modules runs (torch takes a module's hooks as they are when it is called)."""
        for unit, key in zip(self.units, self._pre_hook_ids):
            hooks = unit.module._forward_pre_hooks
            if next(iter(hooks)) != key:
                hooks.move_to_end(key, last=False)

    def _hook_post_forward(self, unit: Unit) -> Callable[[nn.Module, Any, Any], Any]:
        def hook(module: nn.Module, args: Any, output: Any) -> Any:
            with label("post_forward"):
                if unit is self.root and self.output_dtype is not None:
                    output = cast_floating(output, self.output_dtype)
                return self._post_forward(unit, output)

        return hook

    @untransformed  # a torch.func transform's wrappers have no address to gather into
    def _pre_forward(self, unit: Unit) -> None:
        self.settle()  # a backward that raised: its reductions go out before any gather here
        if self.phase is Phase.BACKWARD:  # recomputation under activation checkpointing
            self.gather_for_recompute(unit, torch.is_grad_enabled())
            return
        if unit is self.root:
            self.check_state()
            self._train_unfrozen()
            self.phase = Phase.FORWARD
            self.schedule.begin_forward()
            self.order.begin()
            self.saved.stop()  # left over from a forward that raised
            # Released buffers wait in the pool for the next unit of their size, until
            # backward's last gather (no allocation, on CPU no page faults).
            self.pool.holding = True
        if torch.is_grad_enabled():
            self.saved.start(unit)
        self.order.reached(unit)
        self.ensure_gathered(unit, backward=False)
        unit.use_full(torch.is_grad_enabled())
        # After this unit's own gather: it computes first, and the next unit's gather then
        # overlaps that compute.
        self._prefetch(unit, backward=False)

    @untransformed
    def _post_forward(self, unit: Unit, output: Any) -> Any:
        if self.phase is Phase.BACKWARD:
            return output
        if unit is self.saved.owner:
            self.saved.stop()
        grad = torch.is_grad_enabled()
        # The units that run last in forward run first in backward: keep them gathered.
        kept = self._forward_kept if grad else set()
        release = (
            unit is not self.root
            and unit.index not in kept
            and self.release_after_forward(unit, grad)
        )
        if grad or release:
            output = self._outputs(unit, output, grad, release)
        if release:
            unit.reshard()
        if unit is self.root:
            last = self.order.last if grad else None
            if last is not None:
                kept = kept | {last.index}
            for u in self.units[1:]:
                if (
                    u.state is not ShardState.SHARDED
                    and u.index not in kept
                    and self.release_after_forward(u, grad)
                ):
                    u.reshard()
            self.schedule.end_forward(grad and self._backward_gathers_nothing())
            if last is not None:  # backward starts with it: stage the unit it gathers next
                self._stage_after(last, backward=True)
            if len(self.order.reached_units) > 1:
                kept = {self.order.reached_units[-1].index, *self.schedule.last_bucket()}
                self._forward_kept = kept - {self.root.index}  # kept after forward anyway
            else:
                self._forward_kept = set()
            self.order.learn(backward=False)
            self.phase = Phase.IDLE
            if not self.gathered_depth:  # outside forward a module's parameters are its pieces
                for u in self.units:
                    u.hide_views()
        return output

    def _backward_gathers_nothing(self) -> bool:
        """Whether the backward of the forward just ended cannot need a gather: no reductions
        are deferred, and every unit that ran is gathered, current, and kept until its
        backward (stage 2; stage 3 kept after forward, or whose units all fit in the final
        bucket)."""
        return not self.strategy.defer_reductions and all(
            u.state is ShardState.GATHERED and not u.is_stale and not u.stage3_lifetime
            for u in self.order.reached_units
        )

    def release_after_forward(self, unit: Unit, grad: bool) -> bool:
        """Whether ``unit``'s gathered parameters go once its forward returns (a unit with
        stage 3's lifetime goes at every stage); inside ``keep_gathered()``, a forward without
        a graph leaves its units gathered."""
        release = self.strategy.release_after_forward(grad_enabled=grad) or unit.stage3_lifetime
        return release and not (self.keeping and not grad)

    def _outputs(self, unit: Unit, output: Any, grad: bool, release: bool) -> Any:
        """``unit``'s output, hooked so that the unit is gathered again before backward needs
        it (``grad``); where the unit is released now (``release``), a tensor in it that views
        the unit's gathered parameters (a module returning its own weight, in any container or
        object) becomes a copy, which backward differentiates as the view."""
        root, index = weakref.ref(self), unit.index  # weakly: see _hook_inputs

        @eager
        def pre_backward(grad: Tensor) -> None:
            live = root()
            if live is not None:
                with label("pre_backward"):
                    live._pre_backward(live.units[index])

        def visit(t: Tensor) -> Tensor:
            if release and self._views_gathered(unit, t):
                t = t.clone()
            if grad and t.requires_grad:
                t.register_hook(pre_backward)
            return t

        return map_outputs(output, visit)

    def _views_gathered(self, unit: Unit, t: Tensor) -> bool:
        """Whether ``t`` views one of ``unit``'s gathered buffers."""
        try:
            group = self.pool.holder.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without plain storage
            return False
        return group is not None and self._unit_of.get(id(group)) is unit

    def _hook_inputs(self, unit: Unit, inputs: Any) -> None:
        """Count this call's input gradients, so frozen groups are released once they exist.

        A frozen group has no gradient to tell when backward is done with it; the unit's
        backward is done once the gradients of all its inputs are computed.
        """
        tensors = [t for t in tree_flatten(inputs)[0] if isinstance(t, Tensor) and t.requires_grad]
        if not tensors:
            return
        unit.progress.inputs_pending += 1
        # Weakly: torch keeps this hook in a cycle through the autograd graph (the hook holds
        # the inputs' grad_fns, which hold the hook) that only the garbage collector breaks,
        # and late; held strongly, the whole model would wait for it.
        root, index = weakref.ref(self), unit.index

        @eager
        def on_inputs_done(grads: Any) -> None:
            live = root()
            if live is not None:
                live._inputs_done(index)

        torch.autograd.graph.register_multi_grad_hook(tensors, on_inputs_done, mode="all")

    def _inputs_done(self, index: int) -> None:
        unit = self.units[index]
        unit.progress.inputs_pending -= 1
        if self.phase is Phase.BACKWARD:
            unit.release_if_done()

    def _train_unfrozen(self) -> None:
        """Frozen groups with a parameter unfrozen since (``requires_grad_(True)``: progressive
        unfreezing) train from this forward on, as a plain model's parameters would."""
        if not any(p.requires_grad for _, g in self._frozen for p in g.shard_params):
            return
        still = []
        for unit, g in self._frozen:
            if any(p.requires_grad for p in g.shard_params):
                g.start_training()
                unit.hook_grad(g)
                self.note_change(self.reductions.order.index(g))
            else:
                still.append((unit, g))
        self._frozen = still
        self.reductions.refresh()
        self.reductions.reset()

    def note_change(self, value: int) -> None:
        """Fold a change made to the model since wrapping into the hash every handshake checks
        is the same on every rank (``Schedule.changes``)."""
        schedule = self.schedule  # + 1: a change of value 0 (zeros assigned) still counts
        schedule.changes = (schedule.changes * 1_000_003 + value + 1) % (1 << 61)

    # backward ------------------------------------------------------------------------

    def enter_backward(self) -> None:
        """Begin backward, unless it has begun: the first pre-backward or gradient hook."""
        if self.phase is Phase.BACKWARD:
            return
        self.check_state()
        for unit in self.units:
            for g in unit.trainable:
                g.drop_cleared()  # what zero_grad() cleared since a backward under no_sync
        self.phase = Phase.BACKWARD
        self.order.begin()
        for unit in self.units:
            for g in unit.trainable:
                # Told now, a group releases itself once backward last reads its views, and
                # lands the reduction in flight: both before its flat gradient is allocated.
                g.begin_backward(self.reductions.drain)
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _pre_backward(self, unit: Unit) -> None:
        self.enter_backward()
        if not unit.begin_backward():
            return
        self.order.reached(unit)
        if self.strategy.offers_reductions_in_backward:
            # No gather's handshake will carry the reductions ready so far: offer them here,
            # so they overlap this unit's backward.
            self.schedule.offer_reductions()
        self.ensure_gathered(unit, backward=True)
        if self.order.after(unit, backward=True) is not None:
            # A backward agreed to gather nothing holds every unit it runs: one to prefetch did
            # not run on this rank this time, and gathering it would break the agreement.
            if not self.schedule.gathers_nothing_in_backward:
                self._prefetch(unit, backward=True)
        else:  # nothing more to gather in this backward: keep no spare buffers
            self.pool.holding = False
            self.pool.trim()

    @eager
    def _end_backward(self) -> None:
        """The callback autograd runs once backward is done: release what is still gathered,
        reduce what is left and land every gradient (``Schedule.finish_backward``)."""
        with label("end_backward"):
            self._finish_backward()

    def _finish_backward(self) -> None:
        for unit in self.units:
            if unit.state is not ShardState.SHARDED:
                unit.after_backward()
        # Only a backward that reduces shares buffers (DDP's forward after a synced one).
        moved = self.buffers.moved() if self.reductions.sync else []
        if self.schedule.finish_backward(any(moved)):
            self.buffers.share(moved)
        if self.reductions.sync and any(self.schedule.used_anywhere):
            # The optimizer steps next, and not every write to a shard is counted in its
            # version counter (a fused optimizer's are not); a unit that stays gathered
            # gathers again before it is next read. A backward that gave no parameter a
            # gradient (torch.autograd.grad of inputs: a gradient penalty) leaves them be, so
            # a graph it made over the gathered buffers stays valid; an optimizer step after
            # it marks what it steps (``engine/optim/whole_params.py``).
            for unit in self.units:
                for g in unit.trainable:
                    g.mark_stale()
        if not self.reductions.sync:
            for unit in self.units:
                for g in unit.trainable:
                    g.show_pending(self.reductions.as_grads_of(g))
        self.order.learn(backward=True)
        self._leave_backward()
        if self.optimizers is not None:  # an optimizer steps next: hook any new one
            self.check_state()
            self.optimizers.find()

    def _leave_backward(self) -> None:
        """Forget what one backward counted, however it ended, and return to IDLE."""
        self.pool.trim_scratch()
        for unit in self.units:
            unit.end_backward()
        self.phase = Phase.IDLE

    def settle(self) -> None:
        """Clean up after a backward that raised, once autograd is no longer running.

        An exception in backward (a hook, a loss function) stops autograd before the end-of-
        backward callback runs. The next forward, save or load then starts clean: reductions
        in flight are waited for and dropped, flat gradients and buffers are released, and
        the shard gradients keep what earlier, completed backwards gave them.
        """
        if self.phase is not Phase.BACKWARD or torch._C._current_graph_task_id() != -1:
            return
        # First: peers of a backward without handshakes wait on this rank's reductions.
        self.schedule.abandon_backward()
        self.reductions.drain()
        self.reductions.reset()
        for unit in self.units:
            unit.reshard()
            for g in unit.trainable:
                g.drop_grad()
        self.saved.stop()
        self._leave_backward()

    def check_state(self) -> None:
        """Before a forward, a backward or a call that reads or writes every unit: the home
        checks itself (``Home.check``: the host tier's copies in flight finish; the disk tier's
        files are checked, raising ``StoreError`` naming a file that was deleted, replaced or
        truncated, before anything touches its mapping)."""
        self.home.check()

    # gathering -----------------------------------------------------------------------

    def ensure_gathered(self, unit: Unit, backward: bool) -> None:
        if unit.state is ShardState.GATHERING and not unit.is_stale:
            unit.finish_gather()
        if unit.state is ShardState.GATHERED and not unit.is_stale and unit.holds_buffers:
            return
        self._stage_after(self.schedule.gather(unit, backward)[-1], backward)
        unit.finish_gather()

    def gather_for_recompute(self, unit: Unit, grad: bool) -> None:
        """Show ``unit``'s full parameters to a recomputation in backward (activation
        checkpointing, of the unit or of a part of it), reusing backward's gather; made outside
        a selective checkpoint's replay (:func:`apart_from_replay`)."""
        with apart_from_replay():
            self.ensure_gathered(unit, backward=True)
            unit.use_full(grad)

    def _prefetch(self, current: Unit, backward: bool) -> None:
        nxt = self.order.after(current, backward)
        if nxt is not None and (nxt.state is ShardState.SHARDED or nxt.is_stale):
            self._stage_after(self.schedule.gather(nxt, backward)[-1], backward)

    def _stage_after(self, unit: Unit, backward: bool) -> None:
        """``unit`` is being gathered: have the home start moving the unit expected after it
        to the compute device (the host tier's copies, the disk tier's reads; nothing for a
        home on the device).

        With prefetch that is two units ahead of the one about to compute, so the copy has a
        whole unit's compute to hide behind before its gather waits for it.
        """
        following = self.order.after(unit, backward)
        if following is None:
            following = self.units[(unit.index + (-1 if backward else 1)) % len(self.units)]
        if following.state is ShardState.SHARDED or following.is_stale:
            self.home.read_ahead([g.shard for g in following.groups])

    # outside forward -----------------------------------------------------------------

    def gathered(
        self, writeback: bool, modifier_rank: int | None = None, with_grads: bool = False
    ) -> Any:
        """Gather every unit, expose full parameters (and their whole gradients), optionally
        write edits back: those every rank made alike, or ``modifier_rank``'s
        (``engine/step/edits.py``)."""
        self.settle()
        if self.phase is not Phase.IDLE:
            raise RuntimeError("shardwrap: gathered() cannot be entered during forward or backward")
        return gathered_block(self, writeback, modifier_rank, with_grads)

    @contextmanager
    def keep_gathered(self) -> Iterator[None]:
        """Forwards without a graph leave their units gathered until the block ends (one gather
        per unit for a whole ``generate()`` or evaluation); then, where the strategy releases
        parameters after forward, every unit is released."""
        self.keeping += 1
        try:
            yield
        finally:
            self.keeping -= 1
            if not self.keeping and self.phase is Phase.IDLE:
                for unit in self.units:
                    if unit.state is not ShardState.SHARDED and self.release_after_forward(
                        unit, grad=False
                    ):
                        unit.reshard()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Skip gradient reduction; gradients accumulate unsharded until sync resumes."""
        previous, self.reductions.sync = self.reductions.sync, False
        try:
            yield
        finally:
            self.reductions.sync = previous
