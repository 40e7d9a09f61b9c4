"""Hugging Face models in bf16 mixed precision, in process (ranks as threads).

GPT-2 (tied embedding and head) and Llama from tiny configs, sharded at world size 2 with
``MixedPrecision()`` (bf16 compute, fp32 reduction), train with AdamW like a plain fp32
reference on the whole global batch (losses within bf16 tolerance, yet not equal: bf16 really
computes), keep fp32 shards, and ``generate()`` the same greedy tokens on both ranks. The
example, ``examples/finetune_hf.py``, under ``torchrun``: ``tests/e2e/test_finetune_hf.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_finetune_hf.py -q``
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from shardwrap import MixedPrecision
from tests.support.parity import (
    HF_BATCHES,
    PROMPT,
    adamw,
    build_hf,
    greedy,
    hf_loss,
    train_reference,
    train_sharded,
)


def greedy_with_dtypes(model: nn.Module) -> tuple[Tensor, set[torch.dtype]]:
    return greedy(model), {p.dtype for p in model.parameters()}


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_bf16_trains_like_fp32_and_generates_alike_on_every_rank(name: str) -> None:
    case = build_hf(name)
    ref = train_reference(case.model, adamw, HF_BATCHES, hf_loss)
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = train_sharded(
        case.model,
        2,
        adamw,
        HF_BATCHES,
        hf_loss,
        finish=greedy_with_dtypes,
        auto_wrap=case.block,
        mixed_precision=bf16,
    )
    expected = torch.tensor(ref.losses)
    for rank, run in enumerate(runs):
        losses = torch.tensor(run.losses)
        torch.testing.assert_close(
            losses,
            expected,
            rtol=2e-3,
            atol=0,
            msg=lambda m, rank=rank: f"rank {rank}, bf16 losses against fp32 by step: {m}",
        )
        assert (losses - expected).abs().max() > 1e-5, "bf16 run equals fp32: no bf16 compute"
        tokens, dtypes = run.finished
        assert dtypes == {torch.float32}, "shards, which the optimizer steps, must stay fp32"
        assert tokens.shape == (PROMPT.shape[0], PROMPT.shape[1] + 6)
        assert torch.equal(tokens[:, : PROMPT.shape[1]], PROMPT)
    torch.testing.assert_close(runs[1].finished[0], runs[0].finished[0], atol=0, rtol=0)
    assert runs[0].state.keys() == ref.state.keys()
