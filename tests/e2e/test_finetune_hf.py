"""``examples/finetune_hf.py`` under ``torchrun``: Hugging Face models fine-tuned in bf16.

Process tier: the example trains GPT-2 and Llama from tiny configs under ``torchrun`` on two
ranks in bf16 (the loss falls), generates the same tokens on both ranks, and exports a folder
that ``from_pretrained`` loads; that plain model, its parameters cast to bf16, decodes exactly
the sharded run's tokens. In process: ``tests/integrations/test_finetune_hf.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_finetune_hf.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers

from tests.support.launch import torchrun

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
