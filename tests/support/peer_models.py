"""Small models of the shapes the peers tier's upstream tests use (FSDP2's ``MLP``,
``DoubleLinear`` and chunked-head model), with odd sizes so that pieces split parameters.

Build them seeded and deep-copy them per side (``tests/support/peers.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["MLP", "ChunkedHead", "DoubleLinear", "FirstLinear"]


class MLP(nn.Module):
    """``in_proj``, ReLU, ``out_proj``: the unit FSDP2's tests wrap most."""

    def __init__(self, dim: int = 9, multiplier: int = 3, bias: bool = True) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim * multiplier, bias=bias)
        self.out_proj = nn.Linear(dim * multiplier, dim, bias=bias)

    def forward(self, x: Tensor) -> Tensor:  # x: (..., dim)
        return self.out_proj(F.relu(self.in_proj(x)))


class FirstLinear(nn.Linear):
    """``DoubleLinear.lin1``'s own class, so that a policy can make it a unit alone."""


class DoubleLinear(nn.Module):
    """Two linear layers; with ``use_second_linear`` both outputs are returned, else ``lin2``
    is never used (FSDP2's unused-output and unused-module cases)."""

    def __init__(self, dim: int = 11, use_second_linear: bool = True) -> None:
        super().__init__()
        self.lin1 = FirstLinear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)
        self.use_second_linear = use_second_linear

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:  # x: (B, dim)
        if self.use_second_linear:
            return torch.relu(self.lin1(x)), torch.relu(self.lin2(x))
        return torch.relu(self.lin1(x))


class ChunkedHead(nn.Module):
    """Embedding, body, norm and a vocabulary head; ``forward(tokens, skip_head=True)`` stops
    before the head, for a loss that runs the head chunk by chunk. ``tie``: the head shares
    the embedding's weight."""

    def __init__(self, dim: int = 10, vocab: int = 23, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor, skip_head: bool = False) -> Tensor:  # tokens: (B, T)
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)
