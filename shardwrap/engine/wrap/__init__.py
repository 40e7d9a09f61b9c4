"""Wrapping a model. ``sharded_module.py`` is the public ``ShardedModule``; ``policy.py`` chooses
the units and places tied parameters; ``checks.py`` refuses bad arguments before any flat buffer
is made and agrees the rest across ranks (``agree_values.py``: the weights too); ``build.py``
shards each unit's parameters into flat groups and builds the root; ``meta_init.py``
materialises a meta-device model one unit at a time; ``retired.py`` frees the original
parameters; ``assign.py`` takes parameters assigned after wrapping, or refuses them;
``summary.py`` says what a wrap produced; ``moves.py`` lets a move or cast through where it
changes nothing and refuses the rest; ``extensions.py`` is where integrations plug in;
``ddp_habits.py`` gives the wrapper DDP's ``module`` and ``require_backward_grad_sync``;
``from_fsdp.py`` takes FSDP's option objects and gives its ``set_requires_gradient_sync``.
"""
