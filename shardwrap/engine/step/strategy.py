"""The strategy: when a unit's gathered parameters and its gradients live and die.

Design note. Every decision about a unit's buffers is asked of this one object; the root
and the schedule carry them out and decide nothing themselves, and the memory planner's
replay (``planning/replay.py``) asks it the same questions:

- after a unit's forward: release its gathered parameters, or keep them for backward;
- after a unit's backward: release them, or keep them for the next step;
- when gradient reductions run: as each group's gradient is complete, or all at the end of
  backward.

The three ZeRO stages (Rajbhandari et al., https://arxiv.org/abs/1910.02054) differ only in
these answers; the optimizer always steps on the 1/N shard, so its state is sharded at every
stage:

=====  ================================  ======================  ===========================
stage  gathered parameters               gradients               reductions
=====  ================================  ======================  ===========================
1      kept between steps                full until the end of   all at the end of backward
                                         backward
2      kept between steps                1/N once reduced        per group, during backward
3      released after forward and after  1/N once reduced        per group, during backward
       backward
=====  ================================  ======================  ===========================

At stages 1 and 2 a unit whose parameters are mostly frozen (a PEFT model's base layers, with
their adapters) follows stage 3's lifetime instead: frozen weights have no gradient to shard
and never change, yet kept in full they would cost their whole size on every rank. Its trainable
groups keep their full buffers; its frozen groups are gathered for its forward and its backward.

Kept parameters are refreshed lazily: after an optimizer step (or a load) changes a shard,
the unit is gathered again before it is next read. The root unit, the unit that ran last in
forward and the units of forward's final bucket (``comm/buckets.py``) are kept after forward
whatever the strategy: backward starts with them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Strategy"]


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Buffer lifetimes of one sharded model.

    Attributes:
        stage: the ZeRO stage, 1, 2 or 3 (see the table above).
        reshard_after_forward: at stage 3, release each unit's gathered parameters after its
            forward (least memory) rather than keeping them until its backward.
    """

    stage: int = 3
    reshard_after_forward: bool = True

    def __post_init__(self) -> None:
        if type(self.stage) is not int or self.stage not in (1, 2, 3):
            raise ValueError(
                f"stage must be 1, 2 or 3, got {self.stage!r}: 1 shards the optimizer state, "
                "2 also the gradients, 3 also the parameters. E.g. ShardedModule(model, stage=2)."
            )

    def release_after_forward(self, *, grad_enabled: bool) -> bool:
        """Whether a unit's gathered parameters go once its forward returns.

        Args:
            grad_enabled: whether the forward records a graph; without one no backward will
                need the parameters.
        """
        return self.stage == 3 and (self.reshard_after_forward or not grad_enabled)

    @property
    def keeps_params(self) -> bool:
        """Whether full parameters persist between steps (stages 1 and 2): a group that computes
        in its shards' dtype then keeps its full buffer for good, the shard a slice of it."""
        return self.stage in (1, 2)

    def keeps_resident(
        self,
        *,
        stage3_lifetime: bool,
        requires_grad: bool,
        same_dtype: bool,
        staged: bool,
        quantized: bool,
    ) -> bool:
        """Whether a flat group keeps its full buffer for good, its shard a slice of it: at
        stages 1 and 2 (a unit with stage 3's lifetime: its trainable groups only), where the
        parameters compute in the shards' own dtype (``same_dtype``), the shard lives on the
        compute device (not ``staged`` by an offload tier) and gathers are exact (not
        ``quantized``: the shard, as the master copy, must not take decoded values). The
        memory planner's replay asks the same (``planning/replay.py``)."""
        keeps = self.keeps_params and (not stage3_lifetime or requires_grad)
        return keeps and same_dtype and not staged and not quantized

    def stage3_lifetime(self, *, frozen_numel: int, trainable_numel: int) -> bool:
        """Whether a unit is released after forward and after backward as at stage 3 whatever
        the stage: at stages 1 and 2, a unit whose parameters are mostly frozen (see the note
        above)."""
        return self.keeps_params and frozen_numel > trainable_numel

    @property
    def release_after_backward(self) -> bool:
        """Whether a unit's gathered parameters go once backward no longer reads them."""
        return self.stage == 3

    @property
    def gathers_in_backward(self) -> bool:
        """Whether backward gathers units (so its handshakes can carry the reductions)."""
        return self.stage == 3 and self.reshard_after_forward

    @property
    def offers_reductions_in_backward(self) -> bool:
        """Whether backward issues reductions of its own accord, as gradients complete: none are
        deferred, and no gather in backward carries them (stage 2, and stage 3 kept after
        forward), so they still overlap backward. Where every rank's backward gathers nothing
        they go out without handshakes; otherwise each unit's backward begins with one that
        issues those every rank has ready (``engine/step/schedule.py``)."""
        return not self.gathers_in_backward and not self.defer_reductions

    @property
    def defer_reductions(self) -> bool:
        """Whether gradient reductions wait for the end of backward (full gradients until then)."""
        return self.stage == 1
