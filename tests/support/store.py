"""Where a tensor lives with the disk tier: the check that state is in the store's files."""

from __future__ import annotations

from torch import Tensor, nn


def in_store(model: nn.Module, t: Tensor) -> bool:
    """Whether all of ``t``'s memory is one of the files the model's disk tier maps (so none of
    it is anonymous memory); an empty tensor has no memory to place."""
    if t.numel() == 0:
        return True
    storage = t.untyped_storage()
    start, stop = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    maps = model._shardwrap_root.home._maps
    return any(base <= start and stop <= base + length for base, length, _ in maps.values())
