"""The order of collectives: agreed across ranks, so ranks that run different modules never hang.

Design note. Collectives on one process group pair up by issue order, so every rank must
issue the same sequence. Ranks that take different branches, skip a module or call one
twice would not; ZeRO-3 implementations that issue collectives straight from module hooks
hang or, worse, pair the all-gather of one unit with that of another.

Here each rank, before it gathers a unit that is not already gathered, takes part in a
handshake: one all-reduce (MIN) of a few integers. Each rank puts in

1. the priority of what it wants next: a unit's index in forward, its reverse index in
   backward, nothing but the reductions ready so far (when backward gathers nothing, as at
   stage 2, this keeps reductions overlapping backward), or an end-of-phase marker (which
   sorts last);
2. how many reduce-scatters, in the canonical order, it has gradients ready for;
3. in backward, for every trainable flat group, whether it used the group at all;
4. how many forward passes of the whole model it has begun, and which call it is in
   (training, or one every rank makes together outside it: a save, a load, a gradient norm,
   which enter through :meth:`Schedule.enter`): every rank must be in the same pass and call.
   A rank that caught an exception and went on to its next batch (the usual recovery
   from running out of memory) would otherwise pair its next step's collectives with the
   others' current ones. In training, every rank's pass must also record a graph or none:
   an evaluation forward on one rank alone (``if rank == 0:``) would otherwise pair its
   gathers with a peer's training forward. On a difference every rank learns what every
   other was doing (one more small all-reduce) and raises, naming it; all then count from
   the furthest rank, so that the next step, begun on every rank, agrees again;
5. in a pass that records a graph, whether its backward reduces gradients (``no_sync``,
   ``require_backward_grad_sync``): a backward reducing on some ranks only would wait for
   the others for good, so a difference raises on every rank.

All ranks then gather the unit with the smallest priority (those that wanted something
else serve the request and ask again), and issue the reduce-scatters that every rank has
ready. The reductions themselves, their canonical order and how many are in flight belong to
the reduction pipeline (``engine/step/reduce.py``). A rank that never used a unit sends zeros for it
at the end of backward.

A forward pass agrees once, not once per unit. The all-gathers of a forward are recorded (every
rank's list is the same: agreed collectives are). The first handshake of the next pass carries
that list as a proposal; when every rank proposes the same list and wants its first gather, the
rest of the list is the pass's plan: each rank issues the planned gathers in order as it needs
them, without a handshake. A rank that needs a gather other than the next planned one, leaves
the pass part-way or reaches any handshake (the end of forward at the latest) first issues the
rest of the plan (as for a peer's request: a unit it holds gathered is exchanged into a spare
buffer, one it does not is gathered and released), so that every rank issues the same
exchanges in the same order and peers still following the plan are never left waiting; then it
asks as above. The pass count and the call are still checked at the first handshake and at the
end of every forward.

Gathers go out in buckets (``comm/buckets.py``): a planned gather brings the plan's next
units with it while they fit in the bucket, another gather agreed in forward the units after it,
and one agreed in backward the units before it; a rank that serves the rest of a plan, or a
peer's request, issues the same buckets.

A backward that gathers nothing (stage 2, and stage 3 kept after forward or whose units all fit
in the final bucket: every unit that ran is held gathered and current at the end of forward;
backward then prefetches nothing) needs no handshake to order its collectives:
its only exchanges on the group are the reductions, in the canonical order. When every rank says
so at the end-of-forward handshake, each rank issues its reductions as its gradients complete
and makes one handshake, at the end of backward, after issuing the rest (zeros where unused).
A rank whose backward raised issues the rest as well before it goes on, so peers waiting on a
reduction are not left waiting.

With world size 1 there is nobody to agree with: gathers and reductions go straight out.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from ...comm.buckets import Gathers, bucket_size, last_bucket
from ...comm.collectives import CommStats, all_reduce
from ...comm.mesh import Mesh
from ..optim.shard_grad import INF_CHECK, NORM, WHOLE_STEP
from ..shards.unit import ShardState, Unit
from .full_grads import WITH_GRADS
from .reduce import Reductions

__all__ = ["CALLS", "Schedule"]

# What a rank can be doing in a handshake: training (gathers, reductions), or a call every rank
# makes together outside it. The index is what goes on the wire.
CALLS = (
    "training",
    "save_checkpoint",
    "load_checkpoint",
    "export",
    "load_pretrained",
    "full_state_dict",
    "gathered",
    NORM,
    "save_pretrained",
    "full_optimizer_state_dict",
    INF_CHECK,
    "copy.deepcopy",
    WITH_GRADS,
    WHOLE_STEP,
)


class Schedule:
    """Orders one model's gathers and gradient reductions identically on every rank.

    Args:
        units: every unit of the model; ``units[i].index == i``.
        mesh: the model's groups; handshakes run on its control group, ideally a group of its
            own over the same ranks, so that a handshake never queues behind bulk transfers.
        stats: collective counters shared by the whole model.
        reductions: the model's reduction pipeline.
        bucket_bytes: the most bytes of full buffers one exchange gathers for several units
            (``comm/buckets.py``).
    """

    def __init__(
        self,
        units: list[Unit],
        mesh: Mesh,
        stats: CommStats,
        reductions: Reductions,
        bucket_bytes: int = 0,
    ) -> None:
        self.units = units
        self.bucket_bytes = bucket_bytes
        self.mesh = mesh
        self.stats = stats
        self.reductions = reductions
        # Read once: every gather asks, and the mesh asks the process groups each time.
        self.world = mesh.world_size
        # unit index -> bytes its gather holds (fixed at wrapping), which buckets are cut by
        self._nbytes = [u.gather_nbytes for u in units].__getitem__
        n = len(units)
        self.reduce_only_priority = 2 * n
        self.end_forward_priority = 2 * n + 1
        self.end_backward_priority = 2 * n + 2
        self.enter_priority = 2 * n + 3
        self._used_anywhere: list[bool] = []
        self.passes = 0  # forward passes of the whole model begun on this rank
        # Whether the last pass begun records a graph: every rank's must, or none (a forward
        # of evaluation on one rank met by a training forward on another is out of step).
        self.forward_grad = True
        # Every unit is gathered on every rank for a while (engine/step/inference.py): forwards
        # need no handshake, and ranks may run different numbers of them.
        self.decoding_alone = False
        self._entered = (-1, 0)  # (passes, index in CALLS) of the last call entered
        # The forward plan (see the note above): unit indices of the gathers agreed at this
        # pass's first handshake, the next one at ``_plan_at``; this pass's gathers so far
        # (``None`` outside a forward pass); the last complete pass's; whether this pass has
        # yet to make its first handshake. A proposal fills ``_slots`` entries.
        self._plan: list[int] = []
        self._plan_at = 0
        self._recorded: list[int] | None = None
        self._last: list[int] = []
        self._proposing = False
        self._slots = 2 * n
        # Whether, at the end of this backward, some rank gave some parameter of a group it
        # used no gradient: the groups' parameters with a gradient are then agreed too.
        self._partial_anywhere = False
        # Agreed at the end of backward: whether some rank changed a buffer since the buffers
        # were last shared (``engine/step/buffers.py``).
        self._buffers_moved_anywhere = False
        # A running hash of what changed in the model since it was wrapped (a frozen parameter
        # that trains now, a parameter assigned anew: ``Root.note_change``); every handshake
        # checks that it is the same on every rank.
        self.changes = 0
        self._no_proposal = [-1] * (1 + self._slots) + [1] * (1 + self._slots)

    # gathers -------------------------------------------------------------------------

    def begin_forward(self) -> None:
        """A forward pass of the whole model begins on this rank.

        What a pass left part-way had still planned is issued first: peers that went on with
        that pass wait for it.
        """
        self._serve_plan()
        if self._recorded is not None:  # the last pass did not end: propose nothing
            self._last = []
        self._recorded = []
        self._proposing = True
        self.passes += 1
        self.forward_grad = torch.is_grad_enabled()

    def gather(self, unit: Unit, backward: bool) -> list[Unit]:
        """Start gathering ``unit`` and the units of its bucket (``comm/buckets.py``) once
        every rank has agreed to (at this pass's first handshake, where ``unit`` is the next
        gather of the forward plan).

        Returns:
            The units now gathering, ``unit`` first.
        """
        if self.world == 1:
            unit.start_gather()
            return [unit]
        if backward or not self._planned_next(unit):
            n = len(self.units)
            # Backward asks by reverse index, after every forward request: the MIN serves the
            # unit it needs first, the last unit of forward.
            self._negotiate(2 * n - 1 - unit.index if backward else unit.index)
        if backward:
            units = self._backward_bucket(unit)
        elif self._planned_next(unit):  # planned, or the plan agreed just now begins with it
            units = self._take_planned()
        else:
            units = self._forward_bucket(unit)
        if not backward and self._recorded is not None:
            self._recorded.extend(u.index for u in units)
        self._issue(units, serving=False)
        return units

    @property
    def gathers_nothing_in_backward(self) -> bool:
        """Whether every rank agreed at the end of forward that this backward gathers nothing
        (it reduces without handshakes)."""
        return self.reductions.without_handshakes

    def offer_reductions(self) -> None:
        """Issue the reductions every rank has ready, gathering nothing (one handshake; none
        where this backward reduces without them)."""
        if self.world > 1 and not self.reductions.without_handshakes:
            self._negotiate(self.reduce_only_priority)

    def end_forward(self, gathers_nothing_after: bool = False) -> None:
        """Serve peers' remaining gathers of this forward before moving on; its gathers are
        the next pass's proposal. With ``gathers_nothing_after`` on every rank (the backward
        to come gathers nothing), that backward reduces without handshakes. Nothing to serve
        while every unit is gathered on every rank (``alone``)."""
        if self.world > 1 and not self.decoding_alone:
            self._negotiate(self.end_forward_priority, alone=gathers_nothing_after)
            self._last, self._recorded = self._recorded or [], None

    def enter(self, call: str) -> None:
        """Before ``call``, made by every rank together outside training: one handshake that
        every rank is making it, after the same number of forward passes.

        Raises:
            RuntimeError: on every rank, when some rank is elsewhere (naming what each does).
        """
        self._entered = (self.passes, CALLS.index(call))
        if self.world > 1:
            self._negotiate(self.enter_priority, CALLS.index(call))

    def whereabouts(self, phase: str) -> str:
        """This rank's step and ``phase`` ("forward", "backward", "idle"), for the message of
        a collective that failed: the count of forward passes begun, and outside forward and
        backward the last call this rank began of those every rank makes together (a save, a
        load, ...) since the pass began: the others may not have begun it."""
        if phase == "forward":
            return f"in forward pass {self.passes}"
        if phase == "backward":
            return f"in the backward of forward pass {self.passes}"
        passes, call = self._entered
        since = (
            f"; last call begun here of those every rank makes together: {CALLS[call]}"
            if passes == self.passes
            else ""
        )
        if self.passes == 0:
            return f"before the first forward pass{since}"
        return f"after forward pass {self.passes}, outside forward and backward{since}"

    def _negotiate(
        self, want: int, call: int = 0, alone: bool = False, buffers_moved: bool = False
    ) -> None:
        reductions = self.reductions
        self._serve_plan()  # peers still following the plan wait for its rest, not for this
        groups = len(reductions.used)
        while True:
            ready = reductions.ready_prefix()
            used = [-int(u) for u in reductions.used]
            partial = want == self.end_backward_priority and reductions.partial()
            changes, grad = self.changes, int(self.forward_grad)
            sync = int(reductions.sync or not grad)  # a forward without grad reduces nothing
            header = [want, ready, self.passes, -self.passes, call, -call, int(alone)]
            header += [-int(partial), -int(buffers_moved), changes, -changes]
            header += [grad, -grad, sync, -sync]
            proposal = self._proposal(want, call)
            t = torch.tensor(header + used + proposal, dtype=torch.int64)
            t = t.to(self.mesh.control_device)
            all_reduce(t, self.mesh.control, dist.ReduceOp.MIN, self.stats, kind="handshake").wait()
            agreed, ready, fewest, neg_most, low_call, neg_high_call, all_alone, *rest = t.tolist()
            any_partial, any_moved, low_changes, neg_high_changes, *rest = rest
            low_grad, neg_high_grad, low_sync, neg_high_sync, *rest = rest
            training = low_call == 0 == neg_high_call
            if (
                fewest != -neg_most
                or low_call != -neg_high_call
                or (training and low_grad != -neg_high_grad)
            ):
                self._desynchronized(want, call, -neg_most)
            if training and low_sync != -neg_high_sync:
                raise RuntimeError(
                    "shardwrap: gradient synchronisation differs across ranks: some ranks are "
                    "inside no_sync() or set model.require_backward_grad_sync = False, the others "
                    "not, so a backward would reduce gradients on some ranks only and wait for "
                    "the others for good. Set it alike on every rank, before the forward (DDP's "
                    "gradient accumulation: model.require_backward_grad_sync = (micro_step == "
                    "steps - 1), on every rank)."
                )
            if low_changes != -neg_high_changes:
                raise RuntimeError(
                    "shardwrap: the model changed differently across ranks since it was wrapped: "
                    "a parameter was assigned (module.weight = nn.Parameter(...)), to values "
                    "that differ, or unfrozen (requires_grad_(True)) on some ranks only. Make "
                    "the same change on every rank, with the same values; to load values on "
                    "one rank, write them inside model.gathered(modifier_rank=0)."
                )
            # Every rank learnt the same count: issue now, whichever request won, so that each
            # rank's reductions and gathers interleave alike.
            reductions.issue(ready)
            if agreed == want:
                self.reductions.without_handshakes = all_alone == 1
                self._partial_anywhere = any_partial < 0
                self._buffers_moved_anywhere = any_moved < 0
                self._used_anywhere = [u < 0 for u in rest[:groups]]
                self._accept(proposal, rest[groups:])
                return
            if agreed >= self.end_forward_priority:
                raise RuntimeError(
                    "shardwrap: ranks disagree on the training phase: some ranks finished "
                    "forward while others finished backward. Every rank must run the same "
                    "number of forward and backward passes, and enter no_sync() alike."
                )
            self._serve(agreed)

    def _desynchronized(self, want: int, call: int, most: int) -> None:
        """Every rank is here at once: share what each was doing, then raise alike."""
        mesh = self.mesh
        rows = torch.zeros(mesh.world_size, 4, dtype=torch.int64)
        rows[mesh.rank] = torch.tensor([self.passes, want, call, int(self.forward_grad)])
        rows = rows.to(mesh.control_device)
        all_reduce(rows, mesh.control, dist.ReduceOp.SUM, self.stats, kind="handshake").wait()
        self.passes = most
        doing = "; ".join(
            f"rank {r}: forward pass {p}, {self._describe(w, c, bool(g))}"
            for r, (p, w, c, g) in enumerate(rows.tolist())
        )
        raise RuntimeError(
            f"shardwrap: ranks are at different steps or calls ({doing}). Every rank must run "
            "every forward and backward pass and make the same calls (save_checkpoint, "
            "full_state_dict, clip_grad_norm_, ...) in the same order. Likely causes: a "
            "forward, an evaluation, a generation or a save under 'if rank == 0:' (or 'if "
            "master_process:'): run it on every rank and print or write on rank 0 only; a "
            "decision taken on each rank's own numbers (save if the loss is the best yet): "
            "all_reduce the numbers first, so every rank decides alike; a rank that left a "
            "step part-way (an exception caught, the loop gone on to its next batch): to skip "
            "a batch, decide it on every rank alike (all_reduce an 'out of memory' flag). See "
            "docs/ddp.md. What was under way is abandoned on every rank; the next step, begun "
            "on every rank, runs normally."
        )

    def _describe(self, want: int, call: int = 0, grad: bool = True) -> str:
        if call:
            return f"calling {CALLS[call]}"
        n = len(self.units)
        forward = "forward" if grad else "a forward without grad (evaluation, generation)"
        if want == self.end_forward_priority:
            return f"ending {forward}"
        if want < n:
            return f"gathering unit {want} ({type(self.units[want].module).__name__}) for {forward}"
        if want < 2 * n:
            unit = self.units[2 * n - 1 - want]
            return f"gathering unit {unit.index} ({type(unit.module).__name__}) for backward"
        return {
            self.reduce_only_priority: "reducing gradients in backward",
            self.end_backward_priority: "ending backward",
        }[want]

    def _proposal(self, want: int, call: int) -> list[int]:
        """This handshake's part of the forward plan: at a pass's first handshake, for a gather
        that the last complete pass began with, that pass's gathers (each entry, then each
        negated, so that one MIN tells whether every rank sent the same); else no proposal."""
        last, proposing = self._last, self._proposing
        self._proposing = False
        if not proposing or call or not last or last[0] != want or len(last) > self._slots:
            return self._no_proposal
        entries = [len(last), *last, *[-1] * (self._slots - len(last))]
        return entries + [-e for e in entries]

    def _accept(self, proposal: list[int], agreed: list[int]) -> None:
        """Adopt the plan when every rank proposed the same gathers (see the note above); its
        first entry is the gather this handshake agreed."""
        half = 1 + self._slots
        if proposal is self._no_proposal or agreed[:half] != [-e for e in agreed[half:]]:
            return
        self._plan, self._plan_at = list(self._last), 0

    def last_bucket(self) -> list[int]:
        """The units of the last complete forward's final bucket (none where no forward was
        recorded: world size 1, or before the first)."""
        return last_bucket(self._last, self._nbytes, self.bucket_bytes)

    def _planned_next(self, unit: Unit) -> bool:
        return self._plan_at < len(self._plan) and self._plan[self._plan_at] == unit.index

    def _take_planned(self) -> list[Unit]:
        """The plan's next bucket; the plan moves past it."""
        rest = self._plan[self._plan_at :]
        count = bucket_size(rest, self._nbytes, self.bucket_bytes)
        self._plan_at += count
        return [self.units[i] for i in rest[:count]]

    def _forward_bucket(self, unit: Unit) -> list[Unit]:
        """``unit`` and the units after it, in the order of units, that share its bucket (a
        gather agreed outside a plan: a pass's first, generation's)."""
        candidates = list(range(unit.index, len(self.units)))
        count = bucket_size(candidates, self._nbytes, self.bucket_bytes)
        return [self.units[i] for i in candidates[:count]]

    def _backward_bucket(self, unit: Unit) -> list[Unit]:
        """``unit`` and the units before it, down to unit 1, that share its bucket."""
        candidates = list(range(unit.index, 0, -1)) or [unit.index]
        count = bucket_size(candidates, self._nbytes, self.bucket_bytes)
        return [self.units[i] for i in candidates[:count]]

    def _serve_plan(self) -> None:
        """Issue the rest of the forward plan, bucket by bucket, as the ranks following it do
        (they wait for these gathers)."""
        while self._plan_at < len(self._plan):
            units = self._take_planned()
            if self._recorded is not None:
                self._recorded.extend(u.index for u in units)
            self._issue(units, serving=True)
        self._plan, self._plan_at = [], 0

    def _serve(self, priority: int) -> None:
        """Take part in the gathers a peer's request was agreed for, as that peer issues them."""
        if priority == self.reduce_only_priority:
            return
        n = len(self.units)
        if priority < n:
            units = self._forward_bucket(self.units[priority])
            if self._recorded is not None:
                self._recorded.extend(u.index for u in units)
        else:
            units = self._backward_bucket(self.units[2 * n - 1 - priority])
        self._issue(units, serving=True)

    def _issue(self, units: list[Unit], serving: bool) -> None:
        """Gather ``units`` in one exchange where their sizes allow (``comm/buckets.py``).

        A unit this rank holds as the gather would leave it takes part into spare buffers; when
        serving a peer, a unit that was sharded is gathered and released again.
        """
        batch = Gathers(self.stats, self.bucket_bytes)
        apart: list[Callable[[], None]] = []
        served: list[Unit] = []
        started: list[Unit] = []
        try:
            for unit in units:
                if (
                    unit.state is not ShardState.SHARDED
                    and not unit.is_stale
                    and unit.holds_buffers
                ):
                    apart.append(unit.gather_apart(batch))
                    continue
                if serving and unit.state is ShardState.SHARDED:
                    served.append(unit)
                started.append(unit)
                unit.start_gather(batch=batch)
            batch.issue()
        except BaseException:  # nothing went out: no unit may count on this exchange
            for unit in started:
                unit.abandon_gather()
            raise
        finally:
            for done in apart:  # only now: each waits for its part of the exchange just issued
                done()  # (or, where it raised, only gives its spare buffer back)
        for unit in served:
            unit.finish_gather()
            unit.reshard()

    # reductions ----------------------------------------------------------------------

    def finish_backward(self, buffers_moved: bool) -> bool:
        """End of backward: reduce what is left (zeros where unused) and wait for all of it.

        Returns:
            Whether some rank said ``buffers_moved`` (``engine/step/buffers.py``): told in the
            last handshake, so every rank returns the same.
        """
        reductions = self.reductions
        self._used_anywhere = reductions.close()
        if self.world > 1:
            self.abandon_backward()  # without handshakes: the rest goes out before the last
            self._negotiate(self.end_backward_priority, buffers_moved=buffers_moved)
            seen = self._seen_anywhere() if self._partial_anywhere else None
        else:
            reductions.issue(reductions.ready_prefix())
            seen = [s or [] for s in reductions.seen]
            self._buffers_moved_anywhere = False
        reductions.finish(self._used_anywhere, seen)
        return self._buffers_moved_anywhere

    @property
    def used_anywhere(self) -> list[bool]:
        """Per group, whether any rank used it in the backward just finished (or under
        ``no_sync`` since its last reduction)."""
        return self._used_anywhere

    def _seen_anywhere(self) -> list[list[bool]]:
        """Per group, which parameters any rank gave a gradient in what it reduced now (one
        small all-reduce, made only where some rank left a parameter of a used group without
        one)."""
        reductions = self.reductions
        seen = [s or [False] * len(g.names) for s, g in zip(reductions.seen, reductions.order)]
        flat = torch.tensor([int(x) for s in seen for x in s], dtype=torch.int64)
        flat = flat.to(self.mesh.control_device)
        all_reduce(flat, self.mesh.control, dist.ReduceOp.MAX, self.stats, kind="handshake").wait()
        values, out = flat.tolist(), []
        for s in seen:
            out.append([v > 0 for v in values[: len(s)]])
            values = values[len(s) :]
        return out

    def abandon_backward(self) -> None:
        """Where this backward reduces without handshakes, issue every reduction not issued yet
        (peers wait on them, not on a handshake); then reduce with handshakes again."""
        if self.reductions.without_handshakes:
            self.reductions.close()
            self.reductions.issue(self.reductions.ready_prefix())
            self.reductions.without_handshakes = False
