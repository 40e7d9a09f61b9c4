"""``benchmarks/compare.py``: its report says whether shardwrap meets its targets against FSDP2,
and (process tier) it runs every method end to end in fp32 and bf16 and writes a report that
parses.

The process test trains a tiny configuration; timings are not checked (this machine is noisy),
only that every output file exists and holds what the report promises, and that bf16 really ran
in mixed precision (shardwrap and FSDP2 gather bf16 bytes; every loss moves, slightly).
Run: ``pytest tests/test_benchmarks.py`` (``-m process`` for the end-to-end run only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
TINY = {"width": 32, "depth": 2, "heads": 2, "context": 16, "warmup": 1}


def load_compare() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compare", ROOT / "benchmarks" / "compare.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_target_lines_judge_each_precision_against_its_own_fsdp2() -> None:
    compare = load_compare()
    rows = {
        "fp32": {
            "shardwrap": {"time_vs_fsdp2": 0.48, "memory_vs_fsdp2": 0.87},
            "fsdp2": {"time_vs_fsdp2": 1.0, "memory_vs_fsdp2": 1.0},
        },
        "bf16": {
            "shardwrap": {"time_vs_fsdp2": 0.6, "memory_vs_fsdp2": 0.85},
            "fsdp2": {"time_vs_fsdp2": 1.0, "memory_vs_fsdp2": 1.0},
        },
        "fp64": {"shardwrap": {}},  # no FSDP2 row: no verdict
    }
    fp32, bf16 = compare.target_lines(rows)
    assert fp32.startswith("- fp32:") and fp32.endswith("Targets NOT all met.")
    assert "step time 0.48x FSDP2's (target <= 0.6x): met" in fp32
    assert "peak memory 0.87x FSDP2's (target <= 0.85x): NOT met" in fp32
    assert bf16.startswith("- bf16:") and bf16.endswith("Targets all met.")


@pytest.mark.process
def test_compare_runs_fp32_and_bf16_and_writes_markdown_json_and_png(tmp_path: Path) -> None:
    methods = ("shardwrap", "fsdp2", "ddp")
    cmd = [
        sys.executable,
        "benchmarks/compare.py",
        "--methods",
        *methods,
        "--precision",
        "fp32",
        "bf16",
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
    report = json.loads(js.read_text())
    rows = report["rows"]
    assert list(rows) == ["fp32", "bf16"]
    for precision, by_method in rows.items():
        assert list(by_method) == list(methods)
        for method, row in by_method.items():
            assert row["step_s"] > 0 and row["peak_mb_per_rank"] > 0
            assert row["comm_mb_per_step"] > 0
            assert row["time_vs_fsdp2"] == pytest.approx(
                row["step_s"] / by_method["fsdp2"]["step_s"]
            )
            (run,) = report["runs"][precision][method]
            assert run["config"]["precision"] == precision
    for method in methods:
        fp32, bf16 = rows["fp32"][method], rows["bf16"][method]
        assert 1e-7 < abs(fp32["final_loss"] - bf16["final_loss"]) < 1e-2, method
    # bf16 gathers and fp32 reductions: 2 + 2 + 4 bytes per parameter instead of 4 + 4 + 4.
    for method in ("shardwrap", "fsdp2"):
        ratio = rows["bf16"][method]["comm_mb_per_step"] / rows["fp32"][method]["comm_mb_per_step"]
        assert ratio < 0.8, (method, ratio)
    assert rows["bf16"]["ddp"]["comm_mb_per_step"] == rows["fp32"]["ddp"]["comm_mb_per_step"]
    table = md.read_text()
    for precision in ("fp32", "bf16"):
        for method in methods:
            assert f"| {method} | {precision} |" in table
        assert f"\n- {precision}: step time " in table
    assert "time vs FSDP2" in table and "memory vs FSDP2" in table
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
