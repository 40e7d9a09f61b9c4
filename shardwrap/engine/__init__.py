"""The engine: ``ShardedModule`` and what runs under it, in four rooms by the phase their code
serves, each importing only from the rooms below it:

- ``shards/``: a unit's flat buffers: the layout (offsets, padding, shard ranges), one flat
  group's shard, views and gradient leaf, a unit's SHARDED/GATHERED state, the buffer pool and
  the views autograd saves, the index of parameters;
- ``optim/``: what an optimizer step meets: shard gradients whose norms are global, the
  whole-parameter step of shape-aware optimizers, the offload tiers' step hooks, loss scaling;
- ``step/``: a training step: the root's hooks and prefetch, the agreed order of collectives,
  the reduction pipeline, the strategy's lifetimes, modules called on their own, recomputation,
  generation, tensors inside inputs and outputs, and edits inside ``gathered()``;
- ``wrap/``: wrapping: the public ``ShardedModule``, building units and the root, the policies
  that choose units, argument checks, meta-device initialisation, parameters assigned after
  wrapping, the summary, and the registry integrations plug into (``wrap/extensions.py``).

The engine imports only ``shardwrap.options``, ``shardwrap.comm`` and ``shardwrap.tiers``:
integrations register themselves with it, and it never imports them.
"""
