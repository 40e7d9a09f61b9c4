"""Process tier: ``benchmarks/compare.py`` runs end to end and writes a report that parses.

One method pair on a tiny configuration; timings are not checked (this machine is noisy),
only that every output file exists and holds what the report promises.
Run: ``pytest -m process tests/test_benchmarks.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = {"width": 32, "depth": 2, "heads": 2, "context": 16, "warmup": 1}


@pytest.mark.process
def test_compare_writes_markdown_json_and_png(tmp_path: Path) -> None:
    cmd = [
        sys.executable,
        "benchmarks/compare.py",
        "--methods",
        "shardwrap",
        "ddp",
        "--rounds",
        "1",
        "--steps",
        "2",
        "--config",
        json.dumps(TINY),
        "--theme",
        "smoke",
        "--out-dir",
        str(tmp_path),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (md,) = tmp_path.glob("smoke_*.md")
    (js,) = tmp_path.glob("smoke_*.json")
    (png,) = tmp_path.glob("smoke_*.png")
    rows = json.loads(js.read_text())["rows"]
    assert set(rows) == {"shardwrap", "ddp"}
    for row in rows.values():
        assert row["step_s"] > 0 and row["peak_mb_per_rank"] > 0 and row["comm_mb_per_step"] > 0
    assert rows["shardwrap"]["time_vs_ddp"] == pytest.approx(
        rows["shardwrap"]["step_s"] / rows["ddp"]["step_s"]
    )
    table = md.read_text()
    assert "| shardwrap |" in table and "| ddp |" in table and "time vs DDP" in table
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
