"""``torch.save`` refuses an object holding a rank's pieces before it opens the file.

Design note. A rank's pieces (:class:`~shardwrap.engine.optim.pieces.ShardPiece`,
:class:`~shardwrap.engine.optim.dcp_pieces.DCPPiece`, the shard parameters themselves and their
``data``) and the sharded model itself (``torch.save(model)``) refuse to be pickled, but
``torch.save`` opens (and so truncates) its file before it pickles anything: a DDP script's
``torch.save(model.state_dict(), "ckpt.pt")`` would raise, and the ``ckpt.pt`` it was replacing
would be gone. So the first piece of each kind made registers its class here, and the first
registration wraps ``torch.save`` (``torch.save`` and ``torch.serialization.save``, the same
function) once in the process: the object is searched through its dicts, lists and tuples for
an instance of a registered class (a module's parameters too: a submodule of a sharded model
holds pieces), whose own refusal (its ``__reduce_ex__``) raises before torch's save runs.
Every other object is saved by torch's function as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["guard_torch_save"]

_refused: tuple[type, ...] = ()  # the classes whose instances torch.save refuses


def guard_torch_save(*classes: type) -> None:
    """Make ``torch.save`` refuse any object holding an instance of one of ``classes`` (whose
    ``__reduce_ex__`` raises) before it opens the file; wraps ``torch.save`` the first time."""
    global _refused
    new = tuple(cls for cls in classes if cls not in _refused)
    if not new:
        return
    if not _refused:
        save = torch.serialization.save

        @functools.wraps(save)
        def guarded(obj: object, f: Any, *args: Any, **kwargs: Any) -> Any:
            piece = _find(obj)
            if piece is not None:
                piece.__reduce_ex__(2)  # raises, naming what to call instead
            return save(obj, f, *args, **kwargs)

        torch.save = torch.serialization.save = guarded
    _refused = (*_refused, *new)


def _find(obj: object) -> Any:
    """The first instance of a refused class in ``obj``, its mappings, lists and tuples."""
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, _refused):
            return item
        if isinstance(item, Mapping | list | tuple) and id(item) not in seen:
            seen.add(id(item))  # a state dict may hold the same list twice
            stack.extend(item.values() if isinstance(item, Mapping) else item)
        elif isinstance(item, nn.Module):  # a submodule of a sharded model holds pieces
            stack.extend(item.parameters())
    return None
