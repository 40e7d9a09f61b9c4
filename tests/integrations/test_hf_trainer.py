"""``transformers.Trainer`` on a sharded model, in process.

Moving a sharded model to the device its shards are on (``cpu`` and ``cpu:0``, as ``Trainer``
does) changes nothing, and a real move or cast is refused, naming the fix; the stock
``Trainer``, which would save on rank 0 alone and wait for good at its first checkpoint, is
refused when it is built, naming ``shardwrap.hf.Trainer``; ``shardwrap.hf.Seq2SeqTrainer``
lets ``generate()`` choose ``synced_gpus`` unless the caller passes it. ``shardwrap.hf.Trainer``
and an ``accelerate`` loop training against DDP under torchrun: ``tests/e2e/test_hf_trainer.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_trainer.py -q``
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardwrap import ShardedModule
from tests.support.models import GPT, Block


def test_moving_to_its_own_device_is_a_no_op_and_a_real_move_is_refused() -> None:
    m = ShardedModule(GPT(), auto_wrap=Block)
    storage = [p.data_ptr() for p in m.parameters()]
    assert m.to("cpu") is m and m.to(torch.device("cpu", 0)) is m and m.float() is m
    assert [p.data_ptr() for p in m.parameters()] == storage  # still the flat shards
    with pytest.raises(ValueError, match="detach.*mixed_precision=MixedPrecision"):
        m.double()
    with pytest.raises(ValueError, match="device=..."):
        m.to("meta")
    assert [p.data_ptr() for p in m.parameters()] == storage


def test_stock_trainer_is_refused_when_built_naming_shardwrap_trainer(tmp_path: Path) -> None:
    import transformers

    import shardwrap.hf
    from tests.support.models import tiny_gpt2_config

    model = ShardedModule(
        transformers.GPT2LMHeadModel(tiny_gpt2_config()),
        auto_wrap=transformers.models.gpt2.modeling_gpt2.GPT2Block,
    )
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(TypeError, match="rank 0 alone.*shardwrap.hf.Trainer"):
        transformers.Trainer(model=model, args=args)
    with pytest.raises(TypeError, match="shardwrap.hf.Trainer"):
        transformers.Seq2SeqTrainer(model=model, args=args)
    trainer = shardwrap.hf.Trainer(model=model, args=args)
    assert trainer.model is model


def test_save_model_asks_only_the_saving_rank_to_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every rank gathers; only the rank that saves (``args.should_save``) hands the result to
    the Trainer's ``_save``, which writes wherever it is called: before transformers 5.23 it
    took its caller for process zero, so another rank's empty dict could overwrite rank 0's
    files (an adapter saved with no tensors, seen with 5.17)."""
    import transformers

    import shardwrap.hf
    from tests.support.models import tiny_gpt2_config

    model = ShardedModule(
        transformers.GPT2LMHeadModel(tiny_gpt2_config()),
        auto_wrap=transformers.models.gpt2.modeling_gpt2.GPT2Block,
    )
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    trainer = shardwrap.hf.Trainer(model=model, args=args)
    written: list[set[str]] = []
    monkeypatch.setattr(
        shardwrap.hf.Trainer,
        "_save",
        lambda self, output_dir, state_dict: written.append(set(state_dict)),
    )
    trainer.save_model(str(tmp_path / "saving"))
    assert written == [set(model.full_state_dict())]
    monkeypatch.setattr(type(args), "should_save", property(lambda self: False))
    trainer.save_model(str(tmp_path / "not-saving"))
    assert len(written) == 1


def test_seq2seq_trainer_lets_generate_choose_synced_gpus_unless_the_caller_passes_it(
    tmp_path: Path,
) -> None:
    """``shardwrap.hf.Seq2SeqTrainer``'s ``evaluate()`` and ``predict()`` pass
    ``synced_gpus=None`` to ``generate()``, where the stock trainer passes ``True`` for a model
    it takes as FSDP-managed (a collective per decoded token); one the caller passes is used as
    given."""
    import transformers
    from transformers.distributed.fsdp import is_fsdp_managed_module
    from transformers.models.t5.modeling_t5 import T5Block

    import shardwrap.hf
    from tests.support.models import tiny_t5_config

    torch.manual_seed(0)
    model = ShardedModule(
        transformers.T5ForConditionalGeneration(tiny_t5_config()), auto_wrap=T5Block
    )
    assert is_fsdp_managed_module(model)  # the stock trainer's default would be True
    passed = []
    generate = model.generate

    def recorded(*args: object, **kwargs: object) -> object:
        passed.append(kwargs.pop("synced_gpus", "unset"))
        return generate(*args, **kwargs)  # one rank: nobody to decode in step with

    model.generate = recorded
    rows = [{"input_ids": torch.arange(2, 10), "labels": torch.arange(2, 6)} for _ in range(2)]
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=str(tmp_path),
        use_cpu=True,
        predict_with_generate=True,
        generation_max_length=5,
        per_device_eval_batch_size=2,
        report_to=[],
        disable_tqdm=True,
    )
    trainer = shardwrap.hf.Seq2SeqTrainer(
        model=model,
        args=args,
        eval_dataset=rows,
        compute_metrics=lambda prediction: {},  # without one, evaluate() generates nothing
    )
    trainer.evaluate()
    trainer.predict(rows)
    trainer.evaluate(synced_gpus=True)
    trainer.predict(rows, synced_gpus=True)
    assert passed == [None, None, True, True]
