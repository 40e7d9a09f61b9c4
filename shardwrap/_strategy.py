"""The strategy: when a unit's gathered parameters and its gradients live and die.

Design note. Every decision about a unit's buffers is asked of this one object; the root
and the schedule carry them out and decide nothing themselves:

- after a unit's forward: release its gathered parameters, or keep them for backward;
- after a unit's backward: release them, or keep them for the next step;
- when gradient reductions run: as each group's gradient is complete, or all at the end of
  backward.

The root unit and the unit that ran last in forward are kept after forward whatever the
strategy: backward starts with them.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Strategy"]


@dataclass(frozen=True, kw_only=True)
class Strategy:
    """Buffer lifetimes of one sharded model.

    Attributes:
        reshard_after_forward: release each unit's gathered parameters after its forward
            (least memory) rather than keeping them until its backward.
    """

    reshard_after_forward: bool = True

    def release_after_forward(self, *, grad_enabled: bool) -> bool:
        """Whether a unit's gathered parameters go once its forward returns.

        Args:
            grad_enabled: whether the forward records a graph; without one no backward will
                need the parameters.
        """
        return self.reshard_after_forward or not grad_enabled

    @property
    def release_after_backward(self) -> bool:
        """Whether a unit's gathered parameters go once backward no longer reads them."""
        return True

    @property
    def defer_reductions(self) -> bool:
        """Whether gradient reductions wait for the end of backward."""
        return False
