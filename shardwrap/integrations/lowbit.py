"""Low-bit optimizers: torchao's (``AdamW8bit``, ``AdamW4bit``, ``AdamWFp8`` and their Adam
kin) and bitsandbytes' (``AdamW8bit`` and every other of its optimizers) step whole parameters,
each on its owner rank.

Design note. Both libraries keep a parameter's optimizer state quantized in blocks of its
flattened elements (256 or 128, one scale per block), and keep it in float32 instead where the
parameter has fewer than 4096 elements or is no multiple of the block. On a rank's piece of a
parameter both the blocks and that choice would follow the world size: a ``(6, 1024)`` weight
would get 8-bit state at one rank and float32 state at two (pytorch/ao#4912), and its blocks'
scales would span other elements. Stepped whole on an owner (``engine/optim/whole_params.py``),
the state is the unwrapped model's, block for block, at any world size, and 1/N of it lies on
each rank by owners. They are declared by name, so that neither library is imported here.

bitsandbytes' per-parameter settings (``GlobalOptimManager.override_config(p, "optim_bits",
32)``, made before wrapping as its documentation shows) are kept by the parameter object's
``id``: wrapping replaces the parameter, so each is moved onto its shard parameter, which the
optimizer is built over (else it stepped 8-bit state where the setting asked for 32, without a
word).
"""

from __future__ import annotations

import sys

from torch import nn

from ..engine.optim.whole_params import declare_optimizer_name
from ..engine.wrap.extensions import register_param_replaced

__all__ = ["LOW_BIT"]

# The classes that define their optimizers' ``step``, as "module.QualName".
LOW_BIT = (
    "torchao.optim.adam._AdamBase",
    "bitsandbytes.optim.optimizer.Optimizer8bit",
)

for _name in LOW_BIT:
    declare_optimizer_name(_name, reads_shapes=True)


def _carry_bitsandbytes_settings(original: nn.Parameter, shard_param: nn.Parameter) -> None:
    """Move ``original``'s bitsandbytes settings, if any, onto ``shard_param``."""
    optimizer = sys.modules.get("bitsandbytes.optim.optimizer")
    if optimizer is None:  # not imported: nobody made a setting
        return
    settings = optimizer.GlobalOptimManager.get_instance().pid2config
    if id(original) in settings:
        settings[id(shard_param)] = settings.pop(id(original))


register_param_replaced(_carry_bitsandbytes_settings)
