"""``benchmarks/compare.py``: its report says whether shardwrap meets its targets against each
reference, it skips DeepSpeed only where nobody asked for it, and (process tier) it runs the
methods that need no DeepSpeed end to end in fp32 and bf16 and writes a report that parses.

The process test trains a tiny configuration; timings are not checked (this machine is noisy),
only that every output file exists and holds what the report promises, that every method trains
like DDP (same per-step losses), and that bf16 really ran in mixed precision (shardwrap and FSDP2
gather bf16 bytes; every loss moves, slightly). The test suite never needs DeepSpeed.
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


def test_target_lines_judge_each_precision_against_its_own_references() -> None:
    compare = load_compare()

    def row(step_s: float, peak: float) -> dict[str, float]:
        return {"step_s": step_s, "peak_mb_per_rank": peak}

    rows = {
        "fp32": {
            "shardwrap-s2": row(0.9, 500),
            "shardwrap-s3": row(0.48, 870),
            "fsdp2": row(1.0, 1000),
            "ddp": row(1.0, 2000),
            "deepspeed-s2": row(1.5, 1000),
        },
        "bf16": {"shardwrap-s3": row(0.6, 850), "fsdp2": row(1.0, 1000)},
        "fp64": {"shardwrap-s3": row(1.0, 1000)},  # no reference ran: no verdict
    }
    lines = compare.target_lines(rows)
    assert lines == [
        "- fp32, shardwrap-s2 vs deepspeed-s2: step time 0.60x deepspeed-s2's (target <= 0.75x): "
        "met; peak memory 0.50x deepspeed-s2's (target <= 0.6x): met.",
        "- fp32, shardwrap-s2 vs ddp: step time 0.90x ddp's (target <= 1.0x): met.",
        "- fp32, shardwrap-s3 vs fsdp2: step time 0.48x fsdp2's (target <= 0.6x): met; "
        "peak memory 0.87x fsdp2's (target <= 0.85x): NOT met.",
        "- fp32: 4 of 5 targets met.",
        "- bf16, shardwrap-s3 vs fsdp2: step time 0.60x fsdp2's (target <= 0.6x): met; "
        "peak memory 0.85x fsdp2's (target <= 0.85x): met.",
        "- bf16: 2 of 2 targets met.",
    ]


def test_methods_resolve_aliases_and_skip_deepspeed_only_when_not_asked_for() -> None:
    compare = load_compare()
    everything = compare.METHODS
    methods, skipped = compare.select_methods(None, everything, have_deepspeed=False)
    assert skipped == list(compare.DEEPSPEED)
    assert methods == [m for m in everything if not m.startswith("deepspeed")]
    assert compare.select_methods(None, everything, have_deepspeed=True) == (list(everything), [])
    assert compare.select_methods(["shardwrap", "shardwrap-s3", "ddp"], everything, False) == (
        ["shardwrap-s3", "ddp"],
        [],
    )
    with pytest.raises(SystemExit, match=r"deepspeed-s2.*pip install -e '\.\[bench\]'.*make bench"):
        compare.select_methods(["ddp", "deepspeed-s2"], everything, have_deepspeed=False)


@pytest.mark.process
def test_compare_runs_fp32_and_bf16_and_writes_markdown_json_and_png(tmp_path: Path) -> None:
    methods = ("shardwrap-s3", "fsdp2", "fsdp2-noreshard", "ddp")
    cmd = [
        sys.executable,
        "benchmarks/compare.py",
        "--methods",
        "shardwrap",  # the alias of shardwrap-s3
        *methods[1:],
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
            assert row["loss_diff_vs_ddp"] < (1e-5 if precision == "fp32" else 1e-3), method
    for method in methods:
        fp32, bf16 = rows["fp32"][method], rows["bf16"][method]
        assert 1e-7 < abs(fp32["final_loss"] - bf16["final_loss"]) < 1e-2, method
    # bf16 gathers and fp32 reductions: 2 + 2 + 4 bytes per parameter instead of 4 + 4 + 4.
    for method in ("shardwrap-s3", "fsdp2", "fsdp2-noreshard"):
        ratio = rows["bf16"][method]["comm_mb_per_step"] / rows["fp32"][method]["comm_mb_per_step"]
        assert ratio < 0.8, (method, ratio)
    assert rows["bf16"]["ddp"]["comm_mb_per_step"] == rows["fp32"]["ddp"]["comm_mb_per_step"]
    # Kept from forward to backward, parameters are gathered once per step instead of twice.
    fp32 = rows["fp32"]
    assert fp32["fsdp2-noreshard"]["comm_mb_per_step"] < fp32["fsdp2"]["comm_mb_per_step"]
    table = md.read_text()
    for precision in ("fp32", "bf16"):
        for method in methods:
            assert f"| {method} | {precision} |" in table
        assert f"\n- {precision}, shardwrap-s3 vs fsdp2: step time " in table
    assert "time vs FSDP2" in table and "memory vs FSDP2" in table
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
