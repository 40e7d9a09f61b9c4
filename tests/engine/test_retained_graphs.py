"""Backward through graphs kept past a backward: a graph retained (``retain_graph=True``) and
run through again after another forward of the model, a gradient penalty
(``torch.autograd.grad(..., create_graph=True)``) followed by another forward before the one
backward (WGAN-GP's critic step), and a retained graph run through after an optimizer step,
which torch refuses on the unwrapped model.

Each trains a sharded model (ranks as threads, each on its slice) and a deep-copied plain one
on the whole batch side by side with SGD with momentum; parameters agree within 1e-5.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_retained_graphs.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.ranks import run_ranks

WORLD = 2


class Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.Sequential(Residual(), Residual())
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.out(self.blocks(torch.tanh(self.inp(x))))


torch.manual_seed(0)
BASE = Net()
_g = torch.Generator().manual_seed(1)
BATCHES = [(torch.randn(8, 6, generator=_g), torch.randn(8, 6, generator=_g)) for _ in range(3)]

Step = Callable[[nn.Module, Tensor, Tensor], None]


def retained_then_forward(m: nn.Module, x: Tensor, x2: Tensor) -> None:
    first = m(x).square().mean()
    first.backward(retain_graph=True)
    second = (m(x2) - 1).square().mean()
    (0.5 * first + second).backward()


def penalty_then_forward(m: nn.Module, x: Tensor, x2: Tensor) -> None:
    x = x.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(m(x).sum(), x, create_graph=True)
    ((grad**2).sum(dim=1).mean() + m(x2).mean()).backward()


def _parity(step: Step, **wrap: object) -> None:
    plain = copy.deepcopy(BASE)
    opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    for x, x2 in BATCHES:
        step(plain, x, x2)
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(BASE), process_group=pg, auto_wrap=Residual, **wrap)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        for x, x2 in BATCHES:
            step(m, x.chunk(WORLD)[rank], x2.chunk(WORLD)[rank])
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        for name, want in plain.state_dict().items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=name)


def test_a_retained_graph_run_through_after_another_forward_trains_like_the_plain_model() -> None:
    """At stage 3 a unit's buffer went once the newer forward's backward had read it, while
    the retained graph still had views of it to read: backward raised that the group was not
    gathered. A unit whose buffers went is gathered again for it."""
    _parity(retained_then_forward)


def test_a_gradient_penalty_then_another_forward_trains_like_the_plain_model() -> None:
    """WGAN-GP's critic step: the penalty's double-backward graph is kept while the model runs
    another forward, then one backward goes through both. At stage 3 it raised that a group
    was not gathered; at stages 1 and 2 torch raised that a tensor it saved was modified in
    place: the penalty's backward marked the units to gather again, and the forward gathered
    into the buffer the penalty's graph holds. A backward that gives no parameter a gradient
    now leaves them gathered (an optimizer step marks what it steps)."""
    _parity(penalty_then_forward)


def test_a_retained_graph_run_through_after_an_optimizer_step_raises_as_torch_does() -> None:
    """The unwrapped model raises that a variable backward needs was modified in place. A
    sharded model rebuilt the saved views over the stepped weights and trained on gradients
    of neither the old weights nor the new, without a word, at every stage. Now it raises
    too, on every rank, naming the step."""
    plain = copy.deepcopy(BASE)
    x, _ = BATCHES[0]

    def stepped_between(m: nn.Module, x: Tensor) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        loss = m(x).square().mean()
        loss.backward(retain_graph=True)
        opt.step()
        loss.backward()

    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stepped_between(plain, x)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(BASE), process_group=pg, auto_wrap=Residual)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as raised:
            stepped_between(m, x.chunk(WORLD)[rank])
        retained_then_forward(m, x.chunk(WORLD)[rank], x.chunk(WORLD)[rank])  # trains on
        return str(raised.value)

    for said in run_ranks(WORLD, fn, timeout=30):
        assert "an optimizer stepped" in said


class _Pair(nn.Module):
    """A generator and a critic in one module, whose root unit holds a parameter of each."""

    def __init__(self) -> None:
        super().__init__()
        self.gen = nn.Sequential(Residual(), nn.Linear(8, 8))
        self.critic = nn.Sequential(Residual(), nn.Linear(8, 1))


def _gan_round(m: nn.Module, z: Tensor, real: Tensor, gen_opt: Any, critic_opt: Any) -> None:
    """DCGAN's order: the fake made once, the critic stepped, then the generator's loss
    through the graph made before the critic's step."""
    fake = m.gen(z)
    (m.critic(fake.detach()).mean() - m.critic(real).mean()).backward()
    critic_opt.step()
    critic_opt.zero_grad()
    (-m.critic(fake).mean()).backward()
    gen_opt.step()
    gen_opt.zero_grad()
    critic_opt.zero_grad()


def test_a_graph_over_parameters_no_step_changed_runs_as_on_the_plain_model() -> None:
    """A step was taken to change every parameter of each flat group it touched: the
    generator's graph, made before the critic's optimizer stepped, was refused as modified
    ("an optimizer stepped gen.1.weight"), where the two share the root unit, and so was a
    graph followed by a step in which no parameter had a gradient. Now only the parameters a
    step changes (those with a gradient) count: both run as on the unwrapped model, and a
    graph whose own weights were stepped is still refused."""
    torch.manual_seed(0)
    base = _Pair()
    rounds = [(torch.randn(8, 8, generator=_g), torch.randn(8, 8, generator=_g)) for _ in range(3)]

    def train(m: nn.Module, rank: int, world: int) -> None:
        gen_opt = torch.optim.SGD(m.gen.parameters(), lr=0.1, momentum=0.9)
        critic_opt = torch.optim.SGD(m.critic.parameters(), lr=0.1, momentum=0.9)
        for z, real in rounds:
            _gan_round(m, z.chunk(world)[rank], real.chunk(world)[rank], gen_opt, critic_opt)
        loss = m.gen(rounds[0][0].chunk(world)[rank]).square().mean()
        gen_opt.step()  # no gradient: changes nothing
        loss.backward()

    plain = copy.deepcopy(base)
    train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(base), process_group=pg, auto_wrap=Residual)
        assert len(m._shardwrap_root.units) == 3  # the root holds gen.1 and critic.1
        train(m, rank, WORLD)
        state = m.full_state_dict()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        opt.zero_grad()
        loss = m.gen(rounds[0][0].chunk(WORLD)[rank]).square().mean()
        loss.backward(retain_graph=True)
        opt.step()
        with pytest.raises(RuntimeError, match=r"an optimizer stepped gen\."):
            loss.backward()
        return state

    for state in run_ranks(WORLD, fn, timeout=30):
        for name, want in plain.state_dict().items():
            torch.testing.assert_close(state[name], want, atol=1e-5, rtol=0, msg=name)
