"""Shard parameters: this rank's pieces of a unit's parameters, views of its flat shard.

Design note. A piece shares the flat shard's version counter, so every write through it (an
optimizer's step, ``copy_`` under ``no_grad``, a load) counts there, and that count is how a
unit that stays gathered (stages 1 and 2, ``reshard_after_forward=False``, ``keep_gathered``)
or a copy staged for the host tier learns that its shard changed. ``p.data`` is torch's way
around the count: the same memory under a counter of its own. Through it an EMA swap
(``p.data.copy_(ema)``, then back), an initialiser (``p.data.normal_()``) or a hand-written
optimizer would change the shard unseen, and a unit kept gathered would go on computing with
the old values, or with its own rank's slice new and the others' old. So a shard parameter's
``data`` is ``p.detach()``, the same memory under the same counter, and ``p.data = t`` copies
``t``'s values into the piece: the piece's memory is its slot of the flat shard, which another
tensor cannot become. A ``t`` of another shape, dtype or device is refused, naming the
parameter. The engine's own swaps (whole-parameter steps, the planner's) use :func:`raw_data`
and :func:`set_raw_data`, torch's own accessors.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch._C import TensorBase

__all__ = ["NAME_ATTR", "ShardParam", "raw_data", "set_raw_data"]

NAME_ATTR = "_shardwrap_name"  # on a shard parameter: its name in the model, for messages

_DATA = TensorBase.data  # torch's accessor: a fresh version counter, rebinding on assignment


def raw_data(p: Tensor) -> Tensor:
    """``p.data`` as torch makes it, for any tensor: writes through it are not counted."""
    return _DATA.__get__(p)


def set_raw_data(p: Tensor, value: Tensor) -> None:
    """``p.data = value`` as torch does it, for any tensor: ``p`` now uses ``value``'s memory."""
    _DATA.__set__(p, value)


class ShardParam(nn.Parameter):
    """A shard parameter: a ``Parameter`` whose ``data`` writes count as writes to it (see the
    module's note)."""

    @property
    def data(self) -> Tensor:  # type: ignore[override]
        """The piece's values outside autograd, under its version counter."""
        return self.detach()

    @data.setter
    def data(self, value: Tensor) -> None:
        if (value.shape, value.dtype, value.device) != (self.shape, self.dtype, self.device):
            name = getattr(self, NAME_ATTR, "a shard parameter")
            raise ValueError(
                f"{name}.data = ... assigns a tensor of shape {tuple(value.shape)} "
                f"({value.dtype}, {value.device}) to this rank's piece of {name}, of shape "
                f"{tuple(self.shape)} ({self.dtype}, {self.device}). A sharded model's "
                "parameters are its pieces, views of their unit's flat shard: assign a tensor "
                "of the piece's shape, dtype and device (its values are copied in); write the "
                f"whole parameter with model.load_state_dict({{'{name}': value}}, strict=False) "
                "or inside model.gathered(writeback=True); change a dtype or a device before "
                "wrapping."
            )
        if value.data_ptr() == self.data_ptr() and value.stride() == self.stride():
            return  # the piece itself (Module._apply's no-op conversions assign it back)
        self.detach().copy_(value)
