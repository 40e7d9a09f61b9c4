"""Reductions add the ranks' pieces in rank order (``comm/collectives.py``: ``reduce_scatter``,
``reduce_scatter_many``).

Proves, at 2, 3 and 4 ranks, in float32 and bfloat16, that every rank's shard of a reduction is
``(piece of rank 0 + piece of rank 1 + ...) / N``, bit for bit, added in that order whichever
rank holds the shard: what a plain model's gradient accumulated over the ranks' slices in rank
order is, so that an optimizer amplifying the last bits (Muon's bfloat16 Newton-Schulz
iteration) steps a sharded model as it steps the plain one. The test's values are chosen so
that another order (each rank's own piece first, then the next ranks') gives other bits, and
it asserts that they do: it fails for a reduction that adds in any order but this one.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_reduction_order.py -q``
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from shardwrap.comm.collectives import reduce_scatter, reduce_scatter_many
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # collectives alone: no stage involved

N = 64  # elements per shard
DTYPES = [torch.float32, torch.bfloat16]


def _full(rank: int, world: int, dtype: torch.dtype) -> Tensor:
    """Rank ``rank``'s full buffer: values over eight orders of magnitude, so that the order of
    a sum decides its last bits."""
    g = torch.Generator().manual_seed(1000 * world + rank)
    scale = 10.0 ** torch.randint(-4, 5, (N * world,), generator=g)
    return (torch.randn(N * world, generator=g) * scale).to(dtype)


def _summed(terms: list[Tensor], world: int) -> Tensor:
    """``terms`` added in their order, then divided by ``world``, as the reduction does."""
    total = terms[0].clone()
    for term in terms[1:]:
        total.add_(term)
    return total.div_(world)


def _expected(world: int, dtype: torch.dtype, shard: int, first: int = 0) -> Tensor:
    """Shard ``shard`` of the reduction, adding the ranks' pieces from rank ``first`` on."""
    pieces = [_full(q, world, dtype)[shard * N : (shard + 1) * N] for q in range(world)]
    return _summed(pieces[first:] + pieces[:first], world)


def _reduced(rank: int, pg: ProcessGroup) -> tuple[list[Tensor], list[Tensor]]:
    """This rank's shard of each dtype's reduction: issued alone, and as one packed exchange."""
    world = pg.size()
    alone = []
    for dtype in DTYPES:
        out = torch.empty(N, dtype=dtype)
        reduce_scatter(out, _full(rank, world, dtype), pg).wait()
        alone.append(out)
    many = [torch.empty(N, dtype=dtype) for dtype in DTYPES]
    reduce_scatter_many(many, [_full(rank, world, dtype) for dtype in DTYPES], pg).wait()
    return alone, many


@pytest.mark.parametrize("world", [2, 3, 4])
def test_every_shard_adds_the_ranks_pieces_in_rank_order(world: int) -> None:
    results = run_ranks(world, _reduced)
    for rank, (alone, many) in enumerate(results):
        for dtype, a, m in zip(DTYPES, alone, many):
            expected = _expected(world, dtype, rank)
            assert torch.equal(a, expected), f"rank {rank}, {dtype}, alone"
            assert torch.equal(m, expected), f"rank {rank}, {dtype}, packed"
    if world > 2:  # two pieces add up the same either way; more do not, on these values
        for dtype in DTYPES:
            other = [
                not torch.equal(_expected(world, dtype, r, first=r), _expected(world, dtype, r))
                for r in range(1, world)
            ]
            assert all(other), f"{dtype}: from each rank's own piece on, the same bits"
