"""``transformers.Trainer`` on a sharded model, in process.

Moving a sharded model to the device its shards are on (``cpu`` and ``cpu:0``, as ``Trainer``
does) changes nothing, and a real move or cast is refused, naming the fix; the stock
``Trainer``, which would save on rank 0 alone and wait for good at its first checkpoint, is
refused when it is built, naming ``shardwrap.hf.Trainer``. ``shardwrap.hf.Trainer`` and an
``accelerate`` loop training against DDP under torchrun: ``tests/e2e/test_hf_trainer.py``.

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
