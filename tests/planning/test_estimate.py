"""The memory planner: ``shardwrap.estimate_memory`` and ``python -m shardwrap.estimate``.

What this file proves:

- the estimate of what a rank holds at its peak is within 10% of the peak measured while
  training (every storage each rank creates, from wrapping on, tracked over two AdamW steps)
  at stages 1, 2 and 3, two ranks, on the benchmark model (the GPT of
  ``examples/train_gpt.py``, at a small width), in fp32 and in bf16 mixed precision;
- the model is never materialised: a 70.9B-parameter GPT is planned in seconds;
- the command line prints one row per stage and tier, and the disk tier moves the shards,
  gradients and optimizer state to files;
- a Hugging Face model type is planned from its config alone;
- bad input (stage 4, world size 0, the disk tier at stage 1) raises naming the fix;
- ``track_allocations`` counts the tensors made inside it while they live, and neither views
  of tensors made before nor memory torch was handed (a mapped file).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_estimate.py -q``
"""

from __future__ import annotations

import copy
import mmap
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed import ProcessGroup

from examples.train_gpt import GPT, Block
from shardwrap import MixedPrecision, ShardedModule, estimate_memory, track_allocations
from shardwrap.estimate import main
from tests.support.memory import StorageTracker
from tests.support.ranks import run_ranks

CONFIG = {"width": 128, "depth": 4, "heads": 4, "context": 64}
BATCH = 2
STEPS = 2  # the second runs in steady state: optimizer state, prefetch


def measured_peak(
    config: dict[str, int],
    stage: int,
    batch: int,
    steps: int,
    precision: MixedPrecision | None = None,
    timeout: float = 60.0,
    world_size: int = 2,
) -> int:
    """The largest peak of ``world_size`` ranks (threads) training the GPT of
    ``examples/train_gpt.py`` like ``benchmarks/_worker.py``, every storage each creates from
    wrapping on tracked (``tests/_memory.py``), in bytes. ``benchmarks/estimate.py`` measures
    with it too."""
    torch.manual_seed(0)
    model = GPT(**config)
    seq = config["context"]

    def fn(rank: int, pg: ProcessGroup) -> int:
        plain = copy.deepcopy(model)
        gen = torch.Generator().manual_seed(rank)
        tokens = [torch.randint(256, (batch, seq + 1), generator=gen) for _ in range(steps)]
        with StorageTracker(existing=tuple(tokens)) as tracker:
            m = ShardedModule(
                plain, auto_wrap=Block, process_group=pg, stage=stage, mixed_precision=precision
            )
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            for t in tokens:
                logits = m(t[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), t[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
        return tracker.peak

    return max(run_ranks(world_size, fn, timeout=timeout))


@pytest.mark.stage3  # names its stages itself: once is enough
@pytest.mark.parametrize("precision", [None, MixedPrecision()], ids=["fp32", "bf16"])
def test_estimate_is_within_10_percent_of_the_measured_peak_at_every_stage(
    precision: MixedPrecision | None,
) -> None:
    plan = estimate_memory(
        "examples.train_gpt:GPT",
        world_size=2,
        mixed_precision=precision,
        batch=BATCH,
        seq=CONFIG["context"],
        kwargs=CONFIG,
    )
    for stage in (1, 2, 3):
        estimate = plan.row(stage).peak
        measured = measured_peak(CONFIG, stage, BATCH, STEPS, precision)
        assert abs(estimate - measured) <= 0.1 * measured, (
            f"stage {stage}: estimated {estimate / 2**20:.2f} MiB, measured "
            f"{measured / 2**20:.2f} MiB\n{plan}"
        )


@pytest.mark.stage3  # names its stages itself: once is enough
@pytest.mark.parametrize("stage", [2, 3])
def test_estimate_counts_the_receive_buffers_of_a_reduction_over_four_ranks(stage: int) -> None:
    # On the CPU over more than two ranks each reduction in flight receives every peer's piece
    # into a buffer of its own; without them the plan falls short by (N-1)/N of a unit.
    plan = estimate_memory(
        "examples.train_gpt:GPT", world_size=4, batch=BATCH, seq=CONFIG["context"], kwargs=CONFIG
    )
    estimate = plan.row(stage).peak
    measured = measured_peak(CONFIG, stage, BATCH, STEPS, world_size=4)
    assert abs(estimate - measured) <= 0.005 * measured, (estimate, measured)


def test_a_70b_model_is_planned_without_being_materialised() -> None:
    start = time.perf_counter()
    with torch.device("meta"):
        model = GPT(width=16384, depth=22, heads=128, context=4096)  # 70.9B parameters
    plan = estimate_memory(model, world_size=64, stage=3, batch=1, seq=256)
    assert time.perf_counter() - start < 20
    assert plan.params > 70e9 and plan.units == 23
    row = plan.row(3)
    assert row.params == pytest.approx(4 * plan.params / 64, rel=1e-3)  # fp32 shards
    assert row.optimizer == pytest.approx(8 * plan.params / 64, rel=1e-3)  # AdamW's moments


def test_the_command_prints_every_stage_and_the_disk_tier(capsys: pytest.CaptureFixture) -> None:
    plan = main(
        [
            "examples.train_gpt:GPT",
            "--world-size", "2",
            "--batch", "2",
            "--seq", "64",
            "--offload", "disk",
            "--kwargs", '{"width": 64, "depth": 2, "heads": 2, "context": 64}',
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert "world size 2, batch 2 x seq 64" in out and "disk" in out
    assert [(r.stage, r.offload) for r in plan.rows] == [
        (1, None),
        (2, None),
        (3, None),
        (3, "disk"),
    ]
    memory, disk = plan.row(3), plan.row(3, "disk")
    assert disk.params == disk.optimizer == 0
    assert disk.disk == memory.params + memory.optimizer + memory.params  # shards, grads, state
    assert disk.peak < memory.peak


def test_a_hugging_face_model_type_is_planned_from_its_config() -> None:
    tiny = {"n_layer": 2, "n_embd": 64, "n_head": 2, "vocab_size": 256}
    plan = estimate_memory("gpt2", world_size=4, stage=(1, 3), batch=2, seq=32, kwargs=tiny)
    assert plan.units == 3  # the root and two GPT2Block
    one, three = plan.row(1), plan.row(3)
    assert one.params == pytest.approx(4 * plan.params, rel=0.01)
    assert three.params == pytest.approx(plan.params, rel=0.01)
    assert one.activations > 0 and three.working_set > 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"stage": 4}, "stage must be 1, 2 or 3"),
        ({"world_size": 0}, "world_size must be a positive int"),
        ({"stage": 1, "offload": "disk"}, 'offload="disk" needs stage=3'),
        ({"optimizer": "lamb"}, "optimizer must be one of"),
    ],
)
def test_bad_input_is_refused_naming_the_fix(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        estimate_memory("examples.train_gpt:GPT", **{"world_size": 2, **kwargs}, kwargs=CONFIG)


@pytest.mark.stage3
def test_the_help_shows_each_example_on_its_own_line(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    lines = capsys.readouterr().out.splitlines()
    assert "    python -m shardwrap.estimate gpt2 --world-size 8 --batch 4 --seq 1024" in lines
    kwargs = """        --kwargs '{"width": 1024, "depth": 8, "heads": 16, "context": 64}'"""
    assert kwargs in lines


# the allocation measure ----------------------------------------------------------------


def test_tracked_allocations_count_what_the_block_makes_while_it_lives() -> None:
    before = torch.ones(1000)  # 4000 bytes, made outside
    with track_allocations() as tracked:
        a = torch.zeros(1000)  # 4000
        b = torch.tensor([1.0, 2.0])  # 8, filled outside any op, then lifted
        view = before[10:20].view(2, 5)  # over a tensor made before: nothing new
        before.mul_(2)  # in place: nothing new
        del a
        c = torch.empty(500, dtype=torch.float64)  # 4000, made after a is freed
        assert tracked.live() == 4008
        tracked.reset_peak()
        d = torch.empty(250)  # 1000
        del d
    assert tracked.peak == 5008 and tracked.live() == 4008
    assert view.shape == (2, 5) and b.numel() == 2 and c.numel() == 500


def test_tracked_allocations_leave_out_memory_torch_was_handed() -> None:
    mapped = mmap.mmap(-1, 4096)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer warns that the buffer is writable
        with track_allocations() as tracked:
            in_file = torch.frombuffer(mapped, dtype=torch.uint8).view(torch.float32)  # 4096
            in_file.add_(1)
            copy = in_file.clone()  # 4096, torch's own
    assert tracked.peak == 4096 and copy.numel() == 1024


def test_tracked_allocations_can_count_one_device() -> None:
    with track_allocations(device="cuda") as on_gpu, track_allocations(device="cpu") as on_cpu:
        kept = torch.zeros(256)
    assert on_gpu.peak == 0 and on_cpu.peak == 1024 and kept.numel() == 256
