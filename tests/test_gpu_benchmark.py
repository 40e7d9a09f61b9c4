"""The logic of ``make gpu-check``'s benchmark, on the CPU (the driver's run without a GPU is
``tests/e2e/test_make_gpu_check.py``; the CUDA tier, ``tests/tiers/test_gpu*.py``):

- ``benchmarks/gpu_capacity.py``'s search, against trials faked by a linear model of host
  memory: it finds the edge (the largest depth that fits, one deeper failing), stops where the
  next trial would not end within its budget or a trial was cut off, and says when even the
  first trials failed; one real trial of the host tier's code trains on the CPU;
- ``benchmarks/gpu_step.py`` on the CPU with a small GPT: every method starts from the same
  weights (equal first losses in fp32) and one that cannot run here (FSDP2's offload needs an
  accelerator) is named with its error while the others go on;
- ``benchmarks/gpu_check.py``'s lines and report from made-up results: shardwrap's step judged
  against the goal, the largest depth with its trials.

Run: ``pytest tests/test_gpu_benchmark.py``
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest
import torch

from tests.support.benchmarks import load_benchmark

pytestmark = pytest.mark.stage3  # no stage of the tests' own is involved

GB = 10**9


@pytest.fixture(scope="module")
def capacity() -> ModuleType:
    return load_benchmark("gpu_capacity")


@pytest.fixture(scope="module")
def check() -> ModuleType:
    return load_benchmark("gpu_check")


class Fake:
    """Trials by a linear model: a process of 3 GB, 1 GB more, 3.7 GB a block; one that needs
    more than ``limit`` bytes fails. Each takes 5 s plus 1.5 s a block of a fake clock."""

    def __init__(self, limit: float) -> None:
        self.limit = limit
        self.now = 0.0
        self.depths: list[int] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, depth: int, left: float) -> dict[str, Any]:
        self.depths.append(depth)
        self.now += 5 + 1.5 * depth
        need = 4 * GB + 3.7 * GB * depth
        if need > self.limit:
            return {"ok": False, "error": "killed by SIGKILL"}
        per = {"build_s": 0.5 * depth, "first_step_s": 0.6 * depth, "step_s": 0.3 * depth}
        return {"ok": True, "rss_before": 3 * GB, "host_peak_bytes": need - 3 * GB, **per}


def test_the_search_finds_the_edge_of_host_memory(capacity: ModuleType) -> None:
    fake = Fake(limit=120 * GB)  # fits 31 blocks: 4 + 3.7 * 31 = 118.7
    found = capacity.search(fake, 400, 125 * GB, fake.clock)
    assert found["largest"] == 31 and found["stopped"] == "edge"
    assert fake.depths[:2] == [1, 3]  # the block's cost measured apart from the process's
    assert fake.depths[2] == int((0.92 * 125 - 3 - 1) / 3.7)  # then near the edge at once
    assert len(fake.depths) <= 6 and fake.now <= 400


def test_after_a_failure_the_search_halves_the_gap(capacity: ModuleType) -> None:
    fake = Fake(limit=70 * GB)  # fits 17 blocks, while the first guess is 30
    found = capacity.search(fake, 600, 125 * GB, fake.clock)
    assert found["largest"] == 17 and found["stopped"] == "edge"
    assert fake.depths[2:4] == [30, 16]  # 30 fails: halfway between 3 and 30


def test_the_search_starts_no_trial_that_would_outlast_its_budget(capacity: ModuleType) -> None:
    fake = Fake(limit=120 * GB)
    found = capacity.search(fake, 80, 125 * GB, fake.clock)
    assert found["stopped"] == "budget" and found["largest"] == 30
    assert fake.now <= 80


def test_a_trial_cut_off_ends_the_search(capacity: ModuleType) -> None:
    fake = Fake(limit=120 * GB)

    def cut_deep(depth: int, left: float) -> dict[str, Any]:
        result = fake(depth, left)
        return result if depth < 30 else {"ok": False, "cut": True, "error": "did not end"}

    found = capacity.search(cut_deep, 400, 125 * GB, fake.clock)
    assert found["largest"] == 3 and found["stopped"] == "budget"
    assert fake.depths == [1, 3, 30]


def test_a_search_whose_first_trials_fail_says_so(capacity: ModuleType) -> None:
    fake = Fake(limit=5 * GB)
    found = capacity.search(fake, 400, 125 * GB, fake.clock)
    assert found == {"trials": found["trials"], "largest": None, "stopped": "first trials failed"}


@pytest.mark.filterwarnings("ignore:Offload")  # the host tier's warning: a CPU device here
def test_a_trial_of_the_host_tier_trains_on_the_cpu(capacity: ModuleType) -> None:
    cfg = capacity.Config(width=64, heads=4, context=16, batch=2)
    result = capacity.trial("shardwrap-host", 2, cfg, torch.device("cpu"))
    assert result["ok"], result
    assert result["params"] > 2 * 12 * 64**2 and result["tokens_per_s"] > 0


@pytest.mark.filterwarnings("ignore:Offload")
def test_every_method_of_the_step_starts_from_the_same_weights() -> None:
    step = load_benchmark("gpu_step")
    cfg = step.Config(width=64, depth=2, heads=4, context=16, batch=2, warmup=1, steps=1, rounds=1)
    result = step.run(cfg, ["fp32"], list(step.METHODS), 60, torch.device("cpu"))
    by_method = result["results"]["fp32"]
    # named, the others went on: torch's CPU build finds no accelerator, a CUDA build no driver
    error = by_method["fsdp2-offload"]["error"]
    assert error.startswith("RuntimeError") and ("accelerator" in error or "NVIDIA" in error)
    ran = {m: e for m, e in by_method.items() if m != "fsdp2-offload"}
    first = {m: e["losses"][0] for m, e in ran.items()}
    assert max(first.values()) - min(first.values()) < 1e-5, first
    assert all(e["step_s"] > 0 and len(e["step_times"]) == 1 for e in ran.values())


def test_the_lines_judge_shardwrap_against_the_goal(check: ModuleType) -> None:
    entry = {"step_s": 0.102, "peak_bytes": 2**31}
    assert "1.020x plain (goal at most 1.03x: met)" in check.step_detail("shardwrap", entry, 0.1)
    slow = {"step_s": 0.104, "peak_bytes": 2**31}
    assert "(goal at most 1.03x: not met)" in check.step_detail("shardwrap", slow, 0.1)
    assert "goal" not in check.step_detail("fsdp2", slow, 0.1)


def _report(check: ModuleType) -> dict[str, Any]:
    trials = [
        {"depth": 1, "ok": True, "wall_s": 9.0},
        {"depth": 30, "ok": False, "error": "killed by SIGKILL", "wall_s": 60.0},
        {
            "depth": 16,
            "ok": True,
            "wall_s": 30.0,
            "params": 3.2e9,
            "tokens_per_s": 900.0,
            "host_peak_bytes": 60 * 2**30,
            "gpu_peak_bytes": 9 * 2**30,
        },
    ]
    found = {"trials": trials, "largest": 16, "stopped": "budget", "seconds": 99.0}
    entry = {"step_s": 0.1, "tokens_per_s": 81920.0, "peak_bytes": 2**31, "losses": [5.5, 5.4]}
    return {
        "command": "python gpu_check.py",
        "commit": "abc1234",
        "date": "2026-11-27T12:00:00+00:00",
        "host": "gpu-host",
        "environment": {
            "gpu": "NVIDIA H100 80GB HBM3",
            "torch": "2.11.0+cu130",
            "torch_admitted": ">=2.13,<2.14",
            "cuda": "13.0",
            "transformers": "5.17.0",
            "pytest": "8.4.0",
            "summary": "NVIDIA H100 80GB HBM3 (79.1 GiB), 16 cores",
        },
        "counts": {"passed": 3, "failed": 0, "skipped": 1},
        "seconds": 400.0,
        "parts": {"CUDA tier": 150.0},
        "checks": [
            {
                "name": "e2e/test_gpu_two_ranks.py::test_two_ranks_on_one_gpu[nccl-broadcast]",
                "outcome": "skipped",
                "detail": "nccl refuses broadcast with two ranks on one GPU: Duplicate GPU",
                "seconds": 0.0,
            },
            {
                "name": "bench capacity: shardwrap-host",
                "outcome": "passed",
                "detail": "",
                "seconds": 99.0,
            },
        ],
        "step": {
            "params": 101e6,
            "config": {
                "width": 1024,
                "depth": 8,
                "batch": 8,
                "context": 1024,
                "warmup": 3,
                "steps": 8,
            },
            "rounds": 2,
            "results": {"fp32": {"plain": entry, "fsdp2-offload": {"error": "OOM"}}},
        },
        "capacity": {"shardwrap-host": found},
        "found": found,
    }


def test_the_report_renders_from_its_record(check: ModuleType) -> None:
    report = _report(check)
    text = load_benchmark("_gpu_report").render(report)
    assert "# make gpu-check: NVIDIA H100 80GB HBM3, 2026-11-27" in text
    assert "| plain | 100.0 | 81920 | 2.00 | 1.000 | 5.50000 |" in text
    assert "| fsdp2-offload | error: OOM |" in text
    assert "| shardwrap-host | 16 | 3.20B | 900 | 60.0 | 9.0 | budget |" in text
    assert "30: killed by SIGKILL (60 s)" in text
    assert "## Refused with two ranks on one GPU" in text and "Duplicate GPU" in text
    line = check.capacity_check("shardwrap-host", report["found"]).line()
    assert line.startswith("PASSED   bench capacity: shardwrap-host: depth 16 trains (3.20B")
    assert "trials: 1 ok, 30 failed, 16 ok" in line
