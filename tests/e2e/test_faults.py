"""Fault tier: a rank killed, stalled, out of step or skipping a batch under torchrun.

Also: ranks launched by torchrun that wrap a model with no process group all refuse to (each
would train its own copy), naming ``init_process_group``.

Each case (``tests/e2e/scripts/faults.py``) trains a small GPT two steps at 2 ranks with a 5 s
process-group timeout, saves a checkpoint, then injects its fault in step 3. Every case must
end within the timeout plus a margin (no hang), with the rank(s) that can still speak naming
what went wrong, and the checkpoint saved before the fault must load and equal what was saved
(nothing lost, also when the fault kills a re-save of the same path). What ``CollectiveFailed``
says, in process: ``tests/comm/test_faults.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m faults tests/e2e/test_faults.py``
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
import torch

from shardwrap import ShardedModule, latest_checkpoint, load_checkpoint
from tests.support.launch import launch
from tests.support.models import GPT, Block

TIMEOUT_S = 5
LIMIT_S = 60  # launch, two steps and a save, the timeout, torchrun tearing down: well under


def _launch(case: str, work: Path) -> tuple[int, float, str]:
    start = time.monotonic()
    proc = launch(
        "tests/e2e/scripts/faults.py", case, str(work), str(TIMEOUT_S), timeout=LIMIT_S + 60
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
@pytest.mark.parametrize(
    ("case", "killed"), [("kill-background-write", 1), ("kill-background-commit", 0)]
)
def test_a_rank_killed_during_a_background_save_loses_nothing(
    case: str, killed: int, tmp_path: Path
) -> None:
    """Killed in its writer thread while training goes on, mid-file or just before the commit:
    no half-written checkpoint is left complete, ``latest`` and the one before stay."""
    code, took, output = _launch(case, tmp_path)
    assert code != 0 and took < LIMIT_S, output[-3000:]
    assert killed not in _endings(output)  # killed: it said nothing
    assert not (tmp_path / "ckpt" / "step-3").exists()
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
