"""The benchmarks end to end, in the process tier; the test suite never needs DeepSpeed.

``benchmarks/compare.py`` runs the methods that need no DeepSpeed in fp32 and bf16 on a tiny
configuration; timings are not checked (this machine is noisy), only that every output file
exists and holds what the report promises, that every method trains like DDP (same per-step
losses), and that bf16 really ran in mixed precision (shardwrap and FSDP2 gather bf16 bytes;
every loss moves, slightly). ``benchmarks/scaling.py`` runs one tiny cell, measured within 10%
of its prediction. ``benchmarks/optimizers.py`` runs AdamW and Muon with shardwrap and DDP
on two ranks (Adafactor takes the same path; its parity: ``tests/engine``): each trains like DDP
with the same optimizer, and only the shape-aware one moves bytes in the owner exchange, timed
in its phases. ``benchmarks/compressed.py`` runs int8 stage 3 over a 10 Mbit/s link: a quarter
of the bytes, and steps held back by the link. ``benchmarks/t5_compare.py --only eval`` times
``Seq2SeqTrainer.evaluate()`` for DDP, shardwrap stage 3 and FSDP2 on a few rows: the same eval
loss and generated tokens as DDP's. ``benchmarks/crossings.py`` records one step of each library
and finds every kind of hook it names, each on the data's path through the library's files.
Their logic, in process: ``tests/test_benchmarks.py``.
Run: ``pytest -m process tests/e2e/test_benchmarks.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.stage3  # no stage of the tests' own is involved: once is enough

TINY = {"width": 32, "depth": 2, "heads": 2, "context": 16, "warmup": 1}
MODES = ("blocking", "non-blocking, first", "non-blocking")


def run_benchmark(
    script: str, *args: str, out_dir: Path, prefix: str = "smoke"
) -> tuple[str, dict[str, Any]]:
    """Run ``benchmarks/<script> *args`` writing its reports into ``out_dir``, one thread per
    process; fail on error. Returns its one Markdown report's text and its one JSON report
    (named ``<prefix>_*``)."""
    cmd = [sys.executable, f"benchmarks/{script}", *args, "--out-dir", str(out_dir)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (md,) = out_dir.glob(f"{prefix}_*.md")
    (js,) = out_dir.glob(f"{prefix}_*.json")
    return md.read_text(), json.loads(js.read_text())


@pytest.mark.process
def test_compare_runs_fp32_and_bf16_and_writes_markdown_json_and_png(tmp_path: Path) -> None:
    methods = ("shardwrap-s3", "fsdp2", "fsdp2-noreshard", "ddp")
    table, report = run_benchmark(
        "compare.py",
        *("--methods", "shardwrap", *methods[1:]),  # shardwrap: the alias of shardwrap-s3
        *("--precision", "fp32", "bf16", "--rounds", "1", "--steps", "2"),
        *("--config", json.dumps(TINY), "--theme", "smoke"),
        out_dir=tmp_path,
    )
    (png,) = tmp_path.glob("smoke_*.png")
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
    for precision in ("fp32", "bf16"):
        for method in methods:
            assert f"| {method} | {precision} |" in table
        assert f"\n- {precision}, shardwrap-s3 vs fsdp2: step time " in table
    assert "time vs FSDP2" in table and "memory vs FSDP2" in table
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.process
def test_scaling_runs_one_tiny_cell_and_writes_markdown_json_and_png(tmp_path: Path) -> None:
    table, report = run_benchmark(
        "scaling.py",
        *("--sizes", "32x2x2", "--world-sizes", "2", "--stages", "2"),
        *("--steps", "1", "--context", "16"),
        out_dir=tmp_path,
        prefix="scaling",
    )
    (png,) = tmp_path.glob("scaling_*.png")
    (row,) = report["rows"]
    assert (row["size"], row["stage"], row["world_size"]) == ("32x2x2", 2, 2)
    assert row["params"] == report["sizes"]["32x2x2"]["params"]
    assert 0 < row["build_resident_mb"] <= row["resident_mb"] and row["step_s"] > 0
    assert row["ratio"] == pytest.approx(1, abs=0.1) and row["within"]
    assert report["failed"] == []
    assert "| 32x2x2 | " in table
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


@pytest.mark.process
def test_optimizers_runs_shape_aware_optimizers_like_ddp_and_counts_the_owner_exchange(
    tmp_path: Path,
) -> None:
    table, report = run_benchmark(
        "optimizers.py",
        *("--nproc", "2", "--methods", "shardwrap", "ddp"),
        *("--optimizers", "adamw", "muon", "--steps", "1"),
        *("--config", json.dumps(TINY), "--theme", "smoke"),
        out_dir=tmp_path,
    )
    rows = {(r["method"], r["optimizer"]): r for r in report["rows"]}
    assert set(rows) == {(m, o) for m in ("shardwrap-s3", "ddp") for o in ("adamw", "muon")}
    params = rows["ddp", "adamw"]["params"]
    for (method, opt), row in rows.items():
        assert row["step_s"] > 0 and row["peak_mb_per_rank"] > 0, (method, opt)
        assert row["loss_diff_vs_ddp"] < (1e-4 if opt == "muon" else 1e-5), (method, opt)
        extra = row["exchange_mb_per_step_per_rank"] * 2**20
        if method == "ddp" or opt == "adamw":
            assert extra == 0, (method, opt)
        else:  # values and gradients in, values out: at most 3 fp32 copies of the model
            assert 0 < extra <= 3 * 4 * params, (method, opt)
    (run,) = [
        r
        for r in report["runs"]
        if r["method"] == "shardwrap-s3" and r["config"]["optimizer"] == "muon"
    ]
    for phases in run["phases_s_per_rank"]:
        assert phases["newton_schulz"] > 0 and phases["muon exchange in"] > 0
        assert phases["muon update"] >= phases["newton_schulz"]
    assert "| 2 | shardwrap-s3 | muon | " in table
    assert "- 2 ranks, shardwrap-s3: muon step time " in table and "(goal <= 1.15x: " in table
    assert "- 2 ranks, muon: shardwrap stage 3 vs DDP: step time " in table


@pytest.mark.process
def test_crossings_finds_each_hook_of_both_libraries_on_the_datas_path(tmp_path: Path) -> None:
    table, report = run_benchmark("crossings.py", "--theme", "smoke", out_dir=tmp_path)
    kinds = set(report["shardwrap"])
    assert len(kinds) == 6, kinds  # the engine's hooks, each still named as the script knows it
    assert set(report["fsdp2"]) == {k for k in kinds if "views done" not in k}
    gather = report["shardwrap"]["pre-forward (waits, views, prefetches the next)"]
    assert {"root", "schedule", "unit", "flat_group", "pool", "collectives"} <= set(gather["met"])
    assert gather["calls"] == 5 and 0 < gather["files"] <= gather["most_files"]
    fsdp2_backward = report["fsdp2"]["pre-backward (gathers, issues reductions)"]
    assert "_fsdp_collectives" in fsdp2_backward["met"]
    assert "| end of backward (every gradient lands in .grad) | shardwrap |" in table


@pytest.mark.process
def test_async_checkpoint_times_every_save_and_judges_the_goals(tmp_path: Path) -> None:
    table, report = run_benchmark(
        "async_checkpoint.py",
        *("--steps", "1", "--during", "1", "--config", json.dumps(TINY), "--theme", "smoke"),
        out_dir=tmp_path,
    )
    rows = report["results"]
    assert set(rows) == {f"{lib} {mode}" for lib in ("shardwrap", "fsdp2") for mode in MODES}
    for name, row in rows.items():
        assert 0 < row["hold_s"] <= row["complete_s"], name
        assert len(row["steps_during_s"]) == (0 if name.endswith(" blocking") else 1), name
    assert {"hold_ratio", "hold_met", "step_ratio", "step_met"} <= set(report["goals"])
    assert "FSDP2 + DCP `async_save`" in table
    assert not list(Path(tempfile.gettempdir()).glob("async_checkpoint_*"))  # cleaned up


@pytest.mark.process
def test_compressed_sends_int8_over_a_rate_limited_link(tmp_path: Path) -> None:
    """shardwrap stage 3 with int8 compression over a 10 Mbit/s link (as root; the open loopback
    otherwise) sends at most 0.3x the bytes of stage 3's fp32 gather and fp32 reduce-scatter per
    step (its units fit in one bucket, kept from forward for backward); on the limited link a
    step takes at least the time its bytes beyond the token bucket's 256 KB burst need at that
    rate, so the link was limited. One launch: the benchmark's logic is tested in process, in
    tests/test_benchmarks.py."""
    root = os.geteuid() == 0
    config = {**TINY, "width": 96, "heads": 2}
    table, report = run_benchmark(
        "compressed.py",
        *("--methods", "shardwrap-s3-int8", "--rounds", "1", "--steps", "1"),
        *("--links", "limited" if root else "open", "--rate", "10mbit"),
        *("--config", json.dumps(config), "--theme", "smoke"),
        out_dir=tmp_path,
    )
    ((link, rows),) = report["rows"].items()
    assert link == ("10mbit" if root else "open")
    (run,) = report["runs"][link]["shardwrap-s3-int8"]
    sent = run["comm_bytes_per_step"]
    assert 0.2 < sent / (2 * 4 * run["params"]) <= 0.3
    if root:  # both ranks' bytes share the loopback
        assert rows["shardwrap-s3-int8"]["step_s"] >= (sent - 256 * 1024) * 8 / 10e6 > 0.2
    assert "| shardwrap-s3-int8 |" in table


@pytest.mark.process
def test_t5_compare_times_trainer_evaluate_with_the_results_of_ddp(tmp_path: Path) -> None:
    """``evaluate()`` end to end, every method in its own launch: DDP's eval loss and tokens,
    stage 3 gathering each of its 7 units (6 blocks, the root) at most once per call over two
    batches per rank, with no all-reduce per decoded token, and FSDP2 really sharded (not the
    plain model the Trainer's own FSDP2 leaves on CPU)."""
    methods = ("ddp", "shardwrap-s3", "fsdp2")
    table, results = run_benchmark(
        "t5_compare.py",
        *("--only", "eval", "--no-generate", "--methods", *methods),
        *("--rows", "8", "--eval-batch", "2", "--beams", "2", "--tokens", "8", "--repeats", "1"),
        out_dir=tmp_path,
        prefix="t5_compare_eval",
    )
    assert list(results) == list(methods)
    ddp = results["ddp"]["evaluate"]
    for method in methods:
        ev = results[method]["evaluate"]
        assert "train" not in results[method] and "generate" not in results[method]
        assert "error" not in ev, (method, ev["error"])
        assert ev["seconds"] > 0 and ev["cpu_seconds"] > 0, method
        assert ev["eval_losses"][0] == pytest.approx(ddp["eval_losses"][0], abs=1e-5), method
        assert ev["predictions"] == ddp["predictions"] and len(ev["predictions"]) == 8, method
    stage3 = results["shardwrap-s3"]["evaluate"]["collectives"]  # per evaluate() call
    assert 0 < stage3["all_gather"] <= 7
    # one all-reduce deciding to keep the units gathered; none per token (ranks decode alone)
    assert stage3["all_reduce"] == 1
    assert results["fsdp2"]["evaluate"]["evaluated_as"].startswith("FSDP")
    assert "| shardwrap-s3 | not run | | | | | " in table
    assert "Stage 3's evaluate() against DDP's: " in table and "DIFFERS" not in table
