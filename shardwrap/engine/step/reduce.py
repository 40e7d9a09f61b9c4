"""The reduction pipeline: flat gradients reduce-scattered in one order, landed into shard grads.

Design note. Each trainable flat group's gradient is averaged over the shard group with one
reduce-scatter straight from the flat layout; with hybrid sharding the resulting shard is
then averaged over the replicate group. Reductions are issued in one canonical order, reverse
unit index, which is also the usual order in which backward completes them, so on the common
path nothing waits; the schedule (``engine/step/schedule.py``) tells this pipeline how far every
rank is ready.

At most ``MAX_REDUCTIONS_IN_FLIGHT`` are in flight: each holds a unit's full-size flat
gradient, and one overlaps the next unit's backward (a reduction takes less time than a unit's
backward) at the least memory. A flat gradient reduced before the end of backward goes back to
the buffer pool, where the next unit's flat gradient finds it. A landed reduction's shard is
added to the shard parameters' ``.grad`` at the end of backward, and only for groups some rank
used: a group no rank used keeps a ``None`` gradient, as in plain PyTorch. Reductions run on
the compute device; a landed shard goes to the group's home (``tiers/home.py``: the host tier copies
it to host memory), and the copies are waited for before any ``.grad`` is set.

When reductions run is the strategy's choice: during backward, as groups become ready, or
deferred to the end of backward (``defer``; ZeRO stage 1). Inside ``no_sync`` nothing is
reduced and the flat gradients keep accumulating.

With ``Compression.grads`` the reduce-scatter and the replicas' all-reduce send quantized
payloads (``comm/compressed.py``); with error feedback each trainable group keeps a residual
per collective, made at its first reduction: a full-size one for the reduce-scatter (in the
reduction dtype; none at shard size 1, where nothing is sent) and, with hybrid sharding, a
shard-size one for the all-reduce. Residuals change only when a reduction is issued, so
gradients accumulated under ``no_sync`` carry them once, at the reduction that sends them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

from ...comm.buckets import bucket_ends
from ...comm.collectives import (
    CommStats,
    Pending,
    all_reduce,
    divides_first,
    reduce_scatter_many,
)
from ...comm.compressed import all_reduce_quantized, reduce_scatter_quantized
from ...comm.mesh import Mesh
from ...comm.quantize import Codec
from ...options import Compression
from ...tiers.home import Home
from ..optim.shard_grad import as_shard_grads, shard_grad_owner
from ..shards.flat_group import FlatGroup
from ..shards.profile import label

__all__ = ["MAX_REDUCTIONS_IN_FLIGHT", "Reductions", "reduces_alone", "reduction_order"]

MAX_REDUCTIONS_IN_FLIGHT = 1

G = TypeVar("G")


def reduction_order(groups_by_unit: Sequence[Sequence[G]]) -> list[G]:
    """The canonical order of reductions: units by reverse index, the order in which backward
    usually completes them, and each unit's groups in their own order. The memory planner's
    replay orders its groups by the same rule (``planning/replay.py``)."""
    return [g for groups in reversed(groups_by_unit) for g in groups]


def reduces_alone(quantized: bool, shard_size: int) -> bool:
    """Whether each group's reduction is an exchange of its own rather than part of a bucket:
    where it is quantized (each has its own codec payload), or on one rank (a copy, nothing
    to wait for)."""
    return quantized or shard_size == 1


class Reductions:
    """One backward's gradient reductions, in the canonical order.

    Args:
        order: every trainable flat group, in the order reductions are issued.
        mesh: the groups to reduce over.
        stats: collective counters shared by the whole model.
        defer: hold every reduction until the end of backward rather than issuing each
            once its gradient is ready.
        home: where the shards and their gradients live (the groups' home).
        compression: its ``grads`` format quantizes the reductions, with its error feedback;
            ``None``: exact.
        bucket_bytes: consecutive groups whose flat gradients fit in this many bytes are
            reduced in one exchange, once all are ready (not where ``compression`` quantizes
            them, nor on one rank: each goes alone).
    """

    def __init__(
        self,
        order: list[FlatGroup],
        mesh: Mesh,
        stats: CommStats,
        defer: bool,
        home: Home,
        compression: Compression | None = None,
        bucket_bytes: int = 0,
    ) -> None:
        self.order = order
        self.codec: Codec | None = None
        self.error_feedback = False
        if compression is not None and compression.grads is not None:
            self.codec = Codec(compression.grads, compression.block)
            self.error_feedback = compression.error_feedback
        # per position in ``order``: the reduce-scatter's residual (1-D, padded numel,
        # grad_dtype) and the replicas' all-reduce's (1-D, padded/N), made at first use
        self.residuals: list[Tensor | None] = [None] * len(order)
        self.replica_residuals: list[Tensor | None] = [None] * len(order)
        self.home = home
        self.mesh = mesh
        self.stats = stats
        self.defer = defer
        self.sync = True
        self._one_rank = mesh.world_size == 1
        # Whether every rank agreed, at the end of forward, that this backward issues its
        # reductions as gradients complete, without handshakes (set by ``Schedule``).
        self.without_handshakes = False
        self._position = {id(g): i for i, g in enumerate(order)}
        alone = reduces_alone(self.codec is not None, mesh.shard_size)
        self._bucket_bytes = 0 if alone else bucket_bytes
        self.refresh()
        self.grad_owner = shard_grad_owner(mesh.shard, stats, home, mesh.replicate)
        # a tensor-parallel block's gradient is sharded over the tp ranks too: its norms sum
        # over both (a replicated parameter's only over shard: each tp rank holds all of it)
        self.split_grad_owner = (
            shard_grad_owner(mesh.model, stats, home, mesh.replicate)
            if mesh.tp is not None
            else self.grad_owner
        )
        self.reset()

    @property
    def grad_owners(self) -> tuple[Any, ...]:
        """What the shard gradients' norms complete over (``shard_grad.py``), each once."""
        owners = (self.grad_owner, self.split_grad_owner)
        return owners[:1] if owners[0] is owners[1] else owners

    def as_grads_of(self, group: FlatGroup) -> Callable[[list[tuple[int, Tensor]]], list[Tensor]]:
        """What types views as ``group``'s shard gradients (``ShardGrads.accumulate``)."""
        return functools.partial(self._as_grads, group)

    def _as_grads(self, group: FlatGroup, pieces: list[tuple[int, Tensor]]) -> list[Tensor]:
        """Each ``(index, view)`` of ``pieces``, parameter ``index``'s part of ``group``'s
        reduced gradient, typed with the group its norms complete over."""
        owners = [
            self.split_grad_owner if group.splits[i].is_split else self.grad_owner
            for i, _ in pieces
        ]
        return as_shard_grads([view for _, view in pieces], owners)

    def refresh(self) -> None:
        """Cut the order into buckets again, after a frozen group began to train: a frozen
        group takes no room in a bucket, and its reduction is skipped."""
        nbytes = [
            g.layout.padded_numel * g.grad_dtype.itemsize if g.requires_grad else 0
            for g in self.order
        ]
        self._ends = bucket_ends(nbytes, self._bucket_bytes)

    def reset(self) -> None:
        """Forget the previous backward."""
        # a frozen group is ready from the start: it has nothing to reduce
        self.ready = [not g.requires_grad for g in self.order]
        self.used = [False] * len(self.order)
        # per position, once its reduction is issued: which of its parameters have a gradient
        self.seen: list[list[bool] | None] = [None] * len(self.order)
        self._issued = 0
        self._closing = False
        # one exchange: (positions, collective, its outputs: shard gradients 1-D padded/N, its
        # full-size inputs)
        self._pending: list[tuple[list[int], Pending, list[Tensor], list[Tensor]]] = []
        self._landed: list[tuple[int, Tensor]] = []

    def grad_ready(self, group: FlatGroup) -> None:
        """Note that ``group``'s flat gradient for this backward is complete; issue what is
        ready where no handshake need agree on it first (one rank, or a backward agreed to
        reduce without handshakes)."""
        i = self._position[id(group)]
        self.ready[i] = self.used[i] = True
        if self._one_rank or self.without_handshakes:
            self.issue(self.ready_prefix())

    def close(self) -> list[bool]:
        """End of backward: every gradient is as complete as it gets; deferred ones may go.

        Returns:
            Which groups have a gradient to reduce on this rank: used in this backward, or in
            one under ``no_sync`` since their last reduction (a backward split in several
            calls may not reach them, yet what they accumulated is theirs to keep).
        """
        for i in range(self._issued, len(self.order)):
            self.used[i] = self.used[i] or self.order[i].has_grad
        # Every rank must issue every reduction, in order: one it has no gradient for sends
        # zeros, as a peer that used the group waits for it.
        self.ready = [True] * len(self.order)
        self._closing = True
        return list(self.used)

    def partial(self) -> bool:
        """Whether some group this rank used has a parameter it gave no gradient (its
        ``.grad`` must stay ``None`` unless another rank gave it one; see ``finish``)."""
        for i, used in enumerate(self.used):
            seen = self.seen[i] if self.seen[i] is not None else self.order[i].grads_seen
            if used and not all(seen):
                return True
        return False

    def ready_prefix(self) -> int:
        """How many reductions, in order, this rank could issue now."""
        if not self.sync:
            return len(self.order)
        if self.defer and not self._closing:
            return self._issued
        n = self._issued
        while n < len(self.ready) and self.ready[n]:
            n += 1
        return n

    def issue(self, upto: int) -> None:
        """Issue the reductions before position ``upto`` not issued yet (every rank agrees), a
        bucket at a time: a bucket not all before ``upto`` waits."""
        if not self.sync or self._issued >= upto:
            return
        with label("reduce"):
            self._issue(upto)

    def _issue(self, upto: int) -> None:
        while self._issued < upto and self._ends[self._issued] <= upto:
            while len(self._pending) >= MAX_REDUCTIONS_IN_FLIGHT:
                # Each holds a unit-sized flat gradient: land one before taking another.
                self._complete_oldest()
            bucket = range(self._issued, self._ends[self._issued])
            self._issued = bucket.stop
            positions = [i for i in bucket if self.order[i].requires_grad]
            if not positions:
                continue
            outs, grads = [], []
            for i in positions:
                group = self.order[i]
                grad, self.seen[i] = group.take_grad()
                grads.append(grad)
                outs.append(
                    self.home.reduce_into(
                        group.shard.numel(), group.grad_dtype, group.free_home_grad()
                    )
                )
            if not self._quantizes(grads[0]):
                work = reduce_scatter_many(outs, grads, self.mesh.shard, self.stats)
            else:  # one group a bucket
                i = positions[0]
                residual = self._residual(self.residuals, i, grads[0], self.mesh.shard_size)
                work = reduce_scatter_quantized(
                    outs[0], grads[0], self.mesh.shard, self.codec, residual, self.stats
                )
            self._pending.append((positions, work, outs, grads))

    def drain(self) -> None:
        """Land every reduction in flight, freeing the full-size gradients they hold."""
        while self._pending:
            self._complete_oldest()

    def _complete_oldest(self) -> None:
        positions, work, outs, grads = self._pending.pop(0)
        work.wait()
        for i, out, grad in zip(positions, outs, grads):
            group = self.order[i]
            if not self._closing:  # a later unit's flat gradient reuses it
                group.pool.give_scratch(grad)
            if self.mesh.replicate is not None and self._quantizes(out):
                residual = self._residual(self.replica_residuals, i, out, self.mesh.replicate_size)
                all_reduce_quantized(
                    out, self.mesh.replicate, self.codec, residual, self.stats
                ).wait()
            elif self.mesh.replicate is not None:
                first = divides_first(out.dtype)
                if first:
                    out.div_(self.mesh.replicate_size)
                all_reduce(out, self.mesh.replicate, dist.ReduceOp.SUM, self.stats).wait()
                if not first:
                    out.div_(self.mesh.replicate_size)
            landed = self.home.land(out, group.free_home_grad(), group.param_grad_dtype)
            self._landed.append((i, landed))

    def _quantizes(self, grad: Tensor) -> bool:
        """Whether ``grad``'s reduction is quantized: not a complex one, which goes exact, as
        complex parameters are gathered."""
        return self.codec is not None and grad.is_floating_point()

    def _residual(
        self, residuals: list[Tensor | None], i: int, like: Tensor, world: int
    ) -> Tensor | None:
        """Group ``i``'s residual in ``residuals``, shaped like ``like`` (zeros at first);
        ``None`` without error feedback or where ``world`` is 1 (nothing is quantized)."""
        if not self.error_feedback or world == 1:
            return None
        if residuals[i] is None:
            residuals[i] = torch.zeros(like.numel(), dtype=like.dtype, device=like.device)
        return residuals[i]

    def finish(self, used_anywhere: list[bool], seen_anywhere: list[list[bool]] | None) -> None:
        """Wait for every reduction and add the landed shards to the shard parameters' grads,
        then run each changed parameter's post-accumulate-grad hooks, as autograd runs them on
        a plain model's.

        Args:
            used_anywhere: per position, whether any rank has a gradient for the group.
            seen_anywhere: per position, which of its parameters any rank gave a gradient;
                ``None`` where every rank gave one to every parameter of the groups it used.
        """
        self.drain()
        self.home.quiesce()  # the host tier's copies of landed shards, before ``.grad`` sees them
        for i, out in self._landed:
            if used_anywhere[i]:
                group = self.order[i]
                seen = seen_anywhere[i] if seen_anywhere is not None else [True] * len(group.names)
                for p in group.shard_grads.accumulate(out, self.as_grads_of(group), seen):
                    _post_accumulate(p)
        self.reset()


def _post_accumulate(param: Tensor) -> None:
    """Run ``param``'s post-accumulate-grad hooks (``register_post_accumulate_grad_hook``), and
    the optimizers ``torch.distributed.optim._apply_optimizer_in_backward`` gave it: autograd
    never does for a shard parameter, which is not in its graph (those optimizers hook its
    gradient accumulator, which never runs)."""
    hooks = param._post_accumulate_grad_hooks
    if hooks:
        for hook in tuple(hooks.values()):
            hook(param)
    if "_in_backward_optimizers" in param.__dict__ and _steps_in_backward(param):
        for optimizer in param._in_backward_optimizers:  # type: ignore[attr-defined]
            optimizer.step()
        param.grad = None


def _steps_in_backward(param: Tensor) -> bool:
    """Whether ``_apply_optimizer_in_backward`` hooked ``param`` to step in backward (with
    ``register_hook=False`` the caller steps the optimizers itself)."""
    from torch.distributed.optim import apply_optimizer_in_backward as in_backward

    return param in in_backward.param_to_optim_hook_handle_map
