"""``torch.save`` refuses a state dict holding a rank's pieces before it opens the file.

Design note. A :class:`~shardwrap.engine.optim.pieces.ShardPiece` refuses to be pickled, but
``torch.save`` opens (and so truncates) its file before it pickles anything: a DDP script's
``torch.save(model.state_dict(), "ckpt.pt")`` would raise, and the ``ckpt.pt`` it was replacing
would be gone. So the first piece handed out wraps ``torch.save`` (``torch.save`` and
``torch.serialization.save``, the same function) once in the process: the object is searched
for a piece through its dicts, lists and tuples, and a piece found raises its refusal before
torch's own save runs. Every other object is saved by torch's function as it was.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["guard_torch_save"]

_original: list[Callable[..., Any]] = []  # torch's own save, once wrapped


def guard_torch_save(is_piece: Callable[[Tensor], bool], refuse: Callable[[Tensor], None]) -> None:
    """Wrap ``torch.save`` (once) so that an object holding a tensor ``is_piece`` accepts is
    handed to ``refuse`` (which raises) before the file is opened."""
    if _original:
        return
    save = torch.serialization.save
    _original.append(save)

    @functools.wraps(save)
    def guarded(obj: object, f: Any, *args: Any, **kwargs: Any) -> Any:
        piece = _find(obj, is_piece)
        if piece is not None:
            refuse(piece)
        return save(obj, f, *args, **kwargs)

    torch.save = torch.serialization.save = guarded


def _find(obj: object, is_piece: Callable[[Tensor], bool]) -> Tensor | None:
    """The first tensor ``is_piece`` accepts in ``obj``, its mappings, lists and tuples."""
    stack, seen = [obj], set()
    while stack:
        item = stack.pop()
        if isinstance(item, Tensor):
            if is_piece(item):
                return item
        elif isinstance(item, Mapping | list | tuple) and id(item) not in seen:
            seen.add(id(item))  # a state dict may hold the same list twice
            stack.extend(item.values() if isinstance(item, Mapping) else item)
    return None
