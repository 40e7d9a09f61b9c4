"""Buckets (``comm/buckets.py``, ``ShardedModule(bucket_mb=...)``): small units' gathers and
small groups' reductions, each as one exchange.

Proves:

- training with buckets is training without them, bit for bit: reductions sum in the same
  order (at 2 and 4 ranks, in fp32 and bf16 mixed precision, at the suite's stage);
- the exchanges a step makes on a GPT whose units all fit in one bucket: one all-gather for
  forward and none in backward (the final bucket, here every unit, stays gathered for it),
  so stage 3 sends the bytes of stages 1 and 2 with their handshakes; one reduce-scatter at
  every stage; without buckets one per unit and group, and stage 3 gathers again in backward;
- a bucket smaller than the model: no exchange of several units goes over it, and the step
  makes more exchanges than with one bucket but fewer than without;
- a unit's groups (a frozen and a trainable one) gather in one exchange, and a forward's first
  gather (no plan yet) brings the units after it;
- a rank whose forward leaves the agreed plan part-way issues the plan's remaining buckets as
  whole exchanges (its peers, following the plan, wait for them), and training stays exact;
- ``bucket_mb`` that is not a number, or negative, is refused naming the fix (an argument that
  differs across ranks is named by ``tests/api/test_errors.py``).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_buckets.py -q``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap.comm.buckets as buckets
from shardwrap import MixedPrecision, ShardedModule
from tests.support.models import GPT, Block, Branch, make_batch
from tests.support.ranks import run_ranks

STEPS = 3


def _train(
    model: nn.Module, pg: ProcessGroup, rank: int, world: int, **options: Any
) -> tuple[dict[str, Tensor], list[float]]:
    m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, **options)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(seed=step, batch=2 * world)
        loss = m(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return m.full_state_dict(), losses


@pytest.mark.parametrize("precision", [None, MixedPrecision()], ids=["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_buckets_train_bit_for_bit_as_without(world: int, precision: MixedPrecision | None) -> None:
    torch.manual_seed(0)
    model = GPT(depth=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple:
        options = {"mixed_precision": precision}
        return (
            _train(model, pg, rank, world, bucket_mb=0, **options),
            _train(model, pg, rank, world, bucket_mb=4, **options),
        )

    for (alone, alone_losses), (bucketed, bucketed_losses) in run_ranks(world, fn, timeout=60.0):
        assert bucketed_losses == alone_losses
        assert alone.keys() == bucketed.keys()
        assert all(torch.equal(alone[k], bucketed[k]) for k in alone)


def _second_step(model: nn.Module, pg: ProcessGroup, rank: int, **options: Any) -> tuple:
    """The collectives of a step that runs with the plan the first step recorded."""
    m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, **options)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, y = make_batch(seed=0, batch=4)
    for _ in range(2):
        m.comm_stats.reset()
        m(x[2 * rank : 2 * rank + 2], y[2 * rank : 2 * rank + 2]).backward()
        opt.step()
        opt.zero_grad()
    units = m._shardwrap_root.units
    return dict(m.comm_stats.calls), dict(m.comm_stats.bytes), units


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_step_of_small_units_makes_one_exchange_each_way(stage: int) -> None:
    torch.manual_seed(0)
    model = GPT(depth=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple:
        calls, sent, units = _second_step(model, pg, rank, stage=stage)
        assert sum(u.gather_nbytes for u in units) <= 4 * 2**20  # every unit fits one bucket
        alone_calls, alone_sent, _ = _second_step(model, pg, rank, stage=stage, bucket_mb=0)
        return calls, sent, alone_calls, alone_sent, len(units)

    for calls, sent, alone_calls, alone_sent, units in run_ranks(2, fn, timeout=60.0):
        assert sent["reduce_scatter"] == alone_sent["reduce_scatter"]
        regathered = units - 2 if stage == 3 else 0  # all but the root and the last unit
        assert alone_calls["all_gather"] == units + regathered
        assert alone_calls["reduce_scatter"] == units
        assert calls["all_gather"] == 1
        assert calls["reduce_scatter"] == 1
        if stage == 3:  # nothing gathered again in backward, nor agreed for it
            assert sent["all_gather"] < alone_sent["all_gather"]
            assert calls["handshake"] == alone_calls["handshake"] - regathered
        else:
            assert sent["all_gather"] == alone_sent["all_gather"]
            assert calls["handshake"] == alone_calls["handshake"]


@pytest.mark.stage3  # the gathers of stage 3's forward and backward, explicitly
def test_a_small_bucket_splits_the_units_where_one_would_go_over_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = GPT(depth=6)
    exchanges: list[tuple[int, int]] = []  # (gathers in it, bytes of its full buffers)
    many = buckets.all_gather_many

    def recorded(outs: list[Tensor], shards: list[Tensor], *args: Any) -> Any:
        exchanges.append((len(outs), sum(o.numel() * o.element_size() for o in outs)))
        return many(outs, shards, *args)

    monkeypatch.setattr(buckets, "all_gather_many", recorded)
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    limit = 2.5 * block  # two blocks, or the root and a block, but not three blocks

    def fn(rank: int, pg: ProcessGroup, bucket_mb: float) -> tuple:
        calls, _, units = _second_step(model, pg, rank, bucket_mb=bucket_mb)
        return calls["all_gather"], len(units)

    small = run_ranks(2, lambda rank, pg: fn(rank, pg, limit / 2**20), timeout=60.0)
    several = [b for n, b in exchanges if n > 1]
    assert several and all(b <= limit for b in several)
    one = run_ranks(2, lambda rank, pg: fn(rank, pg, 4), timeout=60.0)
    for (gathers, units), (fewest, _) in zip(small, one):
        assert fewest < gathers < units + units - 2


class _FrozenWeight(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.linear.weight.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


@pytest.mark.parametrize("bucket_mb", [0, 4])
def test_a_units_groups_gather_in_one_exchange(bucket_mb: float) -> None:
    model = nn.Sequential(_FrozenWeight(8), _FrozenWeight(8))

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=_FrozenWeight, process_group=pg, bucket_mb=bucket_mb
        )
        assert all(len(u.groups) == 2 for u in m._shardwrap_root.units[1:])
        with torch.no_grad():
            m(torch.randn(2, 8))
        return m.comm_stats.calls["all_gather"]

    # two units of two groups each, in one bucket
    for gathers in run_ranks(2, fn, timeout=30.0):
        assert gathers == (4 if bucket_mb == 0 else 1)


class Reorder(nn.Module):
    """Four units that run in order, or with the middle two swapped where ``swap`` is set; the
    root (the head) is about as large as each."""

    def __init__(self, width: int = 11) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Branch(width) for _ in range(4))
        self.head = nn.Linear(width, width)

    def forward(self, x: Tensor, swap: bool) -> Tensor:  # x: (B, C)
        a, b, c, d = self.layers
        for layer in (a, c, b, d) if swap else (a, b, c, d):
            x = layer(x)
        return self.head(x).sum(-1)


@pytest.mark.stage3  # gathers in forward at every step: stage 3's lifetimes
def test_a_rank_that_leaves_the_plan_part_way_issues_its_buckets_whole() -> None:
    """Two units a bucket: the plan's buckets are [root, a], [b, c], [d]. At step 2 rank 0
    runs c before b: it leaves the plan after [root, a], so it issues [b, c] and [d] whole, as
    rank 1 (following the plan) does, then asks for c, b and d on their own."""
    torch.manual_seed(0)
    model = Reorder()
    x = torch.randn(2, 3, 11)
    swaps = [(False, False), (True, False), (False, False)]  # per step: rank 0's, rank 1's
    layer = sum(p.numel() for p in model.layers[0].parameters()) * 4
    bucket_mb = 2.5 * layer / 2**20

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Branch, process_group=pg, bucket_mb=bucket_mb
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step, swap in enumerate(swaps):
            m(x[rank], swap[rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                schedule = m._shardwrap_root.schedule
                assert schedule._last == [0, 1, 2, 3, 4]
                sizes = [u.gather_nbytes for u in m._shardwrap_root.units]
                assert sizes[0] + sizes[1] + sizes[2] > bucket_mb * 2**20  # [root, a] ...
                assert sizes[2] + sizes[3] <= bucket_mb * 2**20  # ... [b, c] ...
                assert sizes[2] + sizes[3] + sizes[4] > bucket_mb * 2**20  # ... [d]
        return m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for swap in swaps:
        loss = sum(ref(x[r], swap[r]).square().mean() for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
    for got in run_ranks(2, fn, timeout=30.0):
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        (-1, ValueError, "0 or more"),
        (float("inf"), ValueError, "finite"),
        ("4", TypeError, "number of MiB"),
        (True, TypeError, "number of MiB"),
    ],
)
def test_a_bad_bucket_is_refused_naming_the_fix(value: Any, error: type, says: str) -> None:
    with pytest.raises(error, match=says) as info:
        ShardedModule(GPT(depth=2), auto_wrap=Block, bucket_mb=value)
    assert "bucket_mb=4" in str(info.value)
