"""The memory planner with ``Compression``: error feedback's residuals (a full-size flat
gradient per trainable group, none for a complex one, which is reduced exactly), the packed
shards compressed gathers keep and, at stages 1 and 2, the full buffers that quantized gathers
keep apart from the shards are counted, and the plan stays within 5% of the measured peak
(``track_allocations`` on each rank while training, as ``tests/planning/test_estimate.py``
measures it).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/planning/test_estimate_compression.py -q``
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from examples.train_gpt import GPT, Block
from shardwrap import Compression, estimate_memory
from shardwrap.planning.planner import MemoryEstimate
from tests.support.memory import training_peak
from tests.support.models import ComplexLayer

pytestmark = pytest.mark.stage3  # names its stages itself: once is enough

CONFIG = {"width": 64, "depth": 2, "heads": 4, "context": 32}
BATCH, STEPS = 2, 3
BOTH = Compression(params="int8", grads="int8")


def _plan(compression: Compression | None, stage: int) -> MemoryEstimate:
    # Without buckets: quantized reductions go one group at a time, so with them the plain
    # plan would differ from a compressed one by its buckets too, not by compression alone.
    return estimate_memory(
        "examples.train_gpt:GPT",
        world_size=2,
        stage=stage,
        batch=BATCH,
        seq=CONFIG["context"],
        kwargs=CONFIG,
        compression=compression,
        bucket_mb=0,
    ).row(stage)


def _batches(rank: int, model: nn.Module) -> list[Tensor]:
    gen = torch.Generator().manual_seed(rank)
    return [torch.randint(256, (BATCH, CONFIG["context"] + 1), generator=gen) for _ in range(STEPS)]


def _loss(model: nn.Module, tokens: Tensor) -> tuple[Tensor, Any]:
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten()), logits


@pytest.mark.parametrize("stage", [2, 3])
def test_estimate_with_compression_is_within_5_percent_of_the_measured_peak(stage: int) -> None:
    estimate = _plan(BOTH, stage).peak
    torch.manual_seed(0)
    measured = training_peak(
        GPT(**CONFIG), _batches, _loss, auto_wrap=Block, stage=stage, compression=BOTH
    )
    assert abs(estimate - measured) <= 0.05 * measured, (estimate, measured)


def test_error_feedback_adds_a_full_size_gradient_per_rank() -> None:
    plain = _plan(None, 3)
    feedback = _plan(Compression(grads="int8"), 3)
    assert _plan(Compression(grads="int8", error_feedback=False), 3) == plain
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(**CONFIG).parameters())
    # every trainable flat gradient in float32, padded to a multiple of 2 ranks
    assert feedback.grads - plain.grads == pytest.approx(4 * params, rel=1e-3)


class ComplexLM(nn.Module):
    """Token ids through three ``ComplexLayer``s: complex weights beside real ones."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.layers = nn.Sequential(*(ComplexLayer() for _ in range(3)))
        self.head = nn.Linear(8, 50)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.layers(self.emb(ids)))


def test_error_feedback_keeps_no_residual_for_complex_gradients() -> None:
    """The engine reduces complex gradients exactly, so only the floating-point groups'
    flat gradients get a residual."""

    def plan(compression: Compression | None) -> MemoryEstimate:
        return estimate_memory(
            ComplexLM, world_size=2, stage=3, auto_wrap=ComplexLayer, compression=compression
        ).row(3)

    with torch.device("meta"):
        model = ComplexLM()
    real = sum(p.numel() for p in model.parameters() if p.is_floating_point())
    assert real < sum(p.numel() for p in model.parameters())
    growth = plan(Compression(grads="int8")).grads - plan(None).grads
    assert growth == pytest.approx(4 * real, rel=1e-2)


def test_quantized_gathers_keep_the_full_parameters_apart_at_stage_2() -> None:
    plain, gathers = _plan(None, 2), _plan(Compression(params="int8"), 2)
    assert gathers.params > plain.params  # the shard is no longer a slice of the full buffer


def test_the_shards_compressed_gathers_keep_packed_count_among_the_parameters() -> None:
    plain, packed = _plan(None, 3), _plan(Compression(params="int8"), 3)
    shard_elements = plain.params // 4  # float32 shards: stage 3 keeps nothing else
    # every group's shard packed: a byte per element and a float32 scale per 256
    assert packed.params - plain.params == pytest.approx(shard_elements * (1 + 4 / 256), rel=1e-3)
