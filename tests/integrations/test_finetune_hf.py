"""Hugging Face models in bf16 mixed precision, in process and in ``examples/finetune_hf.py``.

In process (ranks as threads): GPT-2 (tied embedding and head) and Llama from tiny configs,
sharded at world size 2 with ``MixedPrecision()`` (bf16 compute, fp32 reduction), train with
AdamW like a plain fp32 reference on the whole global batch (losses within bf16 tolerance, yet
not equal: bf16 really computes), keep fp32 shards, and ``generate()`` the same greedy tokens
on both ranks.

Process tier: the example trains each model under ``torchrun`` on two ranks in bf16 (the loss
falls), generates the same tokens on both ranks, and exports a folder that ``from_pretrained``
loads; that plain model, its parameters cast to bf16, decodes exactly the sharded run's tokens.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_finetune_hf.py -q``
(``-m process`` for the ``torchrun`` runs).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from torch import Tensor, nn

from shardwrap import MixedPrecision
from tests.support.launch import torchrun
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


STEPS = 12
SAMPLE_TOKENS = 16
SAMPLE_PROMPT = "\n\ndef "


def plain_bf16_greedy(folder: Path) -> list[int]:
    """Greedy tokens of the exported model, unsharded, its parameters cast to bf16 as gathered."""
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        folder, output_loading_info=True
    )
    assert not any(info.values()), f"the export did not load cleanly: {info}"
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)  # buffers stay fp32, as under MixedPrecision()
    prompt = torch.tensor([list(SAMPLE_PROMPT.encode())])
    out = model.generate(
        input_ids=prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=SAMPLE_TOKENS,
        min_new_tokens=SAMPLE_TOKENS,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, prompt.shape[1] :].tolist()


@pytest.mark.process
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_example_trains_in_bf16_and_generates_under_torchrun(tmp_path: Path, name: str) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (data / "b.py").write_text("def f(x):\n    return x + 1\n" * 40)
    summary, exported = tmp_path / "summary.json", tmp_path / "model"
    torchrun(
        "examples/finetune_hf.py",
        *("--model", name, "--steps", str(STEPS), "--batch", "4", "--context", "32"),
        *("--width", "32", "--layers", "2", "--heads", "2", "--data", str(data)),
        *("--prompt", SAMPLE_PROMPT, "--sample-tokens", str(SAMPLE_TOKENS)),
        *("--summary", str(summary), "--export", str(exported)),
    )
    result = json.loads(summary.read_text())
    assert (result["model"], result["precision"], result["world_size"]) == (name, "bf16", 2)
    losses = result["losses"]
    assert len(losses) == STEPS
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5, f"the loss did not fall: {losses}"
    samples = result["samples"]
    assert len(samples) == 2 and len(samples[0]) == SAMPLE_TOKENS
    assert samples[1] == samples[0], "the ranks generated different tokens"
    assert plain_bf16_greedy(exported) == samples[0], "sharded bf16 decoding differs from plain"
