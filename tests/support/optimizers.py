"""Optimizers that check, while they step, what the tests cannot see from outside."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable
from typing import Any

import torch

import shardwrap
from tests.support.models import Block, make_batch
from tests.support.parity import fp32_grads


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


def fp32_grad_runs(
    model: torch.nn.Module,
    rank: int,
    pg: Any,
    tier: shardwrap.Offload,
    in_tier: Callable[[torch.nn.Module, torch.Tensor], bool],
) -> list[tuple[list[float], dict[str, torch.Tensor]]]:
    """``model`` (the tests' GPT in bfloat16) wrapped by ``Block`` over 2 ranks with float32
    as its parameters' ``grad_dtype``, without offload and in ``tier``: three steps of SGD with
    momentum on this rank's slice of ``make_batch``'s batches of 4, then one more backward,
    whose every ``.grad`` must be float32 and, in ``tier``, ``in_tier(model, grad)``. Each
    run's losses and full state."""
    runs = []
    for offload in (None, tier):
        m = shardwrap.ShardedModule(
            fp32_grads(copy.deepcopy(model)), auto_wrap=Block, process_group=pg, offload=offload
        )
        optimizer = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        losses = []
        for step in range(3):
            x, y = make_batch(step, 4)
            loss = m(x.chunk(2)[rank], y.chunk(2)[rank])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
        x, y = make_batch(3, 4)
        m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        assert all(p.grad.dtype == torch.float32 for p in m.parameters())
        assert offload is None or all(in_tier(m, p.grad) for p in m.parameters())
        runs.append((losses, m.full_state_dict()))
    return runs


def runs_with_a_zero_grad(
    model: torch.nn.Module, rank: int, pg: Any, tier: shardwrap.Offload
) -> list[dict[str, torch.Tensor]]:
    """``model`` (the tests' GPT) wrapped by ``Block`` over 2 ranks three times: trained by
    :func:`micro_batches_with_a_zero_grad` without offload and in ``tier``, then without
    offload and without the micro-batch the ``zero_grad()`` drops; each one's full state."""
    runs = []
    for offload, first in ((None, True), (tier, True), (None, False)):
        m = shardwrap.ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, process_group=pg, offload=offload
        )
        micro_batches_with_a_zero_grad(m, rank, first)
        runs.append(m.full_state_dict())
    return runs


def micro_batches_with_a_zero_grad(model: torch.nn.Module, rank: int, first: bool) -> None:
    """Two steps of unfused SGD with momentum (an offload tier would choose torch's fused
    kernel, which rounds otherwise) of ``model`` (the tests' GPT, sharded over 2 ranks), each
    over three micro-batches of ``make_batch``'s batches of 4, the first two under
    ``no_sync()``, with ``zero_grad()`` after the first; ``first=False``: without it."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=False)
    for step in range(2):
        for micro in range(0 if first else 1, 3):
            x, y = make_batch(3 * step + micro, 4)
            loss = model(x.chunk(2)[rank], y.chunk(2)[rank])
            with model.no_sync() if micro < 2 else contextlib.nullcontext():
                loss.backward()
            if micro == 0:
                optimizer.zero_grad()
        optimizer.step()
        optimizer.zero_grad()
