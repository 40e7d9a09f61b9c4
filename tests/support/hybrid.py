"""A 2-D mesh of thread ranks for hybrid sharding tests: shard groups of consecutive ranks."""

from __future__ import annotations

from torch.distributed import ProcessGroup

from shardwrap import Mesh
from tests.support.ranks import subgroup

__all__ = ["SHARD", "hybrid_mesh"]

SHARD = 2  # ranks per shard group; world size 4 makes two replicas


def hybrid_mesh(pg: ProcessGroup, shard: int = SHARD) -> Mesh:
    """Shard groups of consecutive ranks, replicate groups across them."""
    world, rank = pg.size(), pg.rank()
    first = rank - rank % shard
    shard_ranks = list(range(first, first + shard))
    replicate_ranks = list(range(rank % shard, world, shard))
    return Mesh(
        shard=subgroup(pg, shard_ranks, "shard"),
        replicate=subgroup(pg, replicate_ranks, "replicate"),
        control=pg,
    )
