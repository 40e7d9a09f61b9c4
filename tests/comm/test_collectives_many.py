"""Several gathers or reductions as one exchange (``comm/collectives.py``: ``all_gather_many``,
``reduce_scatter_many``).

Proves, at 1, 2 and 3 ranks, with items of several dtypes (float32, bfloat16, complex64,
int64 for gathers) and sizes (empty, odd, not a multiple of the packing's alignment):

- each item comes out exactly, bit for bit, as the same collective issued for it alone;
- a shard cast into its own slot (another dtype than the output) is gathered like that;
- the whole exchange counts as one call in ``CommStats``, with every item's bytes;
- ``packing`` starts every item at an aligned offset and sizes the buffer to hold them all;
- a complex tensor reaches a backend's own collectives (those a GPU's tensors take) as its
  real and imaginary parts, as NCCL, which has no complex type, needs.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_collectives_many.py -q``
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import CommStats
from shardwrap.comm.collectives import (
    ALIGN,
    all_gather,
    all_gather_many,
    all_reduce,
    all_to_all,
    broadcast,
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
    (4, torch.complex64, torch.complex64),
]
REDUCTIONS = [
    (5, torch.float32),
    (0, torch.float32),
    (9, torch.bfloat16),
    (17, torch.float32),
    (6, torch.complex64),
]


def _shard(n: int, dtype: torch.dtype, rank: int, item: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * item + rank)
    if dtype.is_complex:
        return torch.randn(n, generator=g, dtype=dtype)
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


class _Done:
    def wait(self) -> None:
        pass


class RealOnlyBackend:
    """Two ranks' backend without complex types (NCCL's case): refuses a complex tensor, and
    records the dtype and shape of every tensor it is given."""

    def __init__(self) -> None:
        self.given: list[tuple[torch.dtype, tuple[int, ...]]] = []

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 2

    def _take(self, *tensors: Any) -> _Done:
        for t in tensors:
            for one in t if isinstance(t, list) else [t]:
                assert not one.is_complex(), "a complex tensor reached the backend"
                self.given.append((one.dtype, tuple(one.shape)))
        return _Done()

    def _allgather_base(self, out: torch.Tensor, shard: torch.Tensor) -> _Done:
        return self._take(out, shard)

    def _reduce_scatter_base(self, out: torch.Tensor, full: torch.Tensor, opts: Any) -> _Done:
        return self._take(out, full)

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        return self._take(tensors)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        return self._take(tensors)

    def alltoall(self, outs: list[torch.Tensor], ins: list[torch.Tensor], opts: Any) -> _Done:
        return self._take(outs, ins)


def test_complex_tensors_reach_a_backends_own_collectives_as_real_parts() -> None:
    """On a device other than the CPU (here ``meta``: shapes without values) every collective
    hands the backend a complex tensor of ``n`` elements as ``(n, 2)`` float32: its real and
    imaginary parts, whose sums and averages are the complex ones'."""
    backend = RealOnlyBackend()

    def c64(n: int) -> torch.Tensor:
        return torch.empty(n, dtype=torch.complex64, device="meta")

    pg: Any = backend
    all_gather(c64(6), c64(3), pg).wait()
    reduce_scatter(c64(3), c64(6), pg).wait()
    all_reduce(c64(5), pg).wait()
    broadcast(c64(4), pg, 0).wait()
    all_to_all([c64(2), c64(3)], [c64(2), c64(1)], pg).wait()
    want = [(6, 2), (3, 2), (3, 2), (6, 2), (5, 2), (4, 2), (0, 2), (3, 2), (0, 2), (1, 2)]
    assert backend.given == [(torch.float32, shape) for shape in want]
