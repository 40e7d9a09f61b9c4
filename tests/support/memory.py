"""Allocation tracking for memory tests and the planner's checks: tracked peaks, model families
and their batches. The code lives in ``benchmarks/_memory.py``, which the benchmarks measure
with too (the benchmarks import nothing from the tests).
"""

from benchmarks._memory import *  # noqa: F403  (its __all__)
