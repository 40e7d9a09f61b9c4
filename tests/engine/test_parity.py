"""Training parity: a sharded model trains exactly like the plain model on the whole global batch.

Each case deep-copies one seeded model into a plain reference, trained on the whole global
batch, and into a ``ShardedModule`` on every rank, each rank training on its equal slice of the
same batch (the loop: ``tests/support/parity.py``). After several steps:

- SGD with momentum: every parameter (``full_state_dict()``) equals the reference's within 1e-5;
- AdamW: the global loss of every step equals the reference's within 1e-5.

Models: ``tests.support.models.GPT`` with odd sizes (padding, parameters split across ranks), untied
and tied, under every ``auto_wrap`` form and with ``reshard_after_forward=False``; Hugging Face
GPT-2 (tied embedding and head) and Llama from tiny configs (random weights, nothing
downloaded), including greedy ``generate()``. World sizes 1, 2 and 4.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_parity.py -q``
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.models import Block, CausalSelfAttention
from tests.support.parity import (
    GPT_BATCHES,
    HF_BATCHES,
    PROMPT,
    HFCase,
    adamw,
    assert_parity,
    build_gpt,
    build_hf,
    gpt_loss,
    greedy,
    hf_loss,
    sgd,
)

# tests.support.models.GPT --------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gpt_sgd_parameters_match(world_size: int, tied: bool) -> None:
    _, runs = assert_parity(
        build_gpt(tied), world_size, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block
    )
    if tied:
        for run in runs:
            assert torch.equal(run.state["wte.weight"], run.state["lm_head.weight"])


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gpt_adamw_losses_match(world_size: int, tied: bool) -> None:
    assert_parity(build_gpt(tied), world_size, adamw, GPT_BATCHES, gpt_loss, auto_wrap=Block)


ELEMENTWISE = {
    "adam": lambda params: torch.optim.Adam(params, lr=3e-3),
    "adagrad": lambda params: torch.optim.Adagrad(params, lr=3e-2),
    "rmsprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, momentum=0.5),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_other_elementwise_optimizers_run_unchanged(name: str) -> None:
    """Any elementwise torch optimizer trains the shard parameters as it trains the plain ones."""
    assert_parity(build_gpt(False), 2, ELEMENTWISE[name], GPT_BATCHES, gpt_loss, auto_wrap=Block)


@pytest.mark.stage3
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gpt_parity_without_reshard_after_forward(tied: bool) -> None:
    model = build_gpt(tied)
    assert_parity(
        model, 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block, reshard_after_forward=False
    )
    assert_parity(
        model, 2, adamw, GPT_BATCHES, gpt_loss, auto_wrap=Block, reshard_after_forward=False
    )


AUTO_WRAP_FORMS = {
    "class": Block,
    "tuple": (Block, nn.Embedding),  # tied: wte and lm_head, its other use, in different units
    "callable": lambda m: isinstance(m, (CausalSelfAttention, nn.Linear)),  # nested units
    # Thresholds count bottom-up. 5000 selects each attention and the two big MLP Linears;
    # 3000 selects each qkv and MLP Linear, and then `blocks`, the ModuleList that holds the
    # remaining 3 x 1476 parameters of the blocks.
    "int-5000": 5000,
    "int-3000": 3000,
    "none": None,  # the whole model is one unit
}


@pytest.mark.parametrize("form", AUTO_WRAP_FORMS)
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_gpt_parity_under_every_auto_wrap_form(form: str, tied: bool) -> None:
    assert_parity(build_gpt(tied), 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=AUTO_WRAP_FORMS[form])


# Hugging Face transformers -------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt2() -> HFCase:
    return build_hf("gpt2")


@pytest.fixture(scope="module")
def llama() -> HFCase:
    return build_hf("llama")


@pytest.fixture(params=["gpt2", "llama"])
def hf_case(request: pytest.FixtureRequest) -> HFCase:
    return request.getfixturevalue(request.param)


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_hf_sgd_parameters_match(hf_case: HFCase, world_size: int) -> None:
    assert_parity(hf_case.model, world_size, sgd, HF_BATCHES, hf_loss, auto_wrap=hf_case.block)


def test_hf_adamw_losses_match(hf_case: HFCase) -> None:
    assert_parity(hf_case.model, 2, adamw, HF_BATCHES, hf_loss, auto_wrap=hf_case.block)


def test_gpt2_head_stays_tied_to_embedding(gpt2: HFCase) -> None:
    def tied(model: nn.Module) -> bool:
        return model.lm_head.weight is model.transformer.wte.weight

    ref, runs = assert_parity(
        gpt2.model, 2, sgd, HF_BATCHES, hf_loss, finish=tied, auto_wrap=gpt2.block
    )
    assert ref.finished
    for run in runs:
        assert run.finished, "the sharded model's head and embedding are no longer one parameter"
        assert {"transformer.wte.weight", "lm_head.weight"} <= run.state.keys()
        assert torch.equal(run.state["transformer.wte.weight"], run.state["lm_head.weight"])


def test_hf_greedy_generate_matches_after_training(hf_case: HFCase) -> None:
    ref, runs = assert_parity(
        hf_case.model, 2, sgd, HF_BATCHES, hf_loss, finish=greedy, auto_wrap=hf_case.block
    )
    assert ref.finished.shape == (PROMPT.shape[0], PROMPT.shape[1] + 6)
    for run in runs:
        torch.testing.assert_close(run.finished, ref.finished, atol=0, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hf_hybrid_2x2_trains_and_generates(hf_case: HFCase, stage: int) -> None:
    """Hybrid sharding (two shard groups of two ranks) on GPT-2 and Llama, at every stage."""
    ref, runs = assert_parity(
        hf_case.model,
        4,
        sgd,
        HF_BATCHES,
        hf_loss,
        finish=greedy,
        hybrid=True,
        auto_wrap=hf_case.block,
        stage=stage,
    )
    for run in runs:
        torch.testing.assert_close(run.finished, ref.finished, atol=0, rtol=0)
