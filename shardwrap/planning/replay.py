"""The planner's replay: the engine's buffers over one traced training step, event by event.

Design note. The meta run (``planning/trace.py``) gives activations at each unit boundary
and each parameter's gradient. Here the engine's own decisions are replayed on top, in the
order its hooks take them (``engine/step/root.py``, ``engine/step/schedule.py``,
``engine/step/reduce.py``, ``engine/shards/pool.py``, ``tiers/home.py``), for rank 0 (which holds
the most elements). Every lifetime is asked of the engine's ``Strategy`` and every pooled buffer of
its pool's policy (``Spares``, its buffers here the keys whose bytes are counted), so that the plan
follows a
change to either:

- gathers take full buffers from the pool; it hands out a spare flat gradient first, then a
  spare gathered buffer of the same size and dtype, and allocates only when it has neither;
  released buffers become spares (two per size) until the last unit of backward is gathered;
  stages 1 and 2 keep their full buffers (the shard a slice of them where they compute in its
  dtype) and gather into them again after each step;
- a group's flat gradient is made once its parameters' gradients all exist, after its
  gathered buffer is released (stage 3) and the reduction in flight has landed; reductions
  are issued in the canonical order where every rank agrees (handshakes: each gather, and
  each unit's backward at stage 2; at once on one rank; at the end of backward at stage 1),
  one in flight; a reduced flat gradient becomes a spare until backward ends;
- reduced shards land where the tier keeps them: as the ``.grad`` (in memory), copied into
  a kept buffer (host tier), or in the disk tier's files;
- the host tier stages a copy of each shard before its gather, read ahead when the unit
  before it is gathered;
- compression (``Compression``): a group whose gathers are quantized keeps no resident buffer
  at stages 1 and 2 (its full buffer is a pooled one, kept), and with error feedback each
  trainable group keeps a full-size residual in its reduction dtype from its first reduction
  on (none at world size 1); each group's packed shard is kept from its gather to the end
  of backward (a trainable group's; a frozen one's for good). The packed payloads in flight
  (about a quarter of a float32 buffer, or less) are not counted.

Three steps are replayed and the peak is the largest of them: the first (no order of units
known yet: no prefetch, every unit released after its forward; the optimizer's state made at
its end), then two in steady state, so that what one step leaves to the next (copies read
ahead, the outputs a training loop keeps until its next forward returns) is in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..comm.buckets import bucket_ends, bucket_size, last_bucket
from ..comm.collectives import packing
from ..comm.quantize import Codec
from ..engine.shards.pool import Spares
from ..engine.step.order import successors
from ..engine.step.reduce import reduces_alone, reduction_order
from ..engine.step.strategy import Strategy
from ..options import Compression
from .step import StepBytes
from .trace import Trace

__all__ = ["Parts", "Tier", "replay"]

Key = tuple[int, torch.dtype]  # a pooled buffer: numel, dtype


def _nbytes(key: Key) -> int:
    return key[0] * key[1].itemsize


@dataclass(frozen=True)
class Tier:
    """Where the shards, their gradients and the optimizer state live."""

    staged: bool = False  # the host tier: shards apart, staged to the compute device
    apart: bool = False  # the host tier's memory is not the compute device's (a GPU)
    disk: bool = False  # the disk tier: in files


@dataclass(frozen=True)
class Parts:
    """The peak's breakdown (bytes), where it fell, and the host memory's own peak."""

    params: int
    grads: int
    optimizer: int
    working_set: int
    activations: int
    phase: str
    host: int
    disk: int


def _made(key: Key) -> Key:
    """A pooled buffer in the replay: its key, all its bytes need."""
    return key


class _Replay:
    """One rank's buffers through the engine's training step."""

    def __init__(
        self,
        tr: Trace,
        strategy: Strategy,
        tier: Tier,
        step: StepBytes,
        device: str,
        compression: Compression | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        self.tr, self.strategy, self.tier = tr, strategy, tier
        self.bucket = bucket_bytes
        quantized = compression is not None and compression.params is not None
        groups = tr.groups
        self.world = groups[0].layout.world_size if groups else 1
        self.units = len(tr.units)
        self.unit_groups = [
            [i for i, g in enumerate(groups) if g.unit == u] for u in range(self.units)
        ]
        self._lifetimes(strategy, tier, quantized)
        self._fixed_bytes(tier, step)
        self.receive_peers = self.world - 1 if device == "cpu" and self.world > 2 else 0
        self.packs = device == "cpu" and self.world > 1  # exchanges of several go packed
        self.unit_full = [sum(groups[g].full for g in ids) for ids in self.unit_groups]
        # the packed shards compressed gathers keep for the next gather, by group
        self.codec = Codec(compression.params, compression.block) if quantized else None
        self.packed: dict[int, int] = {}
        # error feedback's residuals, by group, made at each group's first quantized reduction
        # (a complex gradient is reduced exactly: none)
        self.feedback = (
            compression is not None
            and compression.grads is not None
            and compression.error_feedback
            and self.world > 1
        )
        self.residuals: dict[int, int] = {}
        self._reductions(compression, bucket_bytes)
        # the forward plan: the last forward's gathers (engine/step/schedule.py), this one's so far
        self.plan: list[int] = []
        self.plan_at = 0
        self.recorded: list[int] = []
        # gather exchanges in flight that hold packed buffers: their bytes by id, ids by unit
        self.exchanges: dict[int, int] = {}
        self.exchange_of: dict[int, int] = {}
        self.exchanges_made = 0
        forward = [i for kind, i, _, _ in tr.events if kind == "fwd_pre"]
        self.ran = set(forward)
        backward = list(dict.fromkeys(i for kind, i, _, _ in tr.events if kind == "bwd_pre"))
        # what the first step records for the next: the order of units, the last in forward
        self.learned = successors(forward, int), successors(backward, int)
        self.last = forward[-1] if len(forward) > 1 else None
        self.fwd_next: dict[int, int] = {}
        self.bwd_next: dict[int, int] = {}
        # stay gathered after forward: the last forward's final bucket and the unit that ran last
        self.keep: set[int] = set()
        self.kept_next: set[int] = set()
        self.has_state = False  # the optimizer made its state (at the first step)
        # the engine's state between steps
        self.pool: Spares[Key, Key] = Spares(_made)
        self.buffers: dict[int, Key] = {}  # gathered buffers from the pool, by group
        self.gathered: set[int] = set()
        self.fresh: set[int] = set()  # units gathered since the shards last changed
        self.inputs: dict[int, int] = {}  # unit -> staged copies its gather in flight reads
        self.staged: dict[int, tuple[int, bool]] = {}  # group -> (bytes, fresh) read ahead
        self.grads = 0  # the shard parameters' .grad
        # one backward's gradients
        self.flat: dict[int, Key] = {}  # flat gradients made, not yet reducing
        # exchanges in flight: (group, its flat gradient, shard bytes) each, and their buffers
        self.pending: list[tuple[list[tuple[int, Key, int]], int]] = []
        self.landed = 0  # reduced shards kept until the end of backward
        self.ready: dict[int, bool] = {}
        self.issued, self.closing = 0, False
        self.released: set[int] = set()  # groups whose flat gradient is made
        self.best: tuple[int, ...] = (-1,)
        self.phase = self.best_phase = "forward"
        self.host_peak = 0

    def _lifetimes(self, strategy: Strategy, tier: Tier, quantized: bool) -> None:
        """Which units take stage 3's lifetime, which groups keep their full buffer for good
        (resident) and which keep a pooled one between steps (kept): as the engine decides."""
        groups = self.tr.groups
        self.stage3 = [
            strategy.stage3_lifetime(
                frozen_numel=sum(
                    groups[i].layout.numel for i in ids if not groups[i].requires_grad
                ),
                trainable_numel=sum(groups[i].layout.numel for i in ids if groups[i].requires_grad),
            )
            for ids in self.unit_groups
        ]
        # Stages 1 and 2 keep full buffers (a mostly frozen unit, its trainable ones): the shard
        # is a slice of one in its own dtype (not staged), else the full buffer is a pooled one,
        # kept for good.
        self.resident = [
            strategy.keeps_resident(
                stage3_lifetime=self.stage3[g.unit],
                requires_grad=g.requires_grad,
                same_dtype=g.compute_dtype == g.dtype,
                staged=tier.staged,
                quantized=quantized and g.dtype.is_floating_point,
            )
            for g in groups
        ]
        self.kept = {
            i
            for i, g in enumerate(groups)
            if strategy.keeps_params and not self.stage3[g.unit] and not self.resident[i]
        }

    def _fixed_bytes(self, tier: Tier, step: StepBytes) -> None:
        """What stays allocated between steps, in memory and (the host tier) on the host."""
        groups = self.tr.groups
        shards = sum(g.shard for i, g in enumerate(groups) if not self.resident[i])
        trainable = [g for g in groups if g.requires_grad]
        home_grads = sum(g.kept_grad for g in trainable) if tier.staged else 0
        in_memory = not (tier.disk or tier.apart)
        self.fixed_params = sum(g.full for i, g in enumerate(groups) if self.resident[i])
        self.fixed_params += shards if in_memory else 0
        self.fixed_grads = home_grads if in_memory else 0
        state, step_most = step.state, step.most
        self.state = state if in_memory else 0
        self.step_most = step_most if in_memory else 0
        if tier.disk:  # what the tier does not make in its files is in memory
            self.state = state - step.in_files
            self.step_most = step_most - step.in_files
        self.host_fixed = shards + home_grads if tier.apart else 0
        self.host_state = state if tier.apart else 0
        self.host_step = step_most - state if tier.apart else 0

    def _reductions(self, compression: Compression | None, bucket_bytes: int) -> None:
        """The reductions' order and buckets, by the engine's rules (``engine/step/reduce.py``)."""
        groups = self.tr.groups
        self.order = reduction_order(
            [[i for i in ids if groups[i].requires_grad] for ids in self.unit_groups]
        )
        # the reductions' buckets: where the one beginning at each bucket's first position ends
        flat = [groups[g].flat_grad for g in self.order]
        quantized_grads = compression is not None and compression.grads is not None
        alone = reduces_alone(quantized_grads, self.world)
        self.ends = bucket_ends(flat, 0 if alone else bucket_bytes)

    def key(self, g: int) -> Key:
        return self.tr.groups[g].layout.padded_numel, self.tr.groups[g].compute_dtype

    def grad_key(self, g: int) -> Key:
        return self.tr.groups[g].layout.padded_numel, self.tr.groups[g].grad_dtype

    # accounting ----------------------------------------------------------------------

    def check(self, activations: int) -> None:
        in_flight = sum(_nbytes(k) + out for items, _ in self.pending for _, k, out in items)
        in_flight += sum(extra for _, extra in self.pending)
        parts = (
            self.fixed_params
            + sum(_nbytes(k) for g, k in self.buffers.items() if g in self.kept)
            + sum(self.packed.values()),
            self.fixed_grads
            + sum(_nbytes(k) for k in self.flat.values())
            + in_flight
            + self.landed
            + self.grads
            + sum(self.residuals.values()),
            self.step_most if self.phase == "optimizer step" else self.state * self.has_state,
            sum(_nbytes(k) for g, k in self.buffers.items() if g not in self.kept)
            + sum(_nbytes(k) for k in self.pool.spares())
            + sum(self.exchanges.values())
            + sum(self.inputs.values())
            + sum(n for n, _ in self.staged.values()),
            activations,
        )
        if sum(parts) > sum(self.best):
            self.best, self.best_phase = parts, self.phase
        state = self.host_state + self.host_step if self.phase == "optimizer step" else 0
        self.host_peak = max(
            self.host_peak, self.host_fixed + max(state, self.host_state * self.has_state)
        )

    # gathers --------------------------------------------------------------------------

    def stale(self, u: int) -> bool:
        return u not in self.gathered or u not in self.fresh

    def bucket_of(self, u: int, backward: bool) -> list[int]:
        """``u`` and the units gathered with it (``comm/buckets.py``)."""
        if self.world == 1:
            return [u]
        planned = not backward and self.plan[self.plan_at : self.plan_at + 1] == [u]
        if backward:
            candidates = list(range(u, 0, -1)) or [u]
        elif planned:
            candidates = self.plan[self.plan_at :]
        else:  # outside a plan: the units after it
            candidates = list(range(u, self.units))
        bucket = candidates[: bucket_size(candidates, self.unit_full.__getitem__, self.bucket)]
        if planned:
            self.plan_at += len(bucket)
        return bucket

    def gather(self, u: int, backward: bool, live: int) -> int:
        """Agree, then start gathering ``u`` and its bucket (each unit's staged copies read
        until it finishes); returns the bucket's last unit."""
        self.handshake(live)
        bucket = self.bucket_of(u, backward)
        if not backward and self.world > 1:
            self.recorded.extend(bucket)
        joined, nbytes, spares = [], 0, []
        for v in bucket:
            held = not self.stale(v)  # takes part into spare buffers
            if held:
                self.finish(v)
            for g in self.unit_groups[v]:
                spec = self.tr.groups[g]
                quantized = self.codec is not None and spec.dtype.is_floating_point
                if not quantized and nbytes + spec.full <= self.bucket:
                    joined.append(spec.layout.shard_size * spec.compute_dtype.itemsize)
                    nbytes += spec.full
                if held:
                    self.pool.pop(self.key(g))
                    spares.append(self.key(g))
                    continue
                self.gather_group(v, g, live)
            if not held:
                self.gathered.add(v)
                self.fresh.add(v)
        if len(joined) > 1 and self.packs:  # one exchange: the own shards and the peers'
            self.exchanges_made += 1
            eid = self.exchanges_made
            self.exchanges[eid] = self.world * packing(joined)[1]
            self.exchange_of.update(dict.fromkeys(bucket, eid))
        self.check(live)
        if spares:  # waited for at once; the spares go back
            self.finish(bucket[0])
            for key in spares:
                self.pool.put(key, key)
        return bucket[-1]

    def gather_group(self, u: int, g: int, live: int) -> None:
        if not self.resident[g] and g not in self.buffers:
            self.pool.pop(self.key(g))
            self.buffers[g] = self.key(g)
        spec = self.tr.groups[g]
        if self.codec is not None and spec.dtype.is_floating_point:
            self.packed[g] = self.codec.nbytes(spec.layout.shard_size)
        if self.tier.staged:
            copy, fresh = self.staged.pop(g, (0, False))
            held = self.inputs.get(u, 0)
            # a stale copy is staged afresh while still held
            self.inputs[u] = held + copy + (0 if fresh else spec.shard)
            self.check(live)
            # Peers read the copy until the gather finishes, unless it is cast into its
            # slot of the buffer first.
            reads = self.world > 1 and spec.compute_dtype == spec.dtype
            self.inputs[u] = held + spec.shard * reads

    def finish(self, u: int) -> None:
        self.inputs.pop(u, None)
        eid = self.exchange_of.pop(u, None)
        if eid is not None:  # its exchange is waited for: the packed buffers go
            self.exchanges.pop(eid, None)

    def stage_after(self, u: int, backward: bool, live: int) -> None:
        """The host tier reads ahead the unit expected after ``u``."""
        if not self.tier.staged:
            return
        step = -1 if backward else 1
        following = (self.bwd_next if backward else self.fwd_next).get(u)
        if following is None:
            following = (u + step) % self.units
        if not self.stale(following):
            return
        for g in self.unit_groups[following]:
            old, fresh = self.staged.get(g, (0, False))
            if not fresh:
                self.staged[g] = (old + self.tr.groups[g].shard, True)
                self.check(live)
                self.staged[g] = (self.tr.groups[g].shard, True)

    def ensure_gathered(self, u: int, backward: bool, live: int) -> None:
        self.finish(u)
        if not self.stale(u):
            return
        last = self.gather(u, backward, live)
        self.stage_after(last, backward, live)
        self.finish(u)

    def prefetch(self, successors: dict[int, int], u: int, backward: bool, live: int) -> None:
        nxt = successors.get(u)
        if nxt is not None and self.stale(nxt):
            last = self.gather(nxt, backward, live)
            self.stage_after(last, backward, live)

    def release(self, g: int) -> None:
        if g in self.buffers and g not in self.kept:
            key = self.buffers.pop(g)
            self.pool.put(key, key)

    def reshard(self, u: int, backward: bool) -> None:
        """Release ``u``'s gathered buffers after its forward or backward, if the strategy says."""
        strategy = self.strategy
        if backward:
            release = strategy.release_after_backward
        else:
            release = strategy.release_after_forward(grad_enabled=True)
        if (release or self.stage3[u]) and u in self.gathered:
            self.finish(u)
            for g in self.unit_groups[u]:
                self.release(g)
            self.gathered.discard(u)

    # reductions -----------------------------------------------------------------------

    def handshake(self, live: int) -> None:
        if self.world > 1:
            self.issue(live)

    def issue(self, live: int) -> None:
        """Issue the reductions ready in order, a bucket at a time, one in flight."""
        upto = self.issued
        if not self.strategy.defer_reductions or self.closing:
            while upto < len(self.order) and self.ready[self.order[upto]]:
                upto += 1
        groups = self.tr.groups
        while self.issued < upto and self.ends[self.issued] <= upto:
            self.drain()
            items = []
            for g in self.order[self.issued : self.ends[self.issued]]:
                flat = self.flat.pop(g, self.grad_key(g))  # zeros where this rank made none
                out = 0 if self.tier.disk else groups[g].shard_grad
                if self.feedback and groups[g].dtype.is_floating_point:
                    self.residuals[g] = _nbytes(self.grad_key(g))
                items.append((g, flat, out))
            if len(items) > 1 and self.packs:  # a packed buffer to and from each peer
                extra = 2 * (self.world - 1) * packing(groups[g].shard_grad for g, _, _ in items)[1]
            else:
                extra = self.receive_peers * groups[items[0][0]].shard_grad
            self.pending.append((items, extra))
            self.check(live)
            self.issued = self.ends[self.issued]

    def drain(self) -> None:
        """Land every reduction in flight: its flat gradient becomes a spare."""
        for items, _ in self.pending:
            for _, flat, out in items:
                if not self.closing:
                    self.pool.put_scratch(flat, flat)
                self.landed += 0 if self.tier.staged else out  # the host tier copies it home
        self.pending = []

    def views_done(self, g: int, live: int) -> None:
        """Backward has made every gradient of ``g``'s parameters (alive in ``live``): the
        buffer goes, the reduction in flight lands, the flat gradient is made from them."""
        if self.strategy.release_after_backward or self.stage3[self.tr.groups[g].unit]:
            self.release(g)
        self.drain()
        self.pool.pop(self.grad_key(g))
        self.flat[g] = self.grad_key(g)
        self.check(live)
        live -= self.tr.grad_bytes[g]  # autograd drops them once the flat gradient is made
        self.released.add(g)
        u = self.tr.groups[g].unit
        if all(i in self.released for i in self.unit_groups[u] if self.tr.groups[i].requires_grad):
            self.reshard(u, backward=True)
        self.ready[g] = True
        if self.world == 1 or self.no_backward_handshakes:
            self.issue(live)

    # the step -------------------------------------------------------------------------

    def step(self, first: bool) -> None:
        """One training step: forward, backward, the optimizer step. The first knows no order
        of units yet (no prefetch; every unit is released after its forward)."""
        tr, kept = self.tr, self.tr.kept
        self.fwd_next, self.bwd_next = ({}, {}) if first else self.learned
        self.keep = set() if first else self.kept_next
        self.plan, self.plan_at, self.recorded = [] if first else self.recorded, 0, []
        self.no_backward_handshakes = False  # decided at the end of forward
        self.phase = "forward"
        self.fresh.clear()  # the optimizer step changed every shard
        self.staged = {g: (n, False) for g, (n, _) in self.staged.items()}
        self.flat, self.pending, self.landed = {}, [], 0
        self.ready = dict.fromkeys(self.order, False)
        self.issued, self.closing = 0, False
        self.released = set()
        seen_bwd: set[int] = set()
        outputs = 0 if first else kept  # the previous step's, until this forward returns
        for kind, i, live, most in tr.events:
            self.check(most + outputs)
            live += outputs
            if kind == "fwd_pre" and self.phase == "forward":
                if i == 0:
                    self.pool.holding = True
                self.ensure_gathered(i, False, live)
                self.prefetch(self.fwd_next, i, False, live)
            elif kind == "fwd_post" and self.phase == "forward":
                if i != 0 and i not in self.keep:
                    self.reshard(i, backward=False)
                if i == 0:
                    keep = self.keep | {self.last}
                    for u in list(self.gathered):
                        if u != 0 and u not in keep:
                            self.reshard(u, backward=False)
                    self.handshake(live)
                    # Backward reduces without handshakes where it gathers nothing: nothing
                    # deferred, every unit that ran kept and current (engine/step/root.py).
                    self.no_backward_handshakes = (
                        self.world > 1
                        and not self.strategy.defer_reductions
                        and all(not self.stale(u) and not self.stage3[u] for u in self.ran)
                    )
                    if self.last is not None:
                        self.stage_after(self.last, True, live)
                        last = last_bucket(self.recorded, self.unit_full.__getitem__, self.bucket)
                        self.kept_next = {self.last, *last} - {0}
                    outputs = 0
            elif kind == "bwd_pre" and i not in seen_bwd:
                seen_bwd.add(i)
                self.phase = "backward"
                if self.strategy.offers_reductions_in_backward and not self.no_backward_handshakes:
                    self.handshake(live)
                self.ensure_gathered(i, True, live)
                if i in self.bwd_next:
                    self.prefetch(self.bwd_next, i, True, live)
                else:
                    self.pool.holding = False
                    self.pool.trim()
            elif kind == "grads":
                self.views_done(i, live)
        self.check(tr.end)
        self.phase = "backward"
        self.pool.holding = False
        for u in list(self.gathered):
            self.reshard(u, backward=True)
        for i, g in enumerate(tr.groups):  # backward's end drops the trainable ones
            if g.requires_grad:
                self.packed.pop(i, None)
        self.closing = True
        self.ready = dict.fromkeys(self.order, True)
        self.issue(kept)
        self.drain()
        trainable = [g for g in tr.groups if g.requires_grad]
        if not (self.tier.staged or self.tier.disk):
            # Landed shards become the .grad, cast to its dtype where they differ.
            self.grads = sum(g.kept_grad for g in trainable if g.grad_dtype != g.kept_grad_dtype)
            self.check(kept)
            self.grads = sum(g.kept_grad for g in trainable)
            self.landed = 0
        self.pool.trim_scratch()
        self.check(kept)
        self.phase = "optimizer step"
        self.check(kept)
        self.has_state = True
        self.grads = 0  # zero_grad()


def replay(
    tr: Trace,
    strategy: Strategy,
    tier: Tier,
    step: StepBytes,
    device: str,
    compression: Compression | None = None,
    bucket_bytes: int = 0,
) -> Parts:
    """A rank's peak over a first step and two steady ones, for ``strategy`` and ``tier``,
    with ``step`` its optimizer's, ``compression``'s buffers and ``bucket_bytes``'s buckets."""
    run = _Replay(tr, strategy, tier, step, device, compression, bucket_bytes)
    for first in (True, False, False):
        run.step(first)
    params, grads, optimizer, working, activations = run.best
    disk = 0
    if tier.disk:
        disk = sum(g.shard + g.shard_grad for g in tr.groups) + step.in_files
    return Parts(
        params, grads, optimizer, working, activations, run.best_phase, run.host_peak, disk
    )
