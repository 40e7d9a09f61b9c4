"""What moving or casting a sharded model does: nothing where nothing changes, else it raises.

``model.to(...)``, ``.cuda()``, ``.half()`` and friends reach :meth:`nn.Module._apply`. Applied
to the shard parameters they would detach them from the flat shards that gathers read and the
optimizer steps, so :class:`Moves` lets through only what names the same memory and dtype
(``cpu`` and ``cpu:0``, say, as ``Trainer`` moves models) and refuses the rest, naming where
the device and the compute dtype are chosen instead.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..step.root import Root
from .extensions import check_move

__all__ = ["Moves"]


class Moves:
    """``_apply`` for :class:`ShardedModule` (mixed in ahead of the model's own class)."""

    _shardwrap_root: Root

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        """``.to()``, ``.cuda()``, ``.half()`` and friends: allowed where they change nothing.

        Raises:
            ValueError: a move to another device or a cast: applied to the shard parameters it
                would detach them from the flat shards, and the optimizer would step copies.
            TypeError: an integration refuses the move (the Hugging Face one: a
                ``transformers.Trainer`` that would save on rank 0 alone is moving the model,
                as it does while being built, naming ``shardwrap.hf.Trainer``).
        """
        check_move(self)
        for unit in self._shardwrap_root.units:
            for g in unit.groups:
                moved = _moved(fn, g.dtype, g.home.device)
                if moved is not None:
                    probe, out = moved
                    raise ValueError(
                        f"ShardedModule: moving or casting a sharded model (to {out.device}, "
                        f"{out.dtype}; it computes on {probe.device}, its shards are "
                        f"{probe.dtype}) would detach its parameters from the flat shards. "
                        "Choose the device when wrapping (move the model first, or pass "
                        "device=...), and the compute dtype with "
                        "mixed_precision=MixedPrecision(...)."
                    )
        for name, b in self.named_buffers():
            moved = _moved(fn, b.dtype, b.device)
            if moved is not None:
                probe, out = moved
                raise ValueError(
                    f"ShardedModule: moving or casting a sharded model would change its buffer "
                    f"'{name}' ({probe.dtype}, {probe.device}) to {out.dtype}, {out.device}, "
                    "while its parameters stay as wrapped: nothing was changed. Cast or move "
                    "the model before wrapping it."
                )
        return self


def _moved(
    fn: Any, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An empty tensor of ``dtype`` on ``device`` and what ``fn`` makes of it, where that moves
    or casts it; ``None`` where it changes nothing."""
    probe = torch.empty(0, dtype=dtype, device=device)
    out = fn(probe)
    if out.dtype == probe.dtype and _same_device(out.device, probe.device):
        return None
    return probe, out


def _same_device(a: torch.device, b: torch.device) -> bool:
    """Whether two devices name the same memory (``cpu`` and ``cpu:0`` do)."""
    if a.type != b.type:
        return False
    if a.type == "cpu":
        return True
    current = torch.accelerator.current_device_index() if torch.accelerator.is_available() else 0
    index_a = current if a.index is None else a.index
    index_b = current if b.index is None else b.index
    return index_a == index_b
