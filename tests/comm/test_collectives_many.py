"""Several gathers or reductions as one exchange (``comm/collectives.py``: ``all_gather_many``,
``reduce_scatter_many``).

Proves, at 1, 2 and 3 ranks, with items of several dtypes (float32, bfloat16, int64 for
gathers) and sizes (empty, odd, not a multiple of the packing's alignment):

- each item comes out exactly, bit for bit, as the same collective issued for it alone;
- a shard cast into its own slot (another dtype than the output) is gathered like that;
- the whole exchange counts as one call in ``CommStats``, with every item's bytes;
- ``packing`` starts every item at an aligned offset and sizes the buffer to hold them all.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_collectives_many.py -q``
"""

from __future__ import annotations

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import CommStats
from shardwrap.comm.collectives import (
    ALIGN,
    all_gather,
    all_gather_many,
    packing,
    reduce_scatter,
    reduce_scatter_many,
)
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # collectives alone: no stage involved

# (shard numel, output dtype, shard dtype)
GATHERS = [
    (5, torch.float32, torch.float32),
    (0, torch.float32, torch.float32),
    (7, torch.bfloat16, torch.float32),
    (3, torch.int64, torch.int64),
    (33, torch.bfloat16, torch.bfloat16),
]
REDUCTIONS = [(5, torch.float32), (0, torch.float32), (9, torch.bfloat16), (17, torch.float32)]


def _shard(n: int, dtype: torch.dtype, rank: int, item: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * item + rank)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (n,), generator=g, dtype=dtype)


def _gathers(rank: int, pg: ProcessGroup | None) -> tuple[list, list, dict]:
    world = 1 if pg is None else pg.size()
    shards = [_shard(n, sd, rank, i) for i, (n, _, sd) in enumerate(GATHERS)]
    alone = [torch.empty(n * world, dtype=od) for n, od, _ in GATHERS]
    for out, shard in zip(alone, shards):
        all_gather(out, shard, pg).wait()
    many = [torch.full((n * world,), 7, dtype=od) for n, od, _ in GATHERS]
    stats = CommStats()
    all_gather_many(many, shards, pg, stats).wait()
    return alone, many, dict(stats.calls)


def _reductions(rank: int, pg: ProcessGroup | None) -> tuple[list, list, dict]:
    world = 1 if pg is None else pg.size()
    fulls = [_shard(n * world, dt, rank, i) for i, (n, dt) in enumerate(REDUCTIONS)]
    alone = [torch.empty(n, dtype=dt) for n, dt in REDUCTIONS]
    for out, full in zip(alone, fulls):
        reduce_scatter(out, full.clone(), pg).wait()
    many = [torch.full((n,), 7, dtype=dt) for n, dt in REDUCTIONS]
    stats = CommStats()
    reduce_scatter_many(many, [f.clone() for f in fulls], pg, stats).wait()
    return alone, many, dict(stats.calls)


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("kind", ["gather", "reduce"])
def test_many_equals_each_alone(world: int, kind: str) -> None:
    fn = _gathers if kind == "gather" else _reductions
    results = [fn(0, None)] if world == 1 else run_ranks(world, fn)
    for alone, many, calls in results:
        for a, m in zip(alone, many):
            assert m.dtype == a.dtype and torch.equal(m, a)
        name = "all_gather" if kind == "gather" else "reduce_scatter"
        assert calls == {name: 1}


def test_packing_aligns_every_item() -> None:
    offsets, total = packing([5, 0, 16, 1, 33])
    assert offsets == [0, 16, 16, 32, 48]
    assert total == 96
    assert all(o % ALIGN == 0 for o in offsets)
