"""An average (``torch.optim.swa_utils.AveragedModel``) updated from pieces that do not line up,
refused.

Design note. ``AveragedModel.update_parameters(model)`` blends each of its parameters with the
matching one of ``model``, element by element. On a sharded model both are this rank's pieces,
and they line up only where the two parameters lie alike over the ranks: an average made by
``copy.deepcopy`` of a sharded model (``AveragedModel(model)``), or an averaged copy that is a
unit of its own beside the module it follows, a unit too. An averaged copy in the same unit as
that module, or in units laid out otherwise, holds other ranges of its parameters than the
module holds of its own: the blend would mix different elements (without a word where the two
pieces have the same size) or fail on a size. So torch's ``update_parameters`` is wrapped, once
in the process, to compare the two pieces' places first (each rank knows every rank's layout,
so every rank decides alike, with no communication), raising naming the first pair that does
not line up and the fixes.
"""

from __future__ import annotations

import functools
from typing import Any

from torch import Tensor, nn

from .pieces import PIECE_ATTR

__all__ = ["guard_averaged_updates"]

_patched = False


def guard_averaged_updates() -> None:
    """Wrap ``AveragedModel.update_parameters`` to refuse pieces that do not line up (see the
    module's note); the first call wraps it, later ones do nothing."""
    global _patched
    if _patched:
        return
    _patched = True
    from torch.optim.swa_utils import AveragedModel

    original = AveragedModel.update_parameters

    def checked(self: Any, model: nn.Module) -> None:
        for (name, a), b in zip(self.module.named_parameters(), model.parameters()):
            if _places(a) != _places(b):
                raise ValueError(_misaligned(name, a, b))
        return original(self, model)

    AveragedModel.update_parameters = functools.wraps(original)(checked)


def _places(p: Tensor) -> Any:
    """Where ``p``'s elements lie over the ranks: ``None`` for a whole parameter, else each rank
    holding part of it with that part's range, and the flat group's ranks."""
    piece = getattr(p, PIECE_ATTR, None)
    group = piece[0]() if piece is not None else None
    if group is None:
        return None
    return group.layout.places[piece[1]], group.mesh.shard


def _misaligned(name: str, averaged: Tensor, followed: Tensor) -> str:
    def where(p: Tensor) -> str:
        places = _places(p)
        if places is None:
            return f"the whole parameter, shape {tuple(p.shape)}"
        ranges = ", ".join(f"rank {r}: [{a}, {b})" for r, a, b in places[0])
        return f"pieces {ranges or 'none'}"

    return (
        f"AveragedModel.update_parameters: its parameter '{name}' and the model's matching "
        f"one are not held alike on this rank's sharded model (the average: {where(averaged)}; "
        f"the model: {where(followed)}), so blending them element by element would mix "
        "different elements. Nothing was changed. Keep the average outside the model: "
        "ema = AveragedModel(sharded_model) (a sharded copy laid out alike), or, to keep it "
        "inside, make the averaged copy and the module it follows units of their own "
        "(auto_wrap=(AveragedModel, type(followed_module)))."
    )
