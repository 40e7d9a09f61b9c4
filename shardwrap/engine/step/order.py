"""The order in which units ran, as prefetch and the memory planner read it.

One rule both sides call (:func:`successors`): the engine's root learns from it which unit to
gather ahead of each unit (:class:`ExecutionOrder`), and the planner's replay
(``planning/replay.py``) learns the same from a traced order of unit indices, so its plan
follows the engine's prefetch.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["ExecutionOrder", "successors", "unit_index"]


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


class ExecutionOrder(Generic[T]):
    """The units one forward or backward has reached so far, and, for each direction, which
    unit ran after each in the last pass that ended: what prefetch gathers next.

    A pass records from its first unit (:meth:`begin`, :meth:`reached`); only a pass that
    ends (:meth:`learn`) replaces what the previous one taught, so a forward or backward that
    raised leaves the last complete order in place.
    """

    def __init__(self, index: Callable[[T], int]) -> None:
        self._index = index
        self.reached_units: list[T] = []  # this pass's units, in the order they ran
        # per direction (backward?): unit index -> the unit that ran after it
        self._next: dict[bool, dict[int, T]] = {False: {}, True: {}}

    def begin(self) -> None:
        """A forward or backward starts: record afresh."""
        self.reached_units = []

    def reached(self, unit: T) -> None:
        self.reached_units.append(unit)

    @property
    def last(self) -> T | None:
        """The unit this pass reached last."""
        return self.reached_units[-1] if self.reached_units else None

    def learn(self, backward: bool) -> None:
        """The pass ended: its order drives the next pass of its direction."""
        self._next[backward] = successors(self.reached_units, self._index)

    def after(self, unit: T, backward: bool) -> T | None:
        """The unit that ran after ``unit`` in the last complete pass of that direction."""
        return self._next[backward].get(self._index(unit))
