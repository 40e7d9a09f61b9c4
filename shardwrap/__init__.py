"""shardwrap: shard a PyTorch model's parameters, gradients and optimizer state across ranks.

    model = ShardedModule(model, auto_wrap=TransformerBlock)
    opt = torch.optim.AdamW(model.parameters())
"""

from ._collectives import CommStats
from ._sharded_module import ShardedModule

__all__ = ["CommStats", "ShardedModule"]
