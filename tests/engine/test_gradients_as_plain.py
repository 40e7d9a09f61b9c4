"""Gradients exactly where a plain model has them: unused parameters keep ``None``, gradients
accumulated under ``no_sync`` survive a backward split in several calls, a parameter unfrozen
after wrapping trains, and ``register_post_accumulate_grad_hook`` fires on the parameters.

Each case trains a sharded model (2 ranks as threads, each on its half of the global batch, the
loss a mean) beside a deep-copied plain model on the whole batch, at stages 1, 2 and 3, and
compares the parameters after several steps (SGD with momentum within 1e-5; AdamW where its
weight decay or momentum would move a parameter that wrongly had a zero gradient).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_gradients_as_plain.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.ranks import run_ranks

WORLD = 2
STAGES = [1, 2, 3]
ATOL = 1e-5


class Block(nn.Module):
    """Two linears; ``skip`` leaves the second unused (its parameters get no gradient)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: Tensor, skip: bool = False) -> Tensor:
        h = torch.tanh(self.a(x))
        return h if skip else h + self.b(h)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor, skip: bool = False) -> Tensor:
        return self.head(self.b2(self.b1(x, skip), skip))


Step = Callable[[nn.Module, Tensor, int, int], None]  # (model, its batch slice, step, rank)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches(steps: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(6 * WORLD, 8, generator=g) for _ in range(steps)]


def _train(
    model: nn.Module,
    stage: int,
    step: Step,
    make_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
    steps: int = 3,
    before: Callable[[nn.Module], None] | None = None,
) -> tuple[dict[str, Tensor], list[dict[str, Tensor]]]:
    """The plain model's state after ``steps`` of ``step`` on the whole batch, and each rank's
    full state after the same on its half (``before(model)`` runs after wrapping)."""
    batches = _batches(steps)

    def run(m: nn.Module, rank: int, world: int) -> None:
        if before is not None:
            before(m)
        opt = make_optimizer(m)
        for i, x in enumerate(batches):
            step(m, x.chunk(world)[rank], i, rank if world > 1 else -1)
            opt.step()
            opt.zero_grad()

    plain = copy.deepcopy(model)
    run(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block, stage=stage)
        run(m, rank, WORLD)
        return m.full_state_dict()

    return plain.state_dict(), run_ranks(WORLD, fn, timeout=30)


def _assert_same(want: dict[str, Tensor], runs: list[dict[str, Tensor]]) -> None:
    for rank, got in enumerate(runs):
        torch.testing.assert_close(
            got, dict(want), atol=ATOL, rtol=0, msg=lambda m, r=rank: f"rank {r}: {m}"
        )


def _sgd(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=0.02, weight_decay=0.1)


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_unused_in_a_used_unit_keeps_grad_none(stage: int) -> None:
    """Each block's ``b`` is unused in every step: its ``.grad`` stays ``None`` on every rank
    (not zeros), so AdamW's decay and momentum leave it as the plain model's AdamW does."""
    seen: list[list[str]] = []

    def step(m: nn.Module, x: Tensor, i: int, rank: int) -> None:
        m(x, skip=True).square().mean().backward()
        seen.append(sorted(n for n, p in m.named_parameters() if p.grad is not None))

    want, runs = _train(_net(), stage, step, _adamw)
    _assert_same(want, runs)
    plain = ["b1.a.bias", "b1.a.weight", "b2.a.bias", "b2.a.weight", "head.bias", "head.weight"]
    assert all(names == plain for names in seen), seen


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_used_on_one_rank_only_gets_its_gradient_on_every_rank(stage: int) -> None:
    """Rank 1 skips the ``b`` layers, rank 0 uses them: their gradient is rank 0's over two,
    as in the plain model whose batch only half uses them."""

    def step(m: nn.Module, x: Tensor, i: int, rank: int) -> None:
        if rank < 0:  # the plain model: each half as its rank runs it
            halves = x.chunk(WORLD)
            loss = (m(halves[0]).square().mean() + m(halves[1], skip=True).square().mean()) / 2
        else:
            loss = m(x, skip=rank == 1).square().mean()
        loss.backward()

    want, runs = _train(_net(), stage, step, _adamw)
    _assert_same(want, runs)


@pytest.mark.parametrize("stage", STAGES)
def test_no_sync_then_a_backward_split_in_two_keeps_what_was_accumulated(stage: int) -> None:
    """Two micro-batches under ``no_sync``, then a synced step whose backward comes in two
    calls (the head's first, as a chunked loss does, then the blocks' through ``h.backward``):
    the blocks' accumulated gradients are reduced with the first call and kept."""

    def step(m: nn.Module, x: Tensor, i: int, rank: int) -> None:
        sync = getattr(m, "no_sync", None)
        for micro in x.chunk(3)[:2]:
            if sync is not None:
                with sync():
                    m(micro).square().mean().div(3).backward()
            else:
                m(micro).square().mean().div(3).backward()
        last = x.chunk(3)[2]
        h = m.b2(m.b1(last))
        cut = h.detach().requires_grad_(True)
        m.head(cut).square().mean().div(3).backward()
        h.backward(cut.grad)

    want, runs = _train(_net(), stage, step, _sgd)
    _assert_same(want, runs)


@pytest.mark.parametrize("stage", STAGES)
def test_a_parameter_frozen_when_wrapped_trains_once_unfrozen(stage: int) -> None:
    """``b1.a`` frozen at wrap time (its unit has a frozen group), unfrozen after wrapping and
    again before the second step of the plain model: it trains from then on, as in plain
    PyTorch (progressive unfreezing)."""
    model = _net()
    model.b1.a.requires_grad_(False)

    def step(m: nn.Module, x: Tensor, i: int, rank: int) -> None:
        if i == 1:
            m.b1.a.requires_grad_(True)
        m(x).square().mean().backward()

    want, runs = _train(model, stage, step, _sgd)
    _assert_same(want, runs)
    assert not torch.equal(want["b1.a.weight"], model.b1.a.weight), "b1.a never trained"


def test_unfreezing_on_one_rank_only_raises_on_every_rank() -> None:
    """Ranks that unfroze different parameters would reduce different groups: every rank raises
    at the next forward, naming the cause."""
    model = _net()
    model.b1.a.requires_grad_(False)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block)
        if rank == 0:
            m.b1.a.requires_grad_(True)
        with pytest.raises(RuntimeError, match="changed differently across ranks") as info:
            m(torch.randn(2, 8)).sum().backward()
        return str(info.value)

    assert all("requires_grad_(True)" in m for m in run_ranks(WORLD, fn, timeout=30))


@pytest.mark.parametrize("stage", STAGES)
def test_post_accumulate_grad_hooks_fire_on_the_parameters(stage: int) -> None:
    """The optimizer-in-backward pattern: one SGD per parameter, stepped and zeroed from the
    parameter's post-accumulate-grad hook, trains as on the plain model; each hook fires once
    per backward, after the parameter's ``.grad`` is complete."""
    fired: list[int] = []

    def hooked(m: nn.Module) -> None:
        optimizers = {p: torch.optim.SGD([p], lr=0.1, momentum=0.9) for p in m.parameters()}

        def hook(p: Tensor) -> None:
            fired.append(id(p))
            optimizers[p].step()
            optimizers[p].zero_grad()

        for p in m.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def step(m: nn.Module, x: Tensor, i: int, rank: int) -> None:
        m(x).square().mean().backward()
        assert all(p.grad is None for p in m.parameters())  # each hook zeroed its own

    def nothing(m: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)

    want, runs = _train(_net(), stage, step, nothing, before=hooked)
    _assert_same(want, runs)
    params = len(list(_net().parameters()))
    assert len(fired) == 3 * params * (1 + WORLD), len(fired)
