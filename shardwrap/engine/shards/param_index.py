"""The model's index of parameters: which flat group and slot hold each original parameter.

Built once when the model is wrapped, in the units' order, and read by state dicts,
checkpoints and export (``root.params``, ``root.param_of``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from .flat_group import FlatGroup
from .unit import Unit

__all__ = ["Param", "index_params"]


class Param(NamedTuple):
    """One original parameter as this rank holds it: its flat group and its index in it."""

    name: str
    group: FlatGroup
    index: int

    @property
    def shard(self) -> nn.Parameter:  # 1-D, this rank's piece (possibly empty)
        return self.group.shard_params[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        """The whole parameter's shape (of all tp ranks' blocks, for a tensor-parallel one)."""
        return self.group.splits[self.index].shape


def index_params(units: list[Unit]) -> tuple[list[Param], dict[int, Param]]:
    """Every parameter of ``units`` in order, and each keyed by ``id`` of its shard parameter."""
    params = [Param(name, g, i) for u in units for g in u.groups for i, name in enumerate(g.names)]
    return params, {id(p.shard): p for p in params}
