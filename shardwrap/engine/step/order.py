"""The order in which units ran, as prefetch and the memory planner read it.

One rule both sides call: the engine's root learns from it which unit to gather ahead of each
unit, and the planner's replay (``planning/replay.py``) learns the same from a traced order of
unit indices, so its plan follows the engine's prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

__all__ = ["successors", "unit_index"]


class _Indexed(Protocol):
    index: int


T = TypeVar("T")


def unit_index(unit: _Indexed) -> int:
    """A unit's position in the pre-order of units."""
    return unit.index


def successors(order: list[T], index: Callable[[T], int]) -> dict[int, T]:
    """For each unit, the unit that ran right after its first run, by the first's ``index``
    (a unit's index; the memory planner replays the order of units by index alone)."""
    nxt: dict[int, T] = {}
    for a, b in zip(order, order[1:]):
        nxt.setdefault(index(a), b)
    return nxt
