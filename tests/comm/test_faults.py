"""What ``CollectiveFailed`` says, in process (ranks as threads).

It names the collective, this rank's step and phase (its forward pass; forward, backward, or
outside them with the last call every rank made; or wrapping), the peer ranks that did not
answer where that is known (the peers of an exchange whose data never came, the other rank of
two) and the group's timeout; a rank's own allocation failing inside a collective is named as
that rank's, not a peer's. Ranks killed, stalled or out of step under torchrun:
``tests/e2e/test_faults.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_faults.py -q``
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import CollectiveFailed, Mesh, ShardedModule, save_checkpoint
from shardwrap.comm.collectives import (
    Pending,
    all_gather,
    failed,
    reduce_scatter,
)
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def test_the_message_names_the_collective_the_phase_the_silent_peer_and_the_timeout() -> None:
    backend = RuntimeError("Timed out waiting 3000ms for recv operation\nand more")

    def fn(rank: int, pg: ProcessGroup) -> CollectiveFailed:
        mesh = Mesh(shard=pg)  # a model being wrapped on this group
        error = failed("handshake", backend, pg)
        del mesh
        return error

    for rank, error in enumerate(run_ranks(2, fn, timeout=6.0)):
        assert str(error).startswith(
            f"shardwrap: the handshake did not complete on rank {rank} (wrapping the model "
            f"(ShardedModule)): rank {1 - rank} did not answer. A rank stopped, stalled past the "
            "process group's timeout (0:00:03), or is at another call;"
        )
        assert str(error).endswith("The backend said: Timed out waiting 3000ms for recv operation")
        assert (error.collective, error.rank, error.silent) == ("handshake", rank, [1 - rank])


def test_an_all_reduce_among_three_does_not_guess_who_did_not_answer() -> None:
    def fn(rank: int, pg: ProcessGroup) -> str:
        return str(failed("all-reduce", RuntimeError(""), pg))

    for rank, message in enumerate(run_ranks(3, fn, timeout=6.0)):
        assert (
            f"on rank {rank} (in no sharded model: none uses this group): which rank did not "
            "answer is unknown (the backend does not say)." in message
        )
        assert message.endswith("The backend said: RuntimeError")


@pytest.mark.stage3  # a timeout, whatever the stage
@pytest.mark.parametrize("exchange", [all_gather, reduce_scatter], ids=["gather", "reduce"])
def test_an_exchange_names_the_one_peer_of_three_that_sent_nothing(exchange: Callable) -> None:
    """Rank 2 never joins: ranks 0 and 1 each name it, and not each other."""
    done = threading.Barrier(3)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[int] | None, str]:
        try:
            if rank == 2:
                return None, ""
            with pytest.raises(CollectiveFailed) as raised:
                if exchange is all_gather:
                    all_gather(torch.zeros(12), torch.full((4,), float(rank)), pg).wait()
                else:
                    reduce_scatter(torch.zeros(4), torch.ones(12), pg).wait()
            return raised.value.silent, str(raised.value)
        finally:
            done.wait(10)  # rank 2 keeps its group open until the others have given up

    results = run_ranks(3, fn, timeout=6.0)
    what = "all-gather" if exchange is all_gather else "reduce-scatter"
    for rank, (silent, message) in enumerate(results[:2]):
        assert silent == [2], message
        assert message.startswith(f"shardwrap: the {what} did not complete on rank {rank} (")
        assert "): rank 2 did not answer." in message


def test_a_model_reports_its_forward_pass_and_phase(tmp_path: Path) -> None:
    model = ShardedModule(GPT(), auto_wrap=Block)
    root = model._shardwrap_root
    seen: dict[str, str] = {}

    def in_forward(m: torch.nn.Module, a: object) -> None:
        seen["forward"] = root.whereabouts()

    def in_backward(m: torch.nn.Module, a: object, out: torch.Tensor) -> None:
        out.register_hook(lambda g: seen.update(backward=root.whereabouts()))

    model.blocks[0].register_forward_pre_hook(in_forward)
    model.blocks[0].register_forward_hook(in_backward)
    assert root.whereabouts() == "before the first forward pass"
    idx, targets = make_batch(0, 2)
    model(idx, targets).backward()
    assert seen == {"forward": "in forward pass 1", "backward": "in the backward of forward pass 1"}
    assert root.whereabouts() == "after forward pass 1, outside forward and backward"
    save_checkpoint(tmp_path / "ckpt", model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert root.whereabouts() == (
        "after forward pass 1, outside forward and backward; last call begun here of those "
        "every rank makes together: save_checkpoint"
    )


def test_a_ranks_own_out_of_memory_in_a_gather_names_that_rank_not_a_peer() -> None:
    """Rank 1's allocation fails inside a gather (torch's CPU allocator raises a RuntimeError):
    it raises a ``torch.OutOfMemoryError`` saying so, not that rank 0 did not answer."""
    refused = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
        "memory: you tried to allocate 4294967296 bytes. Error code 12 (Cannot allocate memory)"
    )

    def allocate() -> None:
        raise refused

    def fn(rank: int, pg: ProcessGroup) -> str:
        mesh = Mesh(shard=pg)  # a model being wrapped on this group
        if rank == 1:
            with pytest.raises(torch.OutOfMemoryError) as info:
                Pending(None, allocate, "all-gather", pg).wait()
            assert type(info.value).__name__ == "OutOfMemoryInCollective"
            return str(info.value)
        del mesh
        return ""

    message = run_ranks(2, fn, timeout=6.0)[1]
    assert message.startswith(
        "shardwrap: rank 1 ran out of memory in the all-gather (wrapping the model "
        "(ShardedModule)): its own allocation failed there, no peer did"
    ), message
    assert "rank 0 did not answer" not in message and "can't allocate memory" in message
