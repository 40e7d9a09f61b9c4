"""The engine: ``ShardedModule`` (``sharded_module.py``) and what runs under it. Which submodules
become units (``wrap.py``); their flat buffers (``layout.py``, ``flat_group.py``, ``unit.py``,
``param_index.py``); the root's hooks and prefetch (``root.py``); the agreed order of collectives
(``schedule.py``); when buffers live and die (``strategy.py``); gradient reduction (``reduce.py``);
buffer reuse (``pool.py``, ``saved.py``); modules called on their own, recomputation and
compilation, meta-device initialisation, argument checks, gradient norms and loss scaling, the
optimizers' step pre-hooks; and the registry integrations plug into (``extensions.py``). Imports
only ``shardwrap.options``, ``shardwrap.comm`` and ``shardwrap.tiers``: integrations register
themselves here, the engine never imports them.
"""
