"""A training step. ``root.py`` holds the hooks every unit's forward and backward run, prefetch
and the end of backward; ``schedule.py`` the order of collectives every rank agrees on;
``reduce.py`` the gradient reductions, in one canonical order; ``strategy.py`` when gathered
buffers live and die at each ZeRO stage; ``order.py`` the order of units prefetch learns (the
memory planner replays it); ``own_calls.py`` modules called outside their unit's forward;
``recompute.py`` recomputation and compilation; ``inference.py`` generation with units kept
gathered; ``trees.py`` the tensors inside inputs and outputs; ``edits.py`` the edits made inside
``gathered()``, agreed across ranks or sent from one.
"""
