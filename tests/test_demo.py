"""Process tier: the demo, ``examples/train_gpt.py``, end to end under ``torchrun``.

Proves that the example trains on a ``--data`` folder with two ranks and writes its run
folder: one metrics line per step, a summary and a PNG loss plot. A tiny configuration keeps
it to seconds; ``make demo`` is the real run. Run: ``pytest -m process tests/test_demo.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.test_torchrun import torchrun

STEPS = 6


@pytest.mark.process
def test_demo_writes_run_folder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (data / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" * 40)
    torchrun(
        "examples/train_gpt.py",
        *("--steps", str(STEPS), "--batch", "2", "--context", "16", "--width", "16"),
        *("--depth", "2", "--heads", "2", "--sample-bytes", "8", "--name", "smoke"),
        *("--data", str(data), "--out-dir", str(tmp_path)),
    )
    run = tmp_path / "smoke"
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, STEPS + 1))
    assert set(metrics[0]) == {"step", "loss", "lr", "tokens_per_s", "elapsed"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["config"]["steps"] == STEPS
    assert len(summary["per_rank_bytes"]) == 2
    assert summary["unsharded_bytes_computed"] == 16 * summary["parameters"]
    assert (run / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
