"""Hugging Face T5 at every stage, and modules called on their own.

``T5ForConditionalGeneration`` from a tiny config (random weights, nothing downloaded), wrapped
by ``T5Block``: the encoder, the decoder and the head share one embedding, which lands in the
root unit. ``generate()`` calls the encoder by itself, outside the root's forward, so the
embedding's module must gather the root on its own. Proves, against the unwrapped model trained
on the whole global batch:

- SGD parameter parity (1e-5) and AdamW loss parity (1e-5) at stages 1, 2 and 3, at world sizes
  1, 2 and 4 and hybrid 2 x 2, with greedy ``generate()`` after training equal to the plain
  model's;
- a submodule called on its own (``model.encoder``, ``model.get_input_embeddings()`` feeding
  ``inputs_embeds``, a block inside a unit) sees its full parameters, trains in parity when its
  output is differentiated, and leaves nothing gathered that the stage would have released.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_t5.py -q``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers.models.t5.modeling_t5 import T5Block

from shardwrap import ShardedModule
from tests.support.hybrid import hybrid_mesh
from tests.support.models import HF_VOCAB, tiny_t5_config
from tests.support.parity import GLOBAL_BATCH, STEPS, adamw, assert_parity, sgd
from tests.support.ranks import run_ranks

SOURCE, TARGET = 10, 6
BATCHES = [
    (
        torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, SOURCE), generator=g),
        torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, TARGET), generator=g),
    )
    for g in (torch.Generator().manual_seed(100 + step) for step in range(STEPS))
]
PROMPT = torch.randint(2, HF_VOCAB, (2, SOURCE), generator=torch.Generator().manual_seed(7))


def t5_loss(model: nn.Module, source: Tensor, target: Tensor) -> Tensor:
    return model(input_ids=source, labels=target).loss


def generate(model: nn.Module) -> Tensor:
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=PROMPT, max_new_tokens=5, min_new_tokens=5, do_sample=False)
    model.train()
    return out


@pytest.fixture(scope="module")
def t5() -> nn.Module:
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(tiny_t5_config())
    assert model.lm_head.weight is model.shared.weight is model.encoder.embed_tokens.weight
    return model


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_t5_trains_and_generates_like_the_plain_model(
    t5: nn.Module, stage: int, world_size: int
) -> None:
    ref, runs = assert_parity(
        t5, world_size, sgd, BATCHES, t5_loss, finish=generate, auto_wrap=T5Block, stage=stage
    )
    assert ref.finished.shape == (PROMPT.shape[0], 6)
    for run in runs:
        torch.testing.assert_close(run.finished, ref.finished, atol=0, rtol=0)
    assert_parity(t5, world_size, adamw, BATCHES, t5_loss, auto_wrap=T5Block, stage=stage)


def _plain_run(model: nn.Module, make_opt: Any) -> tuple[list[float], dict[str, Tensor], Tensor]:
    ref = copy.deepcopy(model)
    opt = make_opt(ref.parameters())
    losses = []
    for source, target in BATCHES:
        opt.zero_grad()
        loss = t5_loss(ref, source, target)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, ref.state_dict(), generate(ref)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_t5_hybrid_2x2(t5: nn.Module, stage: int) -> None:
    want_losses, want_state, want_tokens = _plain_run(t5, sgd)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor], Tensor]:
        m = ShardedModule(
            copy.deepcopy(t5), auto_wrap=T5Block, process_group=hybrid_mesh(pg), stage=stage
        )
        opt = sgd(m.parameters())
        losses = []
        for source, target in BATCHES:
            opt.zero_grad()
            loss = t5_loss(m, source.chunk(4)[rank], target.chunk(4)[rank])
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            pg.allreduce([mean]).wait()
            losses.append(mean.item() / 4)
        return losses, m.full_state_dict(), generate(m)

    for losses, state, tokens in run_ranks(4, fn, timeout=60.0):
        torch.testing.assert_close(losses, want_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, want_state, atol=1e-5, rtol=0)
        assert torch.equal(tokens, want_tokens)


# modules called on their own ---------------------------------------------------------


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_encoder_called_alone_sees_full_parameters(t5: nn.Module, stage: int) -> None:
    with torch.no_grad():
        want = t5.encoder(input_ids=PROMPT).last_hidden_state

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = ShardedModule(copy.deepcopy(t5), auto_wrap=T5Block, process_group=pg, stage=stage)
        with torch.no_grad():
            first = m.encoder(input_ids=PROMPT).last_hidden_state
            again = m.encoder(input_ids=PROMPT).last_hidden_state
        assert torch.equal(first, again)
        return first

    for got in run_ranks(2, fn, timeout=30.0):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_input_embeddings_called_alone_train_in_parity(t5: nn.Module) -> None:
    """``model(inputs_embeds=model.get_input_embeddings()(ids))``: the embedding's gradient
    arrives through a call outside the model's forward, and still reaches the shard."""

    def loss_fn(model: nn.Module, source: Tensor, target: Tensor) -> Tensor:
        embeds = model.get_input_embeddings()(source)
        return model(inputs_embeds=embeds, labels=target).loss

    assert_parity(t5, 2, sgd, BATCHES, loss_fn, auto_wrap=T5Block)


@pytest.mark.stage3
def test_block_inside_a_unit_called_alone_is_released_after(t5: nn.Module) -> None:
    """At stage 3 a unit gathered for a call to one of its modules is resharded after it."""
    hidden = torch.randn(2, SOURCE, t5.config.d_model, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = t5.encoder.block[1].layer[1](hidden)

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        m = ShardedModule(copy.deepcopy(t5), auto_wrap=T5Block, process_group=pg)
        unit = m.encoder.block[1]._shardwrap_unit
        with torch.no_grad():
            got = m.encoder.block[1].layer[1](hidden)
        assert unit.state.name == "SHARDED"
        return got

    for got in run_ranks(2, fn, timeout=30.0):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
