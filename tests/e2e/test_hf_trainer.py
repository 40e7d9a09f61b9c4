"""``transformers.Trainer`` and ``accelerate`` training a sharded model, under torchrun.

Process tier: each script runs the same training twice in one launch, on the plain model
under DDP (what ``Trainer`` and ``accelerate`` do by default) and on a ``ShardedModule``, and
must match it step for step. Proves:

- ``shardwrap.hf.Trainer`` (GPT-2): fp32 losses, clipped gradient norms (global: the same as
  DDP's) and evaluation losses within 1e-5 of DDP over 4 steps; the model is not wrapped in DDP;
  the Trainer's own checkpoint (``checkpoint-2``) resumes to the same steps 3 and 4, and so
  does the stock Trainer's checkpoint of the DDP run (its ``optimizer.pt`` too);
  ``save_model`` writes a folder ``from_pretrained`` loads to the trained weights;
  ``generate()`` with a different length on each rank completes with DDP's tokens;
- a stock ``accelerate`` loop (Llama; ``prepare``, gradient accumulation, ``clip_grad_norm_``,
  a scheduler, ``gather_for_metrics``) trains a ``ShardedModule`` unchanged, within 1e-5 of
  the DDP run, and resumes from a shardwrap checkpoint saved at step 2;
- at stages 2 and 3, ``accelerator.save_state`` writes a shardwrap checkpoint (every rank's
  pieces, model and optimizer) and accelerate's other state, and ``load_state`` after two more
  steps brings back the step-2 parameters and learning rate exactly, so the repeated steps
  end on the same parameters; ``get_state_dict`` is the full state on every rank; the
  sharded model trains like the plain model on the global batch; and
  ``TrainingArguments(bf16=True)`` on a float32 sharded model is refused on both ranks alike;
- ``shardwrap.hf.Trainer`` on a PEFT LoRA Llama at stages 2 and 3: losses within 1e-5 of the
  stock Trainer's DDP run of the plain PEFT model over 4 steps, the trained model's logits
  too; ``save_model`` writes the adapter file (the LoRA weights alone) that
  ``PeftModel.from_pretrained`` loads onto a fresh base model to the trained model's logits.

In process: ``tests/integrations/test_hf_trainer.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_hf_trainer.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.support.launch import torchrun


def _assert_steps_match(got: list[dict], want: list[dict], keys: tuple[str, ...]) -> None:
    assert [g["step"] for g in got] == [w["step"] for w in want]
    for g, w in zip(got, want):
        for key in keys:
            assert g[key] == pytest.approx(w[key], abs=1e-5), (g["step"], key)


@pytest.mark.process
def test_trainer_matches_ddp_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/hf_trainer.py", str(out), str(tmp_path))
    result = json.loads(out.read_text())
    ddp, sharded = result["ddp"], result["shardwrap"]
    assert ddp["wrapped_in"] == "DistributedDataParallel"
    assert sharded["wrapped_in"] == "GPT2LMHeadModel"
    assert len(sharded["train"]) == 4
    assert all(step["grad_norm"] > 1.0 for step in ddp["train"])  # every step clips
    _assert_steps_match(sharded["train"], ddp["train"], ("loss", "grad_norm"))
    assert sharded["eval"] == pytest.approx(ddp["eval"], abs=1e-5)
    _assert_steps_match(sharded["resumed_train"], sharded["train"][2:], ("loss", "grad_norm"))
    # The stock Trainer's own checkpoint of the DDP run: its optimizer.pt had been ignored
    # without a word, AdamW's moments starting again from zero.
    _assert_steps_match(sharded["from_ddp_train"], ddp["train"][2:], ("loss", "grad_norm"))
    assert sharded["resumed_eval"] == pytest.approx(sharded["eval"][1:], abs=1e-5)
    assert "checkpoint-2/shardwrap/metadata.json" in sharded["checkpoint_files"]
    assert sharded["reload_equal"] is True
    assert sharded["generated"] == ddp["generated"]
    assert len(sharded["generated"][0]) != len(sharded["generated"][1])


@pytest.mark.process
def test_accelerate_loop_matches_ddp_and_resumes(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/hf_accelerate.py", str(out), str(tmp_path))
    result = json.loads(out.read_text())
    ddp, sharded = result["ddp"], result["shardwrap"]
    assert ddp["prepared_as"] == "DistributedDataParallel"
    assert sharded["prepared_as"] == "LlamaForCausalLM"
    assert len(sharded["logs"]) == 4
    assert all(step["grad_norm"] > 1.0 for step in ddp["logs"])
    keys = ("loss", "grad_norm", "eval_loss")
    _assert_steps_match(sharded["logs"], ddp["logs"], keys)
    _assert_steps_match(sharded["resumed_logs"], sharded["logs"][2:], keys)
    assert sharded["generated"] == ddp["generated"]
    assert len(sharded["generated"][0]) != len(sharded["generated"][1])


@pytest.mark.process
def test_accelerate_save_state_and_load_state_resume_a_sharded_model(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/hf_accelerate_state.py", str(out), str(tmp_path))
    result = json.loads(out.read_text())
    assert "MixedPrecision(param_dtype=torch.bfloat16) to ShardedModule" in result["refused"]
    for stage in ("stage2", "stage3"):
        got = result[stage]
        assert max(got["off_plain"]) < 1e-6, stage  # trains like the plain model
        # per rank: full shapes, == full_state_dict, reload == step 2, repeat == step 4
        assert got["checks_per_rank"] == [[True] * 4] * 2, stage
        assert got["lr"][1] == got["lr"][0], stage
        files = got["files"]
        assert "shardwrap/metadata.json" in files and "scheduler.bin" in files, stage
        assert {"shardwrap/rank-00000-of-00002.safetensors", "shardwrap/optimizer.pt"} <= set(
            files
        ), stage
        assert not any(f.startswith(("model", "optimizer")) for f in files), stage


@pytest.mark.process
def test_trainer_trains_a_peft_lora_model_like_ddp_and_saves_a_loadable_adapter(
    tmp_path: Path,
) -> None:
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/hf_peft_trainer.py", str(out), str(tmp_path))
    result = json.loads(out.read_text())
    ddp = result["ddp"]
    assert len(ddp["losses"]) == 4
    assert len(ddp["adapter_keys"]) == 8  # lora_A and lora_B of q_proj and v_proj, 2 layers
    base = torch.tensor(ddp["base_logits"])
    assert (torch.tensor(ddp["trained_logits"]) - base).abs().max() > 1e-3  # it trained
    for stage in ("stage2", "stage3"):
        got = result[stage]
        assert got["losses"] == pytest.approx(ddp["losses"], abs=1e-5), stage
        assert got["adapter_keys"] == ddp["adapter_keys"], stage
        trained = torch.tensor(got["trained_logits"])
        torch.testing.assert_close(trained, torch.tensor(ddp["trained_logits"]), atol=1e-5, rtol=0)
        torch.testing.assert_close(torch.tensor(got["loaded_logits"]), trained, atol=1e-6, rtol=0)
