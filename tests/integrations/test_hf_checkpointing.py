"""Activation checkpointing as Hugging Face users turn it on, on a sharded model.

``model.gradient_checkpointing_enable()`` (what ``Trainer(gradient_checkpointing=True)`` calls)
makes each ``transformers`` layer recompute its ``forward`` in backward; shardwrap shows the
recomputation the full parameters from the unit's backward gather. Proves, on Llama, Qwen2 (head
tied to the embedding) and T5 (default config, so with its key-value cache on) from tiny configs
at 2 ranks, against the unwrapped model trained on the whole global batch over several SGD
steps:

- Hugging Face's checkpointing (non-reentrant, its default, and reentrant) keeps loss and
  parameter parity, with exactly the collectives of shardwrap's own
  ``checkpoint_activations=True`` (no extra gather);
- ``checkpoint_activations=True`` works on T5's default config (the layers drop their cache
  arguments while checkpointing, as Hugging Face's own path does) and stays in parity;
- a checkpointing layer that encloses sharded units is refused, naming the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_checkpointing.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaMLP
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer
from transformers.models.t5.modeling_t5 import T5Block

from shardwrap import ShardedModule
from tests.support.models import HF_VOCAB, tiny_llama_config, tiny_qwen2_config, tiny_t5_config
from tests.support.parity import train_steps
from tests.support.ranks import run_ranks

WORLD, STEPS, GLOBAL_BATCH = 2, 3, 4
SOURCE, TARGET = 10, 6


def _llama() -> nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(tiny_llama_config())


def _qwen2() -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(tiny_qwen2_config())


def _t5() -> nn.Module:
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(tiny_t5_config())
    assert model.config.use_cache  # the default that made checkpointing fail
    return model


FAMILIES = {
    "llama": (_llama, LlamaDecoderLayer),
    "qwen2": (_qwen2, Qwen2DecoderLayer),
    "t5": (_t5, T5Block),
}


def _batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (
            torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, SOURCE), generator=g),
            torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, TARGET), generator=g),
        )
        for _ in range(STEPS)
    ]


def _loss(model: nn.Module, source: Tensor, target: Tensor) -> Tensor:
    if model.config.is_encoder_decoder:
        return model(input_ids=source, labels=target).loss
    return model(input_ids=source, labels=source).loss


def _train(model: nn.Module, rank: int, world: int, pg: ProcessGroup | None) -> list[float]:
    model.train()
    sgd = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
    return train_steps(model, rank, world, pg, sgd, _batches(), _loss)


def _sharded_runs(
    family: str, prepare: Callable[[nn.Module], Any], **wrap: Any
) -> tuple[list[float], dict[str, Tensor], list[tuple[list[float], dict[str, Tensor], Any]]]:
    build, layer = FAMILIES[family]
    model = build()
    ref = copy.deepcopy(model)
    ref_losses = _train(ref, 0, 1, None)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor], Any]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg, **wrap)
        prepare(m)
        losses = _train(m, rank, WORLD, pg)
        return losses, m.full_state_dict(), dict(m.comm_stats.calls)

    return ref_losses, ref.state_dict(), run_ranks(WORLD, fn, timeout=60.0)


def _assert_parity(ref_losses: list[float], ref_state: dict[str, Tensor], runs: list) -> None:
    for losses, state, _ in runs:
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_gradient_checkpointing_keeps_parity_at_no_extra_gather(
    family: str, reentrant: bool
) -> None:
    def enable(m: nn.Module) -> None:
        kwargs = {"use_reentrant": True} if reentrant else None
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        assert m.is_gradient_checkpointing

    ref_losses, ref_state, runs = _sharded_runs(family, enable)
    _assert_parity(ref_losses, ref_state, runs)
    _, _, ours = _sharded_runs(family, lambda m: None, checkpoint_activations=True)
    for (_, _, calls), (_, _, own_calls) in zip(runs, ours):
        assert calls == own_calls  # the recomputation reuses the backward gather


def test_checkpoint_activations_on_t5_default_config_keeps_parity() -> None:
    ref_losses, ref_state, runs = _sharded_runs("t5", lambda m: None, checkpoint_activations=True)
    _assert_parity(ref_losses, ref_state, runs)


def test_checkpointing_layer_enclosing_units_is_refused() -> None:
    model = _llama()

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=LlamaMLP, process_group=pg)
        with pytest.raises(ValueError, match="auto_wrap=LlamaDecoderLayer") as info:
            m.gradient_checkpointing_enable()
        return str(info.value)

    for message in run_ranks(WORLD, fn):
        assert "LlamaMLP" in message
