"""Labels that name shardwrap's phases in a profiler trace.

A user's ``torch.profiler`` trace shows each hook shardwrap runs as a range named
``shardwrap::<phase>`` (``pre_forward``, ``post_forward``, ``pre_backward``, ``post_backward``,
``end_backward``, ``reduce``), so the time a step spends gathering, reducing or waiting is
told apart from the model's own. Without a profiler recording, a label costs one check.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

__all__ = ["label"]


def label(phase: str) -> AbstractContextManager[object]:
    """A profiler range ``shardwrap::<phase>`` while a profiler records; else nothing."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"shardwrap::{phase}")
    return nullcontext()
