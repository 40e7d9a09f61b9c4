"""Ranks as threads of this process, each with its own real gloo process group: the fast test
tier. The code lives in ``benchmarks/_ranks.py``, which the planner's benchmark measures with too
(the benchmarks import nothing from the tests); see its docstring for what the ranks share.
"""

from benchmarks._ranks import *  # noqa: F403  (its __all__: make_gloo_group, run_ranks, subgroup)
