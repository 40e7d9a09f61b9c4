"""Who is calling: a frame among the last few above a hook.

Design note. Some of the calls shardwrap must tell apart reach it through hooks that are not
told who calls them: DCP asking for a state dict (``dcp_pieces.dcp_call``) or filling an
optimizer's empty state, ``remove_parametrizations`` computing a weight
(``step/own_calls.py``), a ``transformers.Trainer`` or an ``accelerate.Accelerator`` moving or
saving the model (``integrations/``). Each reads the frames above it for the function or the
object it knows, through :func:`caller_frame`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType

__all__ = ["caller_frame"]


def caller_frame(match: Callable[[FrameType], bool], depth: int, skip: int) -> FrameType | None:
    """The first of ``depth`` frames for which ``match`` holds, beginning with the one the
    function calling this reads as ``sys._getframe(skip)``; ``None`` where none does."""
    frame = sys._getframe(skip + 1)
    for _ in range(depth):
        if frame is None:
            return None
        if match(frame):
            return frame
        frame = frame.f_back
    return None
