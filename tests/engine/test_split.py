"""A parameter split in blocks (``engine/shards/split.py``): pure arithmetic, checked against
the elements themselves.

Every shape, split dimension and number of parts below is laid out as an index tensor (element
``i`` of the whole holds ``i``); the stacked order must be its blocks' elements block after
block, :meth:`Split.runs` must name exactly the whole's elements of any stacked range, and
:func:`overlaps` must copy exactly the elements one split's range holds of another's.

Run: ``.venv/bin/python -m pytest tests/engine/test_split.py -q``
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardwrap.engine.shards.split import Split, overlaps

SPLITS = [
    Split((12,)),
    Split((12,), 0, 4),
    Split((6, 4), 0, 2),
    Split((6, 4), 1, 2),
    Split((6, 4), 1, 4),
    Split((2, 6, 4), 1, 3),
    Split((2, 6, 4), 2, 2),
    Split((1, 8), 1, 2),  # split off dim 0, yet its stacked order is the whole's
]


def _whole(split: Split) -> torch.Tensor:
    return torch.arange(split.numel).view(split.shape)


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_stacked_order_is_the_blocks_one_after_the_other(split: Split) -> None:
    whole = _whole(split)
    blocks = [split.block(whole, t).reshape(-1) for t in range(split.parts)]
    stacked = split.stacked(whole)
    assert torch.equal(stacked, torch.cat(blocks))
    assert torch.equal(split.unstacked(stacked), whole)
    assert split.identity == torch.equal(stacked, whole.reshape(-1))


@pytest.mark.parametrize("split", SPLITS, ids=str)
def test_runs_name_the_whole_elements_of_any_stacked_range(split: Split) -> None:
    stacked = split.stacked(_whole(split))
    for start, stop in itertools.combinations(range(split.numel + 1), 2):
        runs = split.runs(start, stop)
        got = torch.cat([torch.arange(a, b) for a, b, _ in runs])
        assert torch.equal(got, stacked[start:stop])
        assert [v for _, _, v in runs][0] == start


@pytest.mark.parametrize(("mine", "theirs"), list(itertools.product(SPLITS[2:5], SPLITS[2:5])))
def test_overlaps_copy_exactly_the_elements_held(mine: Split, theirs: Split) -> None:
    ours, held = mine.stacked(_whole(mine)), theirs.stacked(_whole(theirs))
    cuts = [*range(0, mine.numel, 5), mine.numel]
    for (lo, hi), (start, stop) in itertools.product(
        itertools.pairwise(cuts), itertools.pairwise([*range(0, theirs.numel, 7), theirs.numel])
    ):
        out = torch.full((hi - lo,), -1)
        for at, to, n in overlaps(mine, lo, hi, theirs, start, stop):
            out[to : to + n] = held[start:stop][at : at + n]
        wanted = ours[lo:hi]
        present = torch.isin(wanted, held[start:stop])
        assert torch.equal(out[present], wanted[present])
        assert (out[~present] == -1).all()
