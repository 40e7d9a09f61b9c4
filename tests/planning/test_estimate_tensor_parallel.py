"""The memory planner with tensor parallelism: ``estimate_memory(..., tp=2)`` and ``--tp``.

Proves that at dp=2 x tp=2 the plan of what a rank holds at its peak is within 5% of the peak
of tracked allocations (``shardwrap.track_allocations`` on each of four ranks as threads with a
``DeviceMesh`` each, from wrapping on, over three AdamW steps) at stages 1, 2 and 3, on the GPT
of ``examples/train_gpt.py`` under ``examples/train_gpt_tp.py``'s plan; that the command line
plans the same from ``--tp`` and ``--tp-plan``; that a ``transformers`` model's own plan is the
default and splits its matrices; and that a ``tp`` that does not divide the world size, or a
plan the planner cannot read, is refused naming the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest
tests/planning/test_estimate_tensor_parallel.py -q``
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import PrepareModuleInput, parallelize_module

from examples.train_gpt import GPT, Block
from examples.train_gpt_tp import tp_plan
from shardwrap import ShardedModule, estimate_memory, track_allocations
from shardwrap.estimate import main
from tests.support.tp import run_mesh_ranks

CONFIG = {"width": 256, "depth": 2, "heads": 4, "context": 128}
BATCH = 2
STEPS = 3  # the first step, then steady ones


def _measured(stage: int) -> int:
    """The largest tracked peak of four ranks training the GPT at dp=2 x tp=2."""
    torch.manual_seed(0)
    model = GPT(**CONFIG)

    def fn(rank: int, mesh: DeviceMesh) -> int:
        plain = parallelize_module(copy.deepcopy(model), mesh["tp"], tp_plan())
        gen = torch.Generator().manual_seed(mesh.get_local_rank("dp"))
        batches = [torch.randint(256, (BATCH, CONFIG["context"] + 1), generator=gen)]
        batches *= STEPS
        with track_allocations() as tracked:
            m = ShardedModule(plain, process_group=mesh, auto_wrap=Block, stage=stage)
            opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
            for tokens in batches:
                logits = m(tokens[:, :-1])
                loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
            del logits  # kept by the loop until the next forward, as the plan assumes
        return tracked.peak

    return max(run_mesh_ranks((2, 2), ("dp", "tp"), fn))


PLAN = dict(
    world_size=4, tp=2, tp_plan=tp_plan(), batch=BATCH, seq=CONFIG["context"], kwargs=CONFIG
)


@pytest.mark.stage3  # names its stages itself: once is enough
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_estimate_at_dp2_tp2_is_within_5_percent_of_the_tracked_peak(stage: int) -> None:
    plan = estimate_memory("examples.train_gpt:GPT", stage=stage, **PLAN)
    estimate, measured = plan.row(stage).peak, _measured(stage)
    assert abs(estimate - measured) <= 0.05 * measured, (
        f"stage {stage}: estimated {estimate / 2**20:.2f} MiB, measured "
        f"{measured / 2**20:.2f} MiB\n{plan}"
    )


def test_the_command_plans_the_tp_degree(capsys: pytest.CaptureFixture) -> None:
    plan = main(
        [
            "examples.train_gpt:GPT",
            *("--world-size", "4", "--tp", "2", "--tp-plan", "examples.train_gpt_tp:tp_plan"),
            *("--batch", str(BATCH), "--seq", str(CONFIG["context"])),
            *("--kwargs", json.dumps(CONFIG)),
        ]
    )
    assert "world size 4 (dp 2 x tp 2)" in capsys.readouterr().out
    assert plan.rows == estimate_memory("examples.train_gpt:GPT", **PLAN).rows


def test_a_transformers_models_own_plan_is_the_default() -> None:
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
    kwargs = dict(world_size=4, tp=2, stage=3, batch=1, seq=32, kwargs=small)
    own = estimate_memory("llama", **kwargs).row(3)
    unsplit = estimate_memory("llama", tp_plan={}, **kwargs).row(3)
    # its plan splits the embedding, the attention and MLP matrices and the head: of the
    # parameters (and their AdamW state) each rank holds about half, the norms' aside
    assert 0.45 < own.params / unsplit.params < 0.55
    assert 0.45 < own.optimizer / unsplit.optimizer < 0.55
    assert own.activations < unsplit.activations


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tp": 3}, "tp must be a positive int that divides world_size (4)"),
        ({"tp": 2, "tp_plan": {"blocks.*.nothing": None}}, "holds a NoneType"),
        ({"tp": 2, "tp_plan": {"blocks.*.nothing": PrepareModuleInput()}}, "PrepareModuleInput"),
        ({"tp": 2}, "tp above 1 needs the plan"),
    ],
)
def test_what_the_planner_cannot_plan_is_refused(kwargs: dict, words: str) -> None:
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        estimate_memory("examples.train_gpt:GPT", world_size=4, kwargs=CONFIG, **kwargs)
