"""Fault tier: a rank killed, stalled, out of step or skipping a batch under torchrun.

Also: ranks launched by torchrun that wrap a model with no process group all refuse to (each
would train its own copy), naming ``init_process_group``.

Each case (``tests/scripts/faults.py``) trains a small GPT two steps at 2 ranks with a 5 s
process-group timeout, saves a checkpoint, then injects its fault in step 3. Every case must
end within the timeout plus a margin (no hang), with the rank(s) that can still speak naming
what went wrong, and the checkpoint saved before the fault must load and equal what was saved
(nothing lost, also when the fault kills a re-save of the same path).

In process (ranks as threads): ``CollectiveFailed`` names the collective, this rank's step and
phase (its forward pass; forward, backward, or outside them with the last call every rank made;
or wrapping), the peer ranks that did not answer where that is known (the peers of an exchange
whose data never came, the other rank of two) and the group's timeout.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m faults tests/e2e/test_faults.py`` (the
torchrun cases), ``... -m "not faults" tests/e2e/test_faults.py`` (in process).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import (
    CollectiveFailed,
    Mesh,
    ShardedModule,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from shardwrap._collectives import all_gather, failed, reduce_scatter
from tests.support.launch import launch
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

TIMEOUT_S = 5
LIMIT_S = 60  # launch, two steps and a save, the timeout, torchrun tearing down: well under


def _launch(case: str, work: Path) -> tuple[int, float, str]:
    start = time.monotonic()
    proc = launch(
        "tests/scripts/faults.py", case, str(work), str(TIMEOUT_S), timeout=LIMIT_S + 60
    )
    return proc.returncode, time.monotonic() - start, proc.stdout + proc.stderr


def _endings(output: str) -> dict[int, str]:
    return {int(r): how for r, how in re.findall(r"^ENDED (\d) (.*)$", output, re.MULTILINE)}


def _assert_checkpoint_intact(work: Path) -> None:
    assert latest_checkpoint(work / "ckpt") == work / "ckpt" / "step-2"
    expected = torch.load(work / "expected.pt", weights_only=True)
    model = ShardedModule(GPT(), auto_wrap=Block)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    assert load_checkpoint(work / "ckpt", model, opt) == {"step": 2}
    torch.testing.assert_close(model.full_state_dict(), expected, atol=0, rtol=0)


@pytest.mark.faults
@pytest.mark.parametrize("case", ["kill-forward", "kill-backward", "kill-save"])
def test_a_killed_rank_ends_the_run_and_loses_nothing(case: str, tmp_path: Path) -> None:
    code, took, output = _launch(case, tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    ended = _endings(output)
    assert 1 not in ended  # killed: it said nothing
    if 0 in ended:  # unless torchrun stopped it first, the survivor names the failure
        assert ended[0].startswith("CollectiveFailed: shardwrap: the "), output[-3000:]
    _assert_checkpoint_intact(tmp_path)


@pytest.mark.faults
def test_a_stalled_rank_makes_the_other_raise_within_the_timeout(tmp_path: Path) -> None:
    code, took, output = _launch("stall", tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    ended = _endings(output)
    assert ended[0].startswith(
        "CollectiveFailed: shardwrap: the handshake did not complete on rank 0 (in forward pass "
        "3): rank 1 did not answer."
    ), ended[0]
    assert "the process group's timeout (0:00:05)" in ended[0]
    _assert_checkpoint_intact(tmp_path)


@pytest.mark.faults
def test_a_frozen_rank_makes_the_other_raise_naming_it_within_the_timeout(tmp_path: Path) -> None:
    """SIGSTOP in a backward, as a hung node: no thread of it answers, its sockets stay open."""
    code, took, output = _launch("freeze", tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    ended = _endings(output)
    assert re.match(
        r"CollectiveFailed: shardwrap: the (handshake|reduce-scatter|all-gather) did not "
        r"complete on rank 0 \(in the backward of forward pass 3\): rank 1 did not answer\.",
        ended[0],
    ), ended[0]
    assert "the process group's timeout (0:00:05)" in ended[0]
    _assert_checkpoint_intact(tmp_path)


@pytest.mark.faults
@pytest.mark.parametrize(
    ("case", "doing"),
    [
        ("desync-save", {0: r"forward pass 3, gathering", 1: r"forward pass 2, calling save"}),
        ("desync-clip", {0: r"forward pass 3, calling a gradient norm", 1: r"forward pass 4, "}),
        ("skip-batch", {0: r"forward pass 4, ", 1: r"forward pass 3, "}),
    ],
)
def test_ranks_out_of_step_all_raise_naming_what_each_did(
    case: str, doing: dict[int, str], tmp_path: Path
) -> None:
    code, took, output = _launch(case, tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    ended = _endings(output)
    assert sorted(ended) == [0, 1], output[-3000:]
    for how in ended.values():
        assert how.startswith("RuntimeError: shardwrap: ranks are at different steps or calls")
        for rank, pattern in doing.items():
            assert re.search(f"rank {rank}: {pattern}", how), how
    _assert_checkpoint_intact(tmp_path)


@pytest.mark.faults
def test_launched_ranks_without_a_process_group_all_refuse_to_wrap(tmp_path: Path) -> None:
    code, took, output = _launch("no-group", tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    ended = _endings(output)
    assert sorted(ended) == [0, 1], output[-3000:]
    for how in ended.values():
        assert how.startswith("RuntimeError: ShardedModule: WORLD_SIZE=2: this is one of 2"), how
        assert "dist.init_process_group(" in how


# in process: what CollectiveFailed says ------------------------------------------------


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
        "after forward pass 1, outside forward and backward; last call made by every rank: "
        "save_checkpoint"
    )
