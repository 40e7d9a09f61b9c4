"""``make gpu-check`` on a machine without a GPU: its driver (``benchmarks/gpu_check.py``) names
every check it has, each test of the CUDA tier and each benchmark, reports every one SKIPPED
with its reason, writes its report under ``$OUT`` and exits 0. The GPU is hidden from it
(``CUDA_VISIBLE_DEVICES=""``), so this holds on any machine.

Run: ``.venv/bin/python -m pytest tests/e2e/test_make_gpu_check.py``
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import ROOT

pytestmark = pytest.mark.process

OUTCOMES = ("PASSED", "FAILED", "SKIPPED")


def _tests_of_the_tier() -> set[str]:
    """The test functions of the CUDA tier's files, read from the source."""
    names = set()
    for pattern in ("tests/tiers/test_gpu*.py", "tests/e2e/test_gpu*.py"):
        for path in ROOT.glob(pattern):
            tree = ast.parse(path.read_text())
            names |= {
                f"{path.name}::{node.name}"
                for node in tree.body
                if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")
            }
    return names


def test_without_a_gpu_every_check_is_skipped_by_name_and_the_run_passes(tmp_path: Path) -> None:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", OUT=str(tmp_path))
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.split(" ")[0] in OUTCOMES]
    assert lines and all(line.startswith("SKIPPED") for line in lines), proc.stdout
    assert all(re.search(r": \S", line) for line in lines), "a skip without its reason"
    named = {m.group(1) for line in lines if (m := re.search(r"/(test_\w+\.py::\w+)", line))}
    gpu_tests = {t for t in _tests_of_the_tier() if "on_cpu_tensors" not in t}
    assert gpu_tests <= named, f"not reported: {sorted(gpu_tests - named)}"
    benches = (
        "bench step fp32: shardwrap",
        "bench step bf16: fsdp2-offload",
        "bench capacity: shardwrap-host",
        "bench capacity: fsdp2-offload",
    )
    for bench in benches:
        assert any(f"SKIPPED  {bench}: needs a CUDA GPU" in line for line in lines), bench
    summary = re.search(r"gpu-check: 0 passed, 0 failed, (\d+) skipped", proc.stdout)
    assert summary and int(summary.group(1)) == len(lines), proc.stdout
    (report,) = tmp_path.glob("gpu_check_*.md")
    text = report.read_text()
    assert "Not run: needs a CUDA GPU" in text and f"{len(lines)} skipped" in text
    record = json.loads(report.with_suffix(".json").read_text())
    assert [c["outcome"] for c in record["checks"]] == ["skipped"] * len(lines)
