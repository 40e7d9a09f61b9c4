"""Optimizers that check, while they step, what the tests cannot see from outside."""

from __future__ import annotations

from typing import Any

import torch

import shardwrap
from tests.support.models import make_batch


class SGDKeepingGrads(torch.optim.SGD):
    """SGD with momentum that keeps each ``.grad`` it steps on past ``zero_grad()`` and, at its
    next step, checks that they still hold the values they had: a gradient buffer reused from
    step to step must not be while anything else holds it."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, lr=0.1, momentum=0.9)
        self.kept: list[tuple[torch.Tensor, torch.Tensor]] = []

    def step(self) -> None:  # type: ignore[override]
        for grad, values in self.kept:
            assert torch.equal(grad, values), "a gradient kept past zero_grad() was overwritten"
        self.kept = [
            (p.grad, p.grad.clone())
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        super().step()


shardwrap.declare_optimizer(SGDKeepingGrads, reads_shapes=False)  # its own step, elementwise


class MuonAndAdamW:
    """Muon over the matrices and AdamW over the rest, stepped as one, as torch's documentation
    advises Muon be used."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        self.optimizers = (
            torch.optim.Muon([p for p in params if p.ndim == 2]),
            torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
        )

    def step(self) -> None:
        for optimizer in self.optimizers:
            optimizer.step()

    def zero_grad(self) -> None:
        for optimizer in self.optimizers:
            optimizer.zero_grad()


class MuonAndSGD(MuonAndAdamW):
    """Muon over the matrices and SGD with momentum over the rest: exact where AdamW would turn
    rounding in parameters whose true gradient is zero (attention key biases) into noise."""

    def __init__(self, params: Any) -> None:
        params = list(params)
        self.optimizers = (
            torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-3),
            torch.optim.SGD([p for p in params if p.ndim != 2], lr=0.05, momentum=0.9),
        )


def overflow_at_the_second_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    rank: int,
    world: int,
    device: torch.device,
) -> list[tuple[bool, float]]:
    """Three steps of ``model`` (the tests' GPT) under ``scaler`` on this rank's slice of
    ``make_batch``'s batches of 4 on ``device``, with an inf written into rank 0's piece of the
    first non-empty parameter's gradient at the second: each step's :func:`scaled_step`."""
    seen = []
    for step in range(3):
        x, y = (t.to(device) for t in make_batch(step, 4))
        scaler.scale(model(x.chunk(world)[rank], y.chunk(world)[rank])).backward()
        if step == 1 and rank == 0:
            grad = next(p for p in model.parameters() if p.numel()).grad
            grad.view(-1)[0] = float("inf")
        seen.append(scaled_step(scaler, optimizer, model))
    return seen


def scaled_step(
    scaler: torch.amp.GradScaler, optimizer: torch.optim.Optimizer, model: torch.nn.Module
) -> tuple[bool, float]:
    """``scaler.step(optimizer)``, ``scaler.update()`` and ``zero_grad()``, after a backward of
    a scaled loss: whether the step changed any of ``model``'s parameters, and the new scale."""
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad()
    stepped = not all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return stepped, scaler.get_scale()
