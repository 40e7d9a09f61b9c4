"""A unit's flat buffers. ``layout.py`` is pure arithmetic (where each parameter lives in the
flat buffer and on which rank); ``flat_group.py`` holds one group's shard, its gathered buffer
with the parameters as views of it, and the autograd leaf its gradient accumulates in;
``shard_grads.py`` lands the group's reduced gradients in its shard params' ``.grad``;
``unit.py`` gives a unit's groups one SHARDED/GATHERED state; ``pool.py`` passes full buffers
from unit to unit and ``saved.py`` keeps the views autograd saves by address, so a released
buffer may serve another unit; ``param_index.py`` maps each original parameter to its group.
Nothing here knows the order of collectives or when a buffer is released: ``step/`` decides.
"""
