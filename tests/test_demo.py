"""Process tier: the demo, ``examples/train_gpt.py``, end to end under ``torchrun``.

Proves that the example trains on a ``--data`` folder with two ranks and that its Logbook
keeps the run folder: one logbook line per step with the samples each rank drew, the plots,
checkpoints, the exported model, a summary and a sample. Resuming it is proved by
``test_checkpoint.py``. A tiny configuration keeps it to seconds; ``make demo`` is the real
run. Run: ``pytest -m process tests/test_demo.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shardwrap._runlog import read
from tests.test_torchrun import launch

STEPS = 6


@pytest.mark.process
def test_demo_keeps_a_logbook(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (data / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" * 40)
    tiny = ("--batch", "2", "--context", "16", "--width", "16", "--depth", "2", "--heads", "2")
    common = (*tiny, "--sample-bytes", "8", "--name", "smoke", "--save-every", "3")
    common += ("--data", str(data), "--out-dir", str(tmp_path))
    proc = launch("examples/train_gpt.py", "--steps", str(STEPS), *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sample (temperature 0.8, top-20):" in proc.stdout
    assert "loss, mean of last 10" in proc.stdout

    run = tmp_path / "smoke"
    book = read(run)
    assert [s["step"] for s in book.steps] == list(range(1, STEPS + 1))
    assert all(len(s["samples"]) == 2 and len(s["samples"][0]) == 2 for s in book.steps)
    assert [e["event"] for e in book.events] == ["started"] + ["checkpoint"] * 3
    for png in ("loss.png", "system.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"
    assert (run / "model" / "model.safetensors").is_file()
