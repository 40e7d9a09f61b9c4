"""An optimizer wrapper that keeps its state in the optimizer it wraps, written as timm's
``Lookahead`` is (no ``Optimizer.__init__`` of its own, the inner optimizer's ``param_groups``
shared, ``state_dict()`` the inner one's): it trains, saves and resumes a sharded model like the
plain model. It had failed at its first step (torch's state-dict hook dicts, which it never
made, were looked up on it) and, given them, saved no optimizer state without a word
(``save_checkpoint`` and ``full_optimizer_state_dict`` read the wrapper's own empty ``state``).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_optimizer_wrappers.py``
"""

from __future__ import annotations

import collections
import copy
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule
from tests.support.ranks import run_ranks

WORLD, STEPS = 2, 4


class Lookahead(torch.optim.Optimizer):
    """Every ``k`` steps, the slow weights move ``alpha`` of the way to the fast ones, which
    restart from them; the slow weights are kept in the inner optimizer's state."""

    def __init__(self, base: torch.optim.Optimizer, alpha: float = 0.5, k: int = 2) -> None:
        self._base, self.alpha, self.k = base, alpha, k
        self.param_groups = base.param_groups
        self.defaults = base.defaults
        self.state: dict[Any, Any] = collections.defaultdict(dict)
        self._optimizer_step_pre_hooks: dict[int, Any] = {}
        self._optimizer_step_post_hooks: dict[int, Any] = {}
        for group in base.param_groups:
            group.setdefault("lookahead_step", 0)

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = self._base.step(closure)
        for group in self._base.param_groups:
            group["lookahead_step"] += 1
            if group["lookahead_step"] % self.k:
                continue
            for fast in group["params"]:
                state = self._base.state[fast]
                if "slow" not in state:
                    state["slow"] = torch.empty_like(fast).copy_(fast)
                state["slow"].add_(fast - state["slow"], alpha=self.alpha)
                fast.copy_(state["slow"])
        return loss

    def state_dict(self) -> dict[str, Any]:
        return self._base.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._base.load_state_dict(state_dict)
        self.param_groups = self._base.param_groups


def make(params: Iterable[nn.Parameter]) -> Lookahead:
    return Lookahead(torch.optim.SGD(params, lr=0.1, momentum=0.9))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)
    )


def batches() -> list[Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(4 * WORLD, 6, generator=g) for _ in range(STEPS)]


def train(
    model: nn.Module, opt: torch.optim.Optimizer, xs: list[Tensor], rank: int, world: int
) -> None:
    for x in xs:
        model(x.chunk(world)[rank]).square().mean().backward()
        opt.step()
        opt.zero_grad()


def test_a_wrapper_keeping_its_state_in_the_inner_optimizer_trains_saves_and_resumes(
    tmp_path: Path,
) -> None:
    plain = build()
    plain_opt = make(plain.parameters())
    train(plain, plain_opt, batches()[:2], 0, 1)
    halfway = copy.deepcopy(plain_opt.state_dict())
    train(plain, plain_opt, batches()[2:], 0, 1)
    assert {k for entry in halfway["state"].values() for k in entry} == {"momentum_buffer", "slow"}

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(build(), process_group=pg)
        opt = make(m.parameters())
        train(m, opt, batches()[:2], rank, WORLD)
        full = shardwrap.full_optimizer_state_dict(m, opt)
        torch.testing.assert_close(full["state"], halfway["state"], atol=1e-6, rtol=0)
        shardwrap.save_checkpoint(tmp_path / "step-2", m, opt, step=2)
        again = ShardedModule(build(), process_group=pg)
        resumed = make(again.parameters())
        scheduler = torch.optim.lr_scheduler.StepLR(resumed, step_size=1, gamma=1.0)
        shardwrap.load_checkpoint(tmp_path / "step-2", again, resumed)
        assert resumed.param_groups is resumed._base.param_groups  # the scheduler reaches them
        assert scheduler.optimizer is resumed
        train(again, resumed, batches()[2:], rank, WORLD)
        return again.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=60):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=1e-5, rtol=0)
