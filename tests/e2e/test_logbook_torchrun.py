"""Process tier: a run with corrupted batches recovers by itself under torchrun.

Two ranks train the same small GPT twice with a Logbook (``tests/e2e/scripts/logbook_spikes.py``):
on clean data, and with uniform-noise batches at data positions 50 and 51. Proves that the
clean run never rolls back, that the other detects each bad batch, rolls back, skips it and
goes on without a person, its logbook showing every event, and that it ends within 3% of the
clean run's loss on the same held-out batches. Run:
``pytest -m process tests/e2e/test_logbook_torchrun.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardwrap.runs.runlog import read
from tests.support.launch import torchrun

STEPS, BAD = 280, (50, 51)


@pytest.mark.process
def test_a_run_with_bad_batches_recovers_by_itself(tmp_path: Path) -> None:
    torchrun("tests/e2e/scripts/logbook_spikes.py", str(tmp_path), str(STEPS), *map(str, BAD))
    clean, bad = read(tmp_path / "clean"), read(tmp_path / "bad")
    assert [e["event"] for e in clean.events if e["event"] != "checkpoint"] == ["started"]
    assert [s["step"] for s in clean.steps] == [s["step"] for s in bad.steps]

    kinds = [e["event"] for e in bad.events if e["event"] not in ("checkpoint", "started")]
    assert kinds == ["spike", "rollback", "skipped", "lr_scale"] * 2 + ["lr_scale"]  # recovered
    skipped = [range(*e["positions"]) for e in bad.events if e["event"] == "skipped"]
    assert all(any(p in r for r in skipped) for p in BAD)
    used = {s["position"] for s in bad.steps}
    assert used.isdisjoint(BAD) and used.isdisjoint(range(40, 52))  # skipped from step 40
    assert bad.count("checkpoint") >= STEPS // 40

    held_out = {
        name: json.loads((tmp_path / name / "eval.json").read_text())["loss"]
        for name in ("clean", "bad")
    }
    assert held_out["bad"] == pytest.approx(held_out["clean"], rel=0.03)
    for run in ("clean", "bad"):
        for png in ("loss.png", "system.png"):
            assert (tmp_path / run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
