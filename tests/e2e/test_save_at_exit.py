"""A program that ends while a non-blocking save is being written, at 2 ranks under torchrun.

Each case (``tests/e2e/scripts/save_at_exit.py``) starts a save of ``step-2`` with ``keep_last=1``
whose writers are slowed down, then ends: the main thread returns with no ``wait()``, every rank
raises inside a Logbook, or one rank runs out of memory while the other trains on. The exit must
complete the save on every rank and commit it once: ``latest`` names it, its metadata counts 2
ranks, it loads (its buffers included) and equals the state at the call, each rank's ``extra``
is its own, ``keep_last`` deleted the previous checkpoint only then, and rank 0 says on stderr
that the save was completed at exit. A save that fails at exit (a full disk on rank 1) is
abandoned: ``latest`` and the previous checkpoint stay, and every rank says so.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m faults tests/e2e/test_save_at_exit.py``
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from shardwrap import latest_checkpoint, load_checkpoint
from tests.e2e.scripts.save_at_exit import build
from tests.support.launch import launch

pytestmark = pytest.mark.faults

COMPLETED = re.compile(
    r"shardwrap \(rank (\d)\): the program ended while the checkpoint (\S+) was being "
    r"written; it was completed first, and 'latest' names (\S+)\."
)


def _launch(case: str, work: Path) -> str:
    proc = launch("tests/e2e/scripts/save_at_exit.py", case, str(work), timeout=180)
    return proc.stdout + proc.stderr


def _endings(output: str) -> dict[int, str]:
    return {int(r): how for r, how in re.findall(r"^ENDED (\d) (.*)$", output, re.MULTILINE)}


def _assert_loads(folder: Path, expected: Path, step: int) -> None:
    model = build()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    extra = load_checkpoint(folder, model, opt)
    assert extra.get("step", extra.get("logbook", {}).get("done")) == step
    torch.testing.assert_close(
        model.full_state_dict(), torch.load(expected, weights_only=True), atol=0, rtol=0
    )


def _extra_rank(folder: Path, rank: int) -> int:
    extra = torch.load(folder / f"extra-{rank:05d}.pt", weights_only=True)
    return extra["rank"] if "rank" in extra else extra["stateful"]["who"]["rank"]


@pytest.mark.parametrize("case", ["exit", "raise", "oom"])
def test_a_save_pending_at_exit_completes_on_every_rank_and_commits_once(
    case: str, tmp_path: Path
) -> None:
    output = _launch(case, tmp_path)
    ended = _endings(output)
    if case == "exit":
        assert ended == {0: "normally", 1: "normally"}, output[-3000:]
    elif case == "raise":
        assert all(how.startswith("RuntimeError: simulated") for how in ended.values()), output
    else:
        assert ended[1].startswith("OutOfMemoryError: simulated"), output[-3000:]
    ckpt = tmp_path / ("run/checkpoints" if case == "raise" else "ckpt")
    saved = ckpt / ("step-00000002" if case == "raise" else "step-2")
    assert latest_checkpoint(ckpt) == saved, output[-3000:]
    meta = json.loads((saved / "metadata.json").read_text())
    assert (meta["world_size"], meta["ranks"]) == (2, 2), output[-3000:]
    assert [_extra_rank(saved, r) for r in range(2)] == [0, 1]
    _assert_loads(ckpt, tmp_path / "expected-2.pt", 2)
    if case != "raise":  # keep_last=1 deleted step-1, once step-2 was complete
        assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-2"]
    # each rank that lived to say it (torchrun may stop a rank once the other has ended)
    said = COMPLETED.findall(output)
    assert said and all(s[1:] == (str(saved), str(saved)) for s in said), output[-3000:]
    if case != "oom":
        assert sorted(s[0] for s in said) == ["0", "1"], output[-3000:]


def test_a_save_failing_at_exit_is_abandoned_and_says_so(tmp_path: Path) -> None:
    output = _launch("full", tmp_path)
    ckpt = tmp_path / "ckpt"
    assert latest_checkpoint(ckpt) == ckpt / "step-1"
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "step-1"]
    _assert_loads(ckpt, tmp_path / "expected-1.pt", 1)
    said = re.findall(
        r"shardwrap \(rank (\d)\): the checkpoint save to (\S+) failed while the program "
        r"ended: OSError\(28, .*?It was abandoned on every rank: nothing of it was kept, and "
        r"'latest' names (\S+) ",
        output,
    )
    assert sorted(said) == [
        (str(r), str(ckpt / "step-2"), str(ckpt / "step-1")) for r in range(2)
    ], output[-3000:]
    assert not COMPLETED.search(output)
