"""Precision and compilation asked of ``accelerate`` or the Trainer, on a sharded model.

A sharded model is handed back by ``accelerator.prepare`` as it was wrapped, so
``Accelerator(mixed_precision="bf16")``, ``TrainingArguments(bf16=True)`` and
``torch_compile=True`` used to change nothing: the model trained in float32, uncompiled.
Proves, at stages 2 and 3 (one rank: accelerate's state is one per process, so threads cannot
be its ranks): each is refused at ``prepare`` or when ``shardwrap.hf.Trainer`` is built,
naming the ``ShardedModule`` keyword; a model wrapped with the matching ``MixedPrecision`` (or
``compile=True``) is accepted, and fp16's loss scaler becomes a ``ShardedGradScaler`` in the
accelerator and in the optimizers it prepared. ``accelerator.save_state`` refuses two
optimizers over one sharded model before writing, naming ``shardwrap.save_checkpoint``, and
``get_state_dict`` is ``full_state_dict()``. Under torchrun (saving and loading a sharded
model, parity, refusal on both ranks): ``tests/e2e/test_hf_trainer.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_settings.py -q``
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import shardwrap
from shardwrap import MixedPrecision, ShardedModule

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")
from transformers.models.gpt2.modeling_gpt2 import GPT2Block  # noqa: E402

from tests.support.models import tiny_gpt2_config  # noqa: E402

BF16 = MixedPrecision(param_dtype=torch.bfloat16)
FP16 = MixedPrecision(param_dtype=torch.float16)


@pytest.fixture(autouse=True)
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate keeps one state per process; each test sets its own precision."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _gpt2(stage: int, **options: object) -> ShardedModule:
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    return ShardedModule(model, auto_wrap=GPT2Block, stage=stage, **options)


def _ids() -> torch.Tensor:
    return torch.arange(24).reshape(2, 12) % 50


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerator_bf16_is_refused_unless_the_model_computes_in_bf16(stage: int) -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = _gpt2(stage)
    with pytest.raises(
        ValueError,
        match=r"mixed_precision='bf16'.*compute in float32.*mixed_precision=shardwrap\."
        r"MixedPrecision\(param_dtype=torch.bfloat16\) to ShardedModule",
    ):
        accelerator.prepare(model)

    model = _gpt2(stage, mixed_precision=BF16)
    prepared = accelerator.prepare(model)
    assert prepared is model
    assert prepared(input_ids=_ids()).logits.dtype == torch.bfloat16


@pytest.mark.parametrize("stage", [2, 3])
def test_accelerator_fp16_needs_an_fp16_model_and_gets_a_sharded_scaler(stage: int) -> None:
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="fp16")
    with pytest.raises(ValueError, match=r"param_dtype=torch.float16.*ShardedGradScaler"):
        accelerator.prepare(_gpt2(stage, mixed_precision=BF16))
    # accelerate makes torch's scaler for fp16 on an accelerator device, not on a CPU: give
    # this one the scaler it would make there; it must not survive preparing a sharded model.
    stock = torch.amp.GradScaler("cpu")
    accelerator.scaler = stock
    model = _gpt2(stage, mixed_precision=FP16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer, model = accelerator.prepare(optimizer, model)
    assert isinstance(accelerator.scaler, shardwrap.ShardedGradScaler)
    assert optimizer.scaler is accelerator.scaler


def test_accelerator_compile_is_refused_unless_units_are_compiled() -> None:
    accelerator = accelerate.Accelerator(cpu=True, dynamo_backend="inductor")
    with pytest.raises(ValueError, match=r"dynamo_backend='inductor'.*compile=True"):
        accelerator.prepare(_gpt2(3))
    model = _gpt2(3, compile=True)
    assert accelerator.prepare(model) is model


def _arguments(tmp_path: Path, **kwargs: object) -> object:
    return transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], **kwargs
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_trainer_bf16_is_refused_when_built_unless_the_model_computes_in_bf16(
    tmp_path: Path, stage: int
) -> None:
    import shardwrap.hf

    args = _arguments(tmp_path, bf16=True, max_steps=1, per_device_train_batch_size=2)
    with pytest.raises(
        ValueError,
        match=r"TrainingArguments\(bf16=True\).*MixedPrecision\(param_dtype=torch.bfloat16\)",
    ):
        shardwrap.hf.Trainer(model=_gpt2(stage), args=args)

    model = _gpt2(stage, mixed_precision=BF16)
    rows = [{"input_ids": r, "labels": r} for r in _ids()]
    trainer = shardwrap.hf.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    assert trainer.state.global_step == 1
    assert model(input_ids=_ids()).logits.dtype == torch.bfloat16


def test_trainer_compile_and_full_eval_casts_are_refused_when_built(tmp_path: Path) -> None:
    import shardwrap.hf

    with pytest.raises(ValueError, match=r"torch_compile=True.*compile=True"):
        shardwrap.hf.Trainer(model=_gpt2(3), args=_arguments(tmp_path, torch_compile=True))
    with pytest.raises(ValueError, match=r"bf16_full_eval=True.*param_dtype=torch.bfloat16"):
        shardwrap.hf.Trainer(model=_gpt2(3), args=_arguments(tmp_path, bf16_full_eval=True))
    trainer = shardwrap.hf.Trainer(
        model=_gpt2(3, compile=True), args=_arguments(tmp_path, torch_compile=True)
    )
    assert trainer.args.torch_compile and trainer.model._shardwrap_root.compile_options is not None


def test_accelerator_save_state_refuses_two_optimizers_over_one_sharded_model(
    tmp_path: Path,
) -> None:
    accelerator = accelerate.Accelerator(cpu=True)
    model = _gpt2(3)
    params = list(model.parameters())
    first = torch.optim.SGD(params[:2], lr=0.1)
    second = torch.optim.SGD(params[2:], lr=0.1)
    model, first, second = accelerator.prepare(model, first, second)
    with pytest.raises(ValueError, match=r"several optimizers.*shardwrap.save_checkpoint"):
        accelerator.save_state(str(tmp_path / "state"))
    assert not (tmp_path / "state" / "shardwrap").exists()
    state = accelerator.get_state_dict(model)
    assert _equal(state, model.full_state_dict())


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
