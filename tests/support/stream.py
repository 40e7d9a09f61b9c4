"""The data the Logbook's tests train on, in process and under torchrun: each rank's batch at
a data position, learnable, or noise where the test corrupts it."""

from __future__ import annotations

import torch
from torch import Tensor

VOCAB, CONTEXT, PER_RANK = 67, 16, 4


def stream(position: int, rank: int, bad: frozenset[int] = frozenset()) -> tuple[Tensor, Tensor]:
    """Rank ``rank``'s batch at ``position``: arithmetic sequences mod the vocabulary (a
    pattern a model learns), or uniform noise at a ``bad`` position."""
    g = torch.Generator().manual_seed(position * 1009 + rank)
    start = torch.randint(VOCAB, (PER_RANK, 1), generator=g)
    stride = torch.randint(1, 4, (PER_RANK, 1), generator=g)
    seq = (start + stride * torch.arange(CONTEXT + 1)) % VOCAB
    if position in bad:
        seq = torch.randint(VOCAB, seq.shape, generator=g)
    return seq[:, :-1], seq[:, 1:]
