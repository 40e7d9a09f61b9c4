"""Training parity: a sharded model trains exactly like the plain model on the whole global batch.

Each case deep-copies one seeded model into a plain reference, trained on the whole global
batch, and into a ``ShardedModule`` on every rank, each rank training on its equal slice of the
same batch. After several steps:

- SGD with momentum: every parameter (``full_state_dict()``) equals the reference's within 1e-5;
- AdamW: the global loss of every step equals the reference's within 1e-5.

Models: ``tests.support.models.GPT`` with odd sizes (padding, parameters split across ranks), untied
and tied, under every ``auto_wrap`` form and with ``reshard_after_forward=False``; Hugging Face
GPT-2 (tied embedding and head) and Llama from tiny configs (random weights, nothing
downloaded), including greedy ``generate()``. World sizes 1, 2 and 4.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/test_parity.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.hybrid import hybrid_mesh
from tests.support.models import (
    GPT,
    HF_VOCAB,
    Block,
    CausalSelfAttention,
    make_batch,
    tiny_gpt2_config,
    tiny_llama_config,
)
from tests.support.ranks import run_ranks

Batch = tuple[Tensor, Tensor]  # (inputs, targets), global batch first
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Finish = Callable[[nn.Module], Any]

STEPS = 4
GLOBAL_BATCH = 8  # divisible by every world size tested


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


# the parity loop ---------------------------------------------------------------------


@dataclass
class Trained:
    """What one training run leaves behind."""

    losses: list[float]  # global mean loss of each step, before its update
    state: dict[str, Tensor]  # full state dict after the last step
    finished: Any  # what ``finish(model)`` returned after the last step


def train_steps(
    model: nn.Module,
    rank: int,
    world_size: int,
    pg: ProcessGroup | None,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    loss_fn: LossFn,
) -> list[float]:
    optimizer = make_optimizer(model.parameters())
    losses = []
    for inputs, targets in batches:
        loss = loss_fn(model, inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        total = loss.detach().clone()
        if pg is not None:
            pg.allreduce([total]).wait()
        losses.append(total.item() / world_size)
    return losses


def train_reference(
    model: nn.Module,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    loss_fn: LossFn,
    finish: Finish | None = None,
) -> Trained:
    """Train a deep copy of ``model`` unsharded, on every global batch whole."""
    ref = copy.deepcopy(model)
    losses = train_steps(ref, 0, 1, None, make_optimizer, batches, loss_fn)
    state = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    return Trained(losses, state, finish(ref) if finish else None)


def train_sharded(
    model: nn.Module,
    world_size: int,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    loss_fn: LossFn,
    finish: Finish | None = None,
    hybrid: bool = False,
    **wrap: Any,
) -> list[Trained]:
    """Train a ``ShardedModule`` deep copy of ``model`` on every rank; one result per rank.

    World size 1 runs on this thread with no process group, the documented degenerate case.
    With ``hybrid`` the ranks form shard groups of two, replicated (``tests/support/hybrid.py``).
    """

    def fn(rank: int, pg: ProcessGroup | None) -> Trained:
        group = hybrid_mesh(pg) if hybrid else pg
        sharded = ShardedModule(copy.deepcopy(model), process_group=group, **wrap)
        losses = train_steps(sharded, rank, world_size, pg, make_optimizer, batches, loss_fn)
        state = sharded.full_state_dict()
        return Trained(losses, state, finish(sharded) if finish else None)

    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=20.0)


def assert_parity(
    model: nn.Module,
    world_size: int,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    loss_fn: LossFn,
    finish: Finish | None = None,
    hybrid: bool = False,
    **wrap: Any,
) -> tuple[Trained, list[Trained]]:
    """Train reference and sharded copies; assert loss parity, and parameter parity for SGD.

    Returns the reference run and the per-rank runs, for further checks.
    """
    ref = train_reference(model, make_optimizer, batches, loss_fn, finish)
    moved = max((ref.state[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert moved > 1e-3, "the reference did not train; parity would prove nothing"
    runs = train_sharded(
        model, world_size, make_optimizer, batches, loss_fn, finish, hybrid=hybrid, **wrap
    )
    for rank, run in enumerate(runs):
        torch.testing.assert_close(
            torch.tensor(run.losses),
            torch.tensor(ref.losses),
            atol=1e-5,
            rtol=0,
            msg=lambda m, rank=rank: f"rank {rank}, losses by step: {m}",
        )
        if make_optimizer is sgd:
            assert run.state.keys() == ref.state.keys()
            torch.testing.assert_close(
                run.state,
                ref.state,
                atol=1e-5,
                rtol=0,
                msg=lambda m, rank=rank: f"rank {rank}, parameters after {STEPS} steps: {m}",
            )
    return ref, runs


# tests.support.models.GPT ----------------------------------------------------------------------

GPT_BATCHES = [make_batch(seed=step, batch=GLOBAL_BATCH) for step in range(STEPS)]


def gpt_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return model(inputs, targets)


def build_gpt(tied: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(tied=tied)


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

HF_BATCHES = [
    (tokens, tokens)
    for tokens in (
        torch.randint(HF_VOCAB, (GLOBAL_BATCH, 12), generator=torch.Generator().manual_seed(step))
        for step in range(STEPS)
    )
]
PROMPT = torch.tensor([[5, 17, 3, 42], [90, 1, 1, 64]])


def hf_loss(model: nn.Module, inputs: Tensor, labels: Tensor) -> Tensor:
    return model(input_ids=inputs, labels=labels).loss


@dataclass
class HFCase:
    """A tiny Hugging Face causal LM and the class that ``auto_wrap`` selects in it."""

    model: nn.Module
    block: type[nn.Module]


def build_hf(name: str) -> HFCase:
    """GPT-2 (tied embedding and head) or Llama from the tiny configs, seeded."""
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    if name == "gpt2":
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
        assert model.lm_head.weight is model.transformer.wte.weight
        return HFCase(model, GPT2Block)
    return HFCase(transformers.LlamaForCausalLM(tiny_llama_config()), LlamaDecoderLayer)


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


def greedy(model: nn.Module) -> Tensor:
    model.eval()
    with torch.no_grad():
        return model.generate(
            input_ids=PROMPT,
            attention_mask=torch.ones_like(PROMPT),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )


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
