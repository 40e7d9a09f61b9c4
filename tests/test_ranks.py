"""The thread-rank harness itself: real collectives, per-rank autograd, failure reports, timeouts.

Run: ``.venv/bin/pytest tests/test_ranks.py``
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed._functional_collectives as funcol
from torch.distributed import ProcessGroup, ReduceOp, ReduceScatterOptions

from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # the test runner itself: no stage involved


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_collectives_give_right_values(world_size: int) -> None:
    def fn(rank: int, pg: ProcessGroup) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        gathered = torch.empty(3 * world_size)
        pg._allgather_base(gathered, torch.full((3,), float(rank))).wait()
        scattered = torch.empty(2)
        opts = ReduceScatterOptions()
        opts.reduceOp = ReduceOp.SUM
        pg._reduce_scatter_base(scattered, torch.arange(2.0 * world_size) * (rank + 1), opts).wait()
        return pg.rank(), pg.size(), gathered, scattered

    results = run_ranks(world_size, fn)

    expected_gather = torch.arange(world_size).repeat_interleave(3).float()
    rank_sum = world_size * (world_size + 1) / 2
    for rank, (pg_rank, pg_size, gathered, scattered) in enumerate(results):
        assert (pg_rank, pg_size) == (rank, world_size)
        torch.testing.assert_close(gathered, expected_gather)
        torch.testing.assert_close(scattered, torch.arange(2.0 * rank, 2.0 * rank + 2) * rank_sum)


def test_ranks_backward_concurrently_with_collectives_in_hooks() -> None:
    """Each rank's backward runs on its own thread while hooks exchange gradients."""

    def fn(rank: int, pg: ProcessGroup) -> torch.Tensor:
        x = torch.full((3,), float(rank + 1), requires_grad=True)

        def sum_grad(param: torch.Tensor) -> None:
            pg.allreduce([param.grad]).wait()

        x.register_post_accumulate_grad_hook(sum_grad)
        (x * x).sum().backward()
        return x.grad

    for grad in run_ranks(2, fn):
        torch.testing.assert_close(grad, torch.full((3,), 2.0 * (1 + 2)))


def test_functional_collectives_resolve_the_group() -> None:
    def fn(rank: int, pg: ProcessGroup) -> torch.Tensor:
        x = torch.full((2,), float(rank), requires_grad=True)
        gathered = funcol.all_gather_single_autograd(x, 0, pg)
        (gathered * torch.arange(4.0)).sum().backward()
        return x.grad

    grads = run_ranks(2, fn)

    torch.testing.assert_close(grads[0], torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(grads[1], torch.tensor([4.0, 6.0]))


def _raise_from_helper(rank: int) -> None:
    raise ValueError(f"boom from rank {rank}")


def test_every_failing_rank_is_reported_with_its_traceback() -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        if rank in (1, 2):
            _raise_from_helper(rank)
        # The others block on the failed ranks and must fail fast, not at the timeout.
        pg._allgather_base(torch.empty(4), torch.ones(1)).wait()

    start = time.monotonic()
    with pytest.raises(AssertionError) as excinfo:
        run_ranks(4, fn, timeout=30.0)

    assert time.monotonic() - start < 10.0
    report = str(excinfo.value)
    assert "4 of 4 ranks failed" in report
    for rank in (1, 2):
        assert f"--- rank {rank} failed" in report
        assert f"ValueError: boom from rank {rank}" in report
    assert report.count("in _raise_from_helper") == 2
    for rank in (0, 3):
        assert f"--- rank {rank} failed ---" in report


def test_blocked_collective_fails_within_the_timeout() -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        if rank == 0:  # rank 1 never joins this all-gather
            pg._allgather_base(torch.empty(2), torch.ones(1)).wait()

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"(?s)--- rank 0 failed ---.*Timed out"):
        run_ranks(2, fn, timeout=3.0)

    assert time.monotonic() - start < 3.0


def test_hung_rank_is_reported_with_its_stack() -> None:
    release = threading.Event()

    def fn(rank: int, pg: ProcessGroup) -> None:
        if rank == 1:
            release.wait()

    start = time.monotonic()
    try:
        with pytest.raises(AssertionError) as excinfo:
            run_ranks(2, fn, timeout=1.0)
    finally:
        release.set()

    assert time.monotonic() - start < 2.0
    report = str(excinfo.value)
    assert "1 still running after 1 s" in report
    assert "--- rank 1 hung" in report
    assert "release.wait()" in report
    assert "rank 0" not in report
