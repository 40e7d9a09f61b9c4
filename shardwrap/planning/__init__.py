"""The memory planner: a meta-device trace of one training step (``trace.py``), the engine's buffer
decisions replayed over it (``replay.py``) and the plan per stage and tier (``planner.py``); and
the tracked-allocation measure that checks a plan (``allocations.py``). Imports
``shardwrap.options``, ``comm``, ``tiers`` and ``engine``; never ``checkpoint``, ``runs`` or
``integrations``.
"""
