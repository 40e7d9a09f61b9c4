"""shardwrap: shard a PyTorch model's parameters, gradients and optimizer state across ranks.

model = ShardedModule(model, auto_wrap=TransformerBlock)
opt = torch.optim.AdamW(model.parameters())
shardwrap.save_checkpoint("ckpt/step-1000", model, opt, step=1000)
"""

import importlib
from typing import Any

from .checkpoint.background import PendingSave
from .checkpoint.export import export
from .checkpoint.full_optimizer import full_optimizer_state_dict, load_full_optimizer_state_dict
from .checkpoint.load import load_checkpoint
from .checkpoint.pretrained import load_pretrained
from .checkpoint.save import latest_checkpoint, save_checkpoint
from .comm.collectives import CommStats
from .comm.failures import CollectiveFailed
from .comm.mesh import Mesh
from .engine.optim.grad_scaler import ShardedGradScaler
from .engine.optim.whole_params import declare_optimizer
from .engine.wrap.sharded_module import ShardedModule
from .integrations import hf as _hf  # noqa: F401  (registers its habits with the engine)
from .integrations import hf_accelerate as _hf_accelerate  # noqa: F401  (its prepare check)
from .integrations import lowbit as _lowbit  # noqa: F401  (declares low-bit optimizers)
from .integrations import peft as _peft  # noqa: F401  (registers its habits with the engine)
from .options import Compression, MixedPrecision, Offload
from .planning.allocations import AllocationTracker, track_allocations
from .planning.planner import estimate_memory
from .runs.logbook import Logbook, SpikeError, Spikes
from .tiers.offload import StoreError

__all__ = [
    "AllocationTracker",
    "CollectiveFailed",
    "CommStats",
    "Compression",
    "Logbook",
    "Mesh",
    "MixedPrecision",
    "Offload",
    "PendingSave",
    "ShardedGradScaler",
    "ShardedModule",
    "SpikeError",
    "Spikes",
    "StoreError",
    "declare_optimizer",
    "estimate_memory",
    "export",
    "full_optimizer_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full_optimizer_state_dict",
    "load_pretrained",
    "save_checkpoint",
    "track_allocations",
]

# Submodules that import a library of their own (transformers, Lightning): made on first use,
# so that shardwrap.hf.Trainer works after `import shardwrap` alone, as the docs write it.
_ON_FIRST_USE = ("hf", "lightning")


def __getattr__(name: str) -> Any:
    if name in _ON_FIRST_USE:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
