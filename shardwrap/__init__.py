"""shardwrap: shard a PyTorch model's parameters, gradients and optimizer state across ranks.

model = ShardedModule(model, auto_wrap=TransformerBlock)
opt = torch.optim.AdamW(model.parameters())
shardwrap.save_checkpoint("ckpt/step-1000", model, opt, step=1000)
"""

from . import _hf  # noqa: F401  (registers the Hugging Face habits with the engine)
from ._allocations import AllocationTracker, track_allocations
from ._checkpoint import latest_checkpoint, save_checkpoint
from ._checkpoint_load import load_checkpoint
from ._collectives import CollectiveFailed, CommStats
from ._estimate import estimate_memory
from ._export import export, load_pretrained
from ._grad_scaler import ShardedGradScaler
from ._logbook import Logbook, SpikeError, Spikes
from ._mesh import Mesh
from ._offload import Offload, StoreError
from ._options import MixedPrecision
from ._sharded_module import ShardedModule

__all__ = [
    "AllocationTracker",
    "CollectiveFailed",
    "CommStats",
    "Logbook",
    "Mesh",
    "MixedPrecision",
    "Offload",
    "ShardedGradScaler",
    "ShardedModule",
    "SpikeError",
    "Spikes",
    "StoreError",
    "estimate_memory",
    "export",
    "latest_checkpoint",
    "load_checkpoint",
    "load_pretrained",
    "save_checkpoint",
    "track_allocations",
]
