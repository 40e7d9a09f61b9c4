"""What an optimizer step over the shards meets. ``shard_grad.py`` types each shard's gradient
so that a norm over it is the whole parameter's (clipping, logging); ``whole_params.py`` steps
the parameters of shape-aware optimizers (Muon, Adafactor) whole, each on one owner rank;
``step_hooks.py`` hooks every optimizer over the shards for the offload tiers; ``grad_scaler.py``
scales float16 losses with the inf checks agreed across ranks; ``pieces.py`` types the pieces
that state dicts hand out, so that saving one rank's refuses, and cuts full optimizer state
loaded back into pieces. Nothing here imports a unit.
"""
