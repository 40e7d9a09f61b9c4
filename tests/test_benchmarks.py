"""``benchmarks/compare.py``: its report says whether shardwrap meets its targets against each
reference, and it skips DeepSpeed only where nobody asked for it.

``benchmarks/scaling.py``: its parameter count is the example GPT's, its model states are the
stage formulas of docs/stages-and-tiers.md, its prediction is the planner's, and its report from
a made-up result set judges every cell's allocated peak against it.

``benchmarks/max_batch.py``: against launches faked by a linear memory model, its search finds
the exact edge of the budget (or none, or its limit), and ``--time-steps`` times the largest
batch in one more launch whose step time is the one the report uses.

``benchmarks/step_overhead.py``: its fit recovers the cost of a unit per step from made-up runs.

``benchmarks/optimizers.py``: it runs DeepSpeed only with the optimizers it has (its own Muon,
AdamW), and its report judges shardwrap's Muon against AdamW by the goal and sets every method
against DDP and DeepSpeed per optimizer.

``benchmarks/compressed.py``: against faked launches, it alternates methods and links, launches
a method that failed only once and names its error, judges each goal on its own link and
estimates the bytes each rank sends; its report can be written again from its JSON.

``benchmarks/t5_compare.py``: its report sets every method's ``evaluate()`` time against DDP's,
judges stage 3's by the goal, and names a method whose eval loss or generated tokens differ from
DDP's.

``compare.py``, ``scaling.py``, ``optimizers.py``, ``compressed.py`` and ``t5_compare.py`` end to
end, in the process tier: ``tests/e2e/test_benchmarks.py``.
Run: ``pytest tests/test_benchmarks.py``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.benchmarks import load_benchmark

pytestmark = pytest.mark.stage3  # no stage of the tests' own is involved: once is enough


def load_compare() -> ModuleType:
    return load_benchmark("compare")


@pytest.fixture
def scaling() -> ModuleType:
    return load_benchmark("scaling")


@pytest.fixture
def max_batch() -> ModuleType:
    return load_benchmark("max_batch")


def fake_launches(
    module: ModuleType, monkeypatch: pytest.MonkeyPatch, mb_per_sample: float
) -> list[dict]:
    """Replace ``run_once`` by a model: 100 MB plus ``mb_per_sample`` per sample, one second per
    step in a search trial, two in any other launch; returns the configs launched."""
    launched: list[dict] = []

    def run_once(method: str, config: dict, nproc: int, timeout: float) -> dict:
        launched.append(config)
        return {
            "peak_mb_per_rank": 100 + mb_per_sample * config["batch"],
            "step_s": 1.0 if config["steps"] == 2 else 2.0,
        }

    monkeypatch.setattr(module, "run_once", run_once)
    return launched


@pytest.mark.parametrize(
    ("budget", "limit", "edge"),
    [
        (345.0, 256, 24),
        (350.0, 256, 25),
        (265.0, 256, 16),  # the line's guess is the batch that fitted last
        (105.0, 256, 0),
        (100000.0, 40, 40),
        (130.0, 256, 3),
    ],
)
def test_max_batch_search_finds_the_edge_of_the_budget(
    max_batch: ModuleType, monkeypatch: pytest.MonkeyPatch, budget: float, limit: int, edge: int
) -> None:
    launched = fake_launches(max_batch, monkeypatch, mb_per_sample=10.0)
    trials = max_batch.search("ddp", {}, budget, 2, limit)
    fitting = [t["batch"] for t in trials if t["fits"]]
    assert max(fitting, default=0) == edge
    assert all(t["batch"] > edge for t in trials if not t["fits"])
    # Near the edge the search steps by a quarter, never doubling past it.
    assert max(t["batch"] for t in trials) <= max(16, edge) * 5 // 4 + 1
    assert len(trials) == len(launched) <= 12


def test_max_batch_times_the_largest_batch_in_one_more_launch(
    max_batch: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    launched = fake_launches(max_batch, monkeypatch, mb_per_sample=10.0)
    argv = ["max_batch.py", "--methods", "ddp", "--budget-mb", "345", "--samples", "96"]
    argv += ["--time-steps", "3", "--out-dir", str(tmp_path), "--name", "t"]
    monkeypatch.setattr(sys, "argv", argv)
    max_batch.main()
    assert launched[-1] == {"batch": 24, "warmup": 1, "steps": 3}
    (report,) = tmp_path.glob("t_*.md")
    text = report.read_text()
    # 96 samples at batch 24 on 2 ranks: 2 steps of the timing launch's 2 s.
    assert "| ddp | 24 | 340 | 2.00 | 768.0 | 4 s (2 steps) | 1.00 |" in text
    assert "median of 3 steps of one more launch" in text


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


def test_optimizers_runs_deepspeed_only_with_adamw_and_its_own_muon() -> None:
    optimizers = load_benchmark("optimizers")
    todo = optimizers.cells([2], ["shardwrap-s3", "deepspeed-s1"], ["adamw", "muon", "adafactor"])
    assert todo == [
        (2, "shardwrap-s3", "adamw"),
        (2, "shardwrap-s3", "muon"),
        (2, "shardwrap-s3", "adafactor"),
        (2, "deepspeed-s1", "adamw"),
        (2, "deepspeed-s1", "muon"),
    ]


def test_optimizers_ratios_judge_shardwraps_muon_by_its_goal_per_world_size() -> None:
    optimizers = load_benchmark("optimizers")

    def row(step_s: float, peak: float, comm: float = 0.0, extra: float = 0.0) -> dict:
        return {
            "step_s": step_s,
            "peak_mb_per_rank": peak,
            "comm_mb_per_step": comm,
            "exchange_mb_per_step_per_rank": extra,
        }

    rows = {
        2: {
            ("shardwrap-s3", "adamw"): row(2.0, 1000, 1000),
            ("shardwrap-s3", "muon"): row(2.2, 800, 1000, 300),
            ("ddp", "adamw"): row(2.0, 2000, 400),
            ("ddp", "muon"): row(4.0, 1600, 400),
            ("deepspeed-s2", "muon"): row(5.5, 2000, 400),
        },
        4: {("shardwrap-s3", "adamw"): row(3.0, 600), ("shardwrap-s3", "muon"): row(3.6, 500)},
    }
    assert optimizers.ratio_lines(rows) == [
        "- 2 ranks, shardwrap-s3: muon step time 1.10x adamw's (goal <= 1.15x: met).",
        "- 2 ranks, ddp: muon step time 2.00x adamw's.",
        "- 2 ranks, adamw: shardwrap stage 3 vs DDP: step time 1.00x, peak memory 0.50x.",
        "- 2 ranks, muon: shardwrap stage 3 vs DDP: step time 0.55x, peak memory 0.50x.",
        "- 2 ranks, muon: shardwrap stage 3 vs deepspeed-s2: step time 0.40x, peak memory 0.40x.",
        "- 2 ranks, muon: the owner exchange sends 300.0 MB per step and rank, 0.60x the "
        "500.0 MB a rank sends in the step's gathers and reductions (1/2 of their 1000.0 MB "
        "of buffers).",
        "- 4 ranks, shardwrap-s3: muon step time 1.20x adamw's (goal <= 1.15x: NOT met).",
    ]


def test_scaling_counts_the_example_gpts_parameters_and_its_sizes_land_near_their_names(
    scaling: ModuleType,
) -> None:
    from examples.train_gpt import GPT

    size = scaling.size_arg("48x3x4")
    model = GPT(width=48, depth=3, heads=4, context=16)
    assert scaling.gpt_params(size, 16) == sum(p.numel() for p in model.parameters())
    for name, target in (("25m", 25e6), ("100m", 100e6), ("400m", 400e6)):
        assert abs(scaling.gpt_params(scaling.size_arg(name), 64) / target - 1) < 0.05, name
    for bad in ("1b", "48x3", "48x3x5"):
        with pytest.raises(argparse.ArgumentTypeError):
            scaling.size_arg(bad)


def test_scaling_states_the_readmes_fp32_adamw_model_states_per_stage(scaling: ModuleType) -> None:
    psi = 1000
    assert [scaling.formula(s) for s in (1, 2, 3)] == ["8Ψ + 12Ψ/N", "4Ψ + 12Ψ/N", "16Ψ/N"]
    assert [scaling.states_bytes(s, psi, 1) for s in (1, 2, 3)] == [20_000, 16_000, 16_000]
    assert [scaling.states_bytes(s, psi, 4) for s in (1, 2, 3)] == [11_000, 7_000, 4_000]


def test_scaling_predicts_with_the_planner_whose_model_states_follow_the_formula(
    scaling: ModuleType,
) -> None:
    size = scaling.size_arg("64x2x2")
    config = {"batch": 2, "context": 16}
    psi = scaling.gpt_params(size, 16)
    one, four = (scaling.planned(size, 3, n, config) for n in (1, 4))
    assert one["params"] + one["optimizer"] == pytest.approx(12 * psi / 2**20, rel=0.01)
    assert four["params"] + four["optimizer"] == pytest.approx(12 * psi / 4 / 2**20, rel=0.02)
    parts = ("params", "grads", "optimizer", "working_set", "activations")
    assert four["peak"] == pytest.approx(sum(four[k] for k in parts))
    # beyond the model states, the peak holds gathered buffers or flat gradients (here, in
    # backward, this small model's flat gradients waiting for their one bucket's reduction)
    assert four["working_set"] + four["grads"] > 0
    assert four["phase"] in ("forward", "backward", "optimizer step")


def test_scaling_report_judges_every_cell_by_its_allocated_peak(
    scaling: ModuleType, tmp_path: Path
) -> None:
    size = scaling.size_arg("64x2x2")
    config = {"precision": "fp32", "batch": 2, "context": 16, "warmup": 1, "steps": 2}
    psi = 10_000_000  # the rows take Ψ from the worker's result

    def row(stage: int, world: int, ratio: float) -> dict:
        plan = {"params": 10.0, "grads": 20.0, "optimizer": 30.0, "working_set": 5.0}
        plan |= {"activations": 35.0, "peak": 100.0, "phase": "backward"}
        timed = {
            "params": psi,
            "world_size": world,
            "step_s": 0.5 * world + stage,
            "peak_mb_per_rank": 130.0,
            "build_peak_mb_per_rank": 40.0,
        }
        return scaling.summarize(size, stage, timed, 100.0 * ratio, plan)

    rows = [row(1, 1, 1.0), row(2, 1, 1.05), row(2, 2, 0.85), row(3, 4, 1.2)]
    assert [r["within"] for r in rows] == [True, True, False, False]
    assert rows[3]["states_mb"] == pytest.approx(16 * psi / 4 / 2**20)
    failed = [{"size": "64x2x2", "stage": 1, "world_size": 2, "error": "timed out after 9 s"}]
    report = scaling.markdown(rows, failed, [size], config, "python scaling.py -x")
    assert f"Ψ = {scaling.gpt_params(size, 16):,} parameters" in report
    assert "`python scaling.py -x`" in report
    assert "| 100 | 105 | 1.050 | yes | 130 | 1.30 |" in report
    assert "| 2 | 2 | 3.00 | 1.20 |" in report  # stage 2, N=2: step time 1.2x that at N=1
    assert "2 of 4 cells have their allocated peak within 10% of their stage's formula" in report
    assert "- 64x2x2, stage 2, N=2: 0.85x (85 MB allocated, 100 MB predicted)." in report
    assert "- 64x2x2, stage 3, N=4: 10, 20, 30, 5, 35; backward" in report
    assert "- 64x2x2, stage 1, N=2: timed out after 9 s" in report
    scaling.plot(rows, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_step_overhead_fits_the_cost_of_a_unit_from_block_and_root_wraps() -> None:
    """Made-up runs where a step costs ``10 * depth + 3 * units`` ms (and CPU half that): the fit
    finds 3 ms (1.5 ms) per unit at every depth, and the ratios compare like with like."""
    step_overhead = load_benchmark("step_overhead")

    def result(method: str, wrap: str, depth: int) -> dict:
        units = step_overhead.units_of(method, wrap, depth)
        ms = 10 * depth + 3 * units + (5 if method == "fsdp2" else 0)
        return {
            "step_times": [ms / 1e3] * 3,
            "cpu_step_times": [ms / 2e3] * 3,
            "comm_calls_per_step": units,
            "comm_calls_per_step_by_kind": {"handshake": 2.0} if "shardwrap" in method else {},
            "final_loss": 1.0,
            "losses": [2.0, 1.0],
        }

    runs = {
        f"{depth}/{method}/{wrap}": [result(method, wrap, depth)]
        for depth in (2, 4)
        for method, wrap in [("ddp", "block")]
        + [(m, w) for m in step_overhead.SHARDED for w in ("block", "root")]
    }
    summary = step_overhead.summarize(runs)
    for method in step_overhead.SHARDED:
        fit = summary["per_unit"][method]
        assert fit["wall_ms_per_unit"] == pytest.approx(3.0)
        assert fit["cpu_ms_per_unit"] == pytest.approx(1.5)
        assert fit["by_depth_wall_ms_per_unit"] == {2: pytest.approx(3.0), 4: pytest.approx(3.0)}
    s3 = summary["rows"]["4/shardwrap-s3/block"]
    assert s3["units"] == 9 and s3["handshakes_per_step"] == 2.0
    assert s3["time_vs_ddp"] == pytest.approx((40 + 27) / (40 + 3))
    assert s3["time_vs_fsdp2"] == pytest.approx((40 + 27) / (40 + 27 + 5))
    root = summary["rows"]["4/shardwrap-s3/root"]
    assert root["time_vs_fsdp2"] == pytest.approx((40 + 3) / (40 + 3 + 5))  # FSDP2's root wrap
    args = argparse.Namespace(
        theme="t", width=64, heads=4, batch=8, context=64, warmup=1, steps=3, rounds=1, nproc=2
    )
    report = step_overhead.markdown(summary, args, {2: 247_000, 4: 477_000})
    assert "| shardwrap-s3 | 3.00 | 1.50 | 2: 3.00, 4: 3.00 |" in report
    assert "| 4 | shardwrap-s3 | block | 9 | 67.0 | 33.5 | 1.56 | 0.93 |" in report


def test_compressed_runs_every_method_on_each_link_and_a_failed_one_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    compressed = load_benchmark("compressed")
    launched: list[tuple[str, dict, str | None]] = []

    def run_once(method: str, config: dict, nproc: int, timeout: float, rate: str | None) -> dict:
        launched.append((method, config, rate))
        if config.get("zeropp"):
            raise RuntimeError(
                '[rank0]:   File "/v/site-packages/deepspeed/zero/init.py", line 9, in quant\n'
                '[rank0]:   File "/v/site-packages/deepspeed/ops/no_impl.py", line 2, in load\n'
                "[rank0]: ValueError: not implemented on CPU\n"
                "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: child failed"
            )
        compressed_run = bool(config.get("compress_grads"))
        slow = rate is not None and not compressed_run
        return {
            "step_s": 3.0 if slow else 1.0,
            "step_times": [3.0 if slow else 1.0],
            "comm_bytes_per_step": 2**20 * (25 if compressed_run else 100),
            "comm_bytes_per_step_by_kind": {"all_gather": 2**20 * 20, "reduce_scatter": 2**20 * 5}
            if compressed_run
            else {},
            "world_size": 2,
            "peak_mb_per_rank": 10.0,
            "final_loss": 1.0,
            "params": 1000,
            "config": {"model": "gpt", "batch": 2, "warmup": 1, "steps": 1, "depth": 1}
            | {"width": 8, "heads": 1, "context": 4},
        }

    monkeypatch.setattr(compressed, "run_once", run_once)
    monkeypatch.setattr(compressed.os, "geteuid", lambda: 0)
    methods = ["shardwrap-s3", "shardwrap-s3-int8", "deepspeed-s3-qwz"]
    argv = ["compressed.py", "--methods", *methods, "--rounds", "2", "--rate", "1gbit"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out-dir", str(tmp_path), "--theme", "t"])
    compressed.main()
    # Two rounds of two links, alternating; the failed method launched once only.
    limited, open_ = [("shardwrap-s3", "1gbit")] * 2, [("shardwrap-s3", None)] * 2
    expected = [*limited, ("deepspeed-s3", "1gbit"), *open_, *limited, *open_]
    assert [(m, r) for m, _, r in launched] == expected
    assert launched[1][1]["compress_params"] == launched[1][1]["compress_grads"] == "int8"
    assert "compress_grads" not in launched[0][1] and launched[2][1]["zeropp"] == "qwz"
    (md,) = tmp_path.glob("t_*.md")
    text = md.read_text()
    assert (
        "- 2 ranks, 1gbit: shardwrap-s3-int8 step time 0.33x shardwrap-s3's (goal <= 0.6x): met"
        in text
    )
    assert "bytes per step 0.25x shardwrap-s3's (goal <= 0.3x): met" in text
    assert (
        "- 2 ranks, open: shardwrap-s3-int8 step time 1.00x shardwrap-s3's (goal <= 1.0x)" in text
    )
    assert "open: shardwrap-s3-int8 bytes" not in text  # the bytes goal is the limited link's
    # Half of what a gather or reduce-scatter hands over leaves each of two ranks.
    assert "| open | shardwrap-s3-int8 | 1.00 | 25 | 12 | 10 | " in text
    assert (
        "- deepspeed-s3-qwz: `ValueError: not implemented on CPU (in deepspeed/ops/no_impl.py, "
        "line 2, in load <- deepspeed/zero/init.py, line 9, in quant)`" in text
    )
    # Reported again from its JSON, launching nothing: the same table.
    (js,) = tmp_path.glob("t_*.json")
    again = ["--from-json", str(js), "--out-dir", str(tmp_path / "again"), "--theme", "t"]
    monkeypatch.setattr(sys, "argv", [*argv, *again])
    compressed.main()
    assert len(launched) == len(expected)
    (md2,) = (tmp_path / "again").glob("t_*.md")
    table = [line for line in text.splitlines() if line.startswith("| ")]
    assert table == [line for line in md2.read_text().splitlines() if line.startswith("| ")]


def test_t5_compare_names_eval_results_that_differ_from_ddps() -> None:
    t5_compare = load_benchmark("t5_compare")

    def evaluate(seconds: float, loss: float, rows: list[list[int]]) -> dict:
        return {
            "seconds": seconds,
            "cpu_seconds": seconds / 2,
            "times": [seconds],
            "eval_losses": [loss, loss],
            "predictions": rows,
            "evaluated_as": "T5ForConditionalGeneration",
            "synced_gpus": [True],
        }

    rows = [[0, 5, 5], [0, 7, 7]]
    results = {
        "ddp": {"evaluate": evaluate(1.0, 5.5, rows)},
        "shardwrap-s2": {"evaluate": evaluate(1.1, 5.5 + 1e-4, rows)},
        "shardwrap-s3": {"evaluate": evaluate(1.2, 5.5 + 1e-7, rows)},
        "fsdp2": {"evaluate": evaluate(1.4, 5.5, [[0, 5, 5], [0, 7, 8]])},
    }
    agreed = t5_compare.agreement(results)
    assert agreed["shardwrap-s2"]["loss_diff"] == pytest.approx(1e-4)
    assert [a["rows_equal"] for a in agreed.values()] == [2, 2, 2, 1]
    args = argparse.Namespace(
        nproc=2, budget_mb=256, samples=64, rows=2, eval_batch=1, beams=2, tokens=2,
        repeats=1, generate=False, only="eval", methods=list(results),
    )  # fmt: skip
    report = t5_compare._report(args, results)
    lines = {line.split(":")[0]: line for line in report.splitlines() if "eval_loss" in line}
    assert "agrees" in lines["- ddp"] and "agrees" in lines["- shardwrap-s3"]
    assert "DIFFERS" in lines["- shardwrap-s2"] and "DIFFERS" in lines["- fsdp2"]
    assert "| shardwrap-s3 | not run | | | | | 1.200 | 1.20x | 0.600 | 1.20x | | | | |" in report
    assert "Stage 3's evaluate() against DDP's: 1.20x wall time (goal at most 1.3x: met)" in report
