"""FlatLayout arithmetic at world sizes 1..64, checked against a brute-force element assignment.

Proves that offsets, padding and shard ranges are consistent, that every rank's local pieces
put each element of each parameter in exactly one shard at the right place, and that
``owners`` names exactly the ranks holding part of a parameter. No tensors are sharded and
nothing is communicated.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_layout.py -q``
"""

from __future__ import annotations

import pytest
import torch

from shardwrap.engine.shards.layout import FlatLayout, LocalPiece

pytestmark = pytest.mark.stage3  # pure arithmetic: no stage involved

WORLD_SIZES = range(1, 65)

NUMELS: list[tuple[int, ...]] = [
    (),
    (0,),
    (0, 0, 0),
    (1,),
    (5,),
    (1, 1, 1),
    (2, 3),  # smaller than most world sizes: many ranks hold nothing
    (3, 0, 7, 0, 1),  # empty parameters between and after real ones
    (36, 108, 0, 1, 67 * 36, 13),  # odd sizes, as in a tiny transformer
    (7, 1_000_003, 0, 5),  # one huge parameter between small ones
]


def _reference(numels: tuple[int, ...], world_size: int) -> list[list[tuple[int, int, int]]]:
    """Brute force: element ``j`` of the flat buffer belongs to rank ``j // shard_size``.

    Returns, for every rank and parameter, ``(start, stop, shard_offset)`` of the elements that
    rank holds, or ``(0, 0, 0)`` where it holds none; asserts each such set is contiguous.
    """
    total = sum(numels)
    shard_size = (total + world_size - 1) // world_size
    pieces = [[(0, 0, 0)] * len(numels) for _ in range(world_size)]
    if total == 0:
        return pieces
    flat = torch.arange(total)
    param = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(numels))
    offsets = torch.tensor([0, *numels]).cumsum(0)[:-1]
    element = flat - offsets[param]  # index of each flat element within its parameter
    rank = flat // shard_size
    key = rank * len(numels) + param
    size = world_size * len(numels)
    count = torch.bincount(key, minlength=size)
    first = torch.full((size,), total).scatter_reduce(0, key, element, "amin")
    last = torch.full((size,), -1).scatter_reduce(0, key, element, "amax")
    for r in range(world_size):
        for i in range(len(numels)):
            k = r * len(numels) + i
            if count[k]:
                start, stop = int(first[k]), int(last[k]) + 1
                assert stop - start == count[k], f"rank {r} holds a non-contiguous part of {i}"
                pieces[r][i] = (start, stop, int(offsets[i]) + start - r * shard_size)
    return pieces


def _as_tuple(piece: LocalPiece) -> tuple[int, int, int]:
    return (0, 0, 0) if piece.numel == 0 else (piece.start, piece.stop, piece.shard_offset)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_sizes_offsets_and_padding(world_size: int) -> None:
    for numels in NUMELS:
        layout = FlatLayout(numels, world_size)
        assert layout.numel == sum(numels)
        assert layout.offsets == tuple(sum(numels[:i]) for i in range(len(numels)))
        if layout.numel == 0:  # one element of padding per rank: every shard has memory
            assert layout.padding == world_size
        else:
            assert 0 <= layout.padding < world_size
        assert layout.padded_numel == layout.numel + layout.padding
        assert layout.padded_numel % world_size == 0
        assert layout.shard_size * world_size == layout.padded_numel


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_shard_ranges_tile_the_padded_buffer(world_size: int) -> None:
    for numels in NUMELS:
        layout = FlatLayout(numels, world_size)
        expected_start = 0
        for rank in range(world_size):
            start, stop = layout.shard_range(rank)
            assert (start, stop) == (expected_start, expected_start + layout.shard_size)
            expected_start = stop
        assert expected_start == layout.padded_numel
        for rank in (-1, world_size):
            with pytest.raises(ValueError, match="outside world size"):
                layout.shard_range(rank)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_local_pieces_match_brute_force(world_size: int) -> None:
    for numels in NUMELS:
        layout = FlatLayout(numels, world_size)
        reference = _reference(numels, world_size)
        for rank in range(world_size):
            pieces = layout.local_pieces(rank)
            assert len(pieces) == len(numels)
            assert [_as_tuple(p) for p in pieces] == reference[rank], (numels, rank)
            for piece in pieces:
                assert piece.numel == piece.stop - piece.start >= 0
                if piece.numel == 0:
                    assert piece.start == piece.stop
                else:
                    assert 0 <= piece.shard_offset
                    assert piece.shard_offset + piece.numel <= layout.shard_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_pieces_in_rank_order_reassemble_every_parameter_once(world_size: int) -> None:
    for numels in NUMELS:
        layout = FlatLayout(numels, world_size)
        shard_data = torch.arange(layout.padded_numel).chunk(world_size)
        covered = [0] * len(numels)  # elements of each parameter reassembled so far
        for rank in range(world_size):
            lo, _ = layout.shard_range(rank)
            for i, piece in enumerate(layout.local_pieces(rank)):
                if piece.numel == 0:
                    continue
                assert piece.start == covered[i], f"gap or overlap in parameter {i} at rank {rank}"
                covered[i] = piece.stop
                # The piece sits in the shard exactly where its elements sit in the flat buffer.
                flat_start = layout.offsets[i] + piece.start
                assert lo + piece.shard_offset == flat_start
                data = shard_data[rank][piece.shard_offset : piece.shard_offset + piece.numel]
                assert torch.equal(data, torch.arange(flat_start, flat_start + piece.numel))
        assert covered == list(numels)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_owners_are_the_ranks_with_non_empty_pieces(world_size: int) -> None:
    for numels in NUMELS:
        layout = FlatLayout(numels, world_size)
        all_pieces = [layout.local_pieces(rank) for rank in range(world_size)]
        for i in range(len(numels)):
            expected = tuple(
                (rank, pieces[i]) for rank, pieces in enumerate(all_pieces) if pieces[i].numel
            )
            assert layout.owners(i) == expected, (numels, i)
            assert sum(piece.numel for _, piece in layout.owners(i)) == numels[i]


@pytest.mark.parametrize(
    ("numels", "world_size", "match"),
    [
        ((4,), 0, "world_size"),
        ((4,), -3, "world_size"),
        ((), 0, "world_size"),
        ((4, -1), 2, "non-negative"),
        ((-1,), 1, "non-negative"),
    ],
)
def test_invalid_arguments_raise(numels: tuple[int, ...], world_size: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        FlatLayout(numels, world_size)
