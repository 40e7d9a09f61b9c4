"""The CUDA tier, training on one GPU: what a model wrapped at world size 1 does on CUDA, against
the unwrapped model trained on the same GPU over the same batches.

Proves (SGD with momentum: the loss of every step and every parameter after the last within
1e-5 in fp32; in bf16 within 1e-4 of the plain mixed-precision recipe, whose bf16 kernels on a
GPU round after accumulating in an order that varies from run to run, attention's backward
among them):

- the GPT of ``tests/support/models.py`` and a ``transformers`` Llama (``tiny_llama_config``,
  random weights) at stages 1, 2 and 3, fp32 and bf16;
- ``torch.compile`` (``compile=True``, inductor's kernels): losses within 1e-4 of the eager
  plain model, and compiled graphs were made;
- generation: greedy ``generate()`` on a sharded Llama gives the plain model's tokens;
- meta-device initialisation: a GPT built on ``meta`` is materialised on the GPU (finite, its
  constants exact) and trains like a plain model loaded with its weights;
- ``device="cuda"``, without an index, is the current GPU (``cuda:0``), where the tensors are;
- NCCL at world size 1 (the default group that ``torchrun --nproc_per_node=1`` gives): the
  collectives of one rank, gathers, reductions and Muon's owner all-to-all, train like the
  plain model.

Buckets gather and reduce several units in one exchange only between two ranks or more: they
are checked with two ranks on the one GPU, in ``tests/e2e/test_gpu_two_ranks.py``.

Run: ``.venv/bin/python -m pytest -m gpu tests/tiers/test_gpu_parity.py -q -ra``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from shardwrap import MixedPrecision, ShardedModule
from tests.support.cuda import NEEDS_CUDA, cpu, gpu, nccl_world, on, trains_like_plain
from tests.support.models import GPT, Block
from tests.support.optimizers import MuonAndAdamW
from tests.support.parity import (
    GPT_BATCHES,
    HF_BATCHES,
    PROMPT,
    Batch,
    LossFn,
    build_hf,
    gpt_loss,
    hf_loss,
    sgd,
    train_recipe,
    train_reference,
    train_steps,
)

pytestmark = [pytest.mark.gpu, pytest.mark.stage3, NEEDS_CUDA]  # stages chosen here

BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
ATOL = {"fp32": 1e-5, "bf16": 1e-4}


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT()


def check_parity(
    model: nn.Module,
    block: type[nn.Module],
    batches: list[Batch],
    loss_fn: LossFn,
    stage: int,
    precision: str,
    device: torch.device,
) -> None:
    """SGD parity at world size 1 on ``device``; bf16 against the plain mixed-precision recipe
    (parameters cast, buffers kept, as ``MixedPrecision`` does)."""
    reference = None
    if precision == "bf16":
        reference = train_recipe(
            copy.deepcopy(model).to(device),
            1,
            torch.bfloat16,
            batches,
            sgd,
            on(device, loss_fn),
            cast_buffers=False,
        )
    trains_like_plain(
        model,
        sgd,
        batches,
        loss_fn,
        device,
        atol=ATOL[precision],
        reference=reference,
        auto_wrap=block,
        stage=stage,
        mixed_precision=BF16 if precision == "bf16" else None,
    )


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_trains_like_the_plain_model(stage: int, precision: str) -> None:
    check_parity(_gpt(), Block, GPT_BATCHES, gpt_loss, stage, precision, gpu())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_llama_trains_like_the_plain_model(stage: int, precision: str) -> None:
    pytest.importorskip("transformers")
    case = build_hf("llama")
    check_parity(case.model, case.block, HF_BATCHES, hf_loss, stage, precision, gpu())


def check_compile(device: torch.device) -> None:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    trains_like_plain(
        _gpt(), sgd, GPT_BATCHES, gpt_loss, device, atol=1e-4, auto_wrap=Block, compile=True
    )
    assert counters["stats"]["unique_graphs"] > 0, "nothing was compiled"


def test_compiled_units_train_like_the_eager_plain_model() -> None:
    check_compile(gpu())


def _greedy(model: nn.Module, device: torch.device) -> Tensor:
    model.eval()
    prompt = PROMPT.to(device)
    with torch.no_grad():
        return model.generate(
            input_ids=prompt,
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=6,
            min_new_tokens=6,
            do_sample=False,
            pad_token_id=0,
        )


def check_generate(device: torch.device) -> None:
    case = build_hf("llama")
    want = _greedy(copy.deepcopy(case.model).to(device), device)
    sharded = ShardedModule(copy.deepcopy(case.model), auto_wrap=case.block, device=device)
    got = _greedy(sharded, device)
    assert want.shape[1] == PROMPT.shape[1] + 6
    assert torch.equal(got, want), f"sharded {got.tolist()}, plain {want.tolist()}"


def test_greedy_generation_gives_the_plain_models_tokens() -> None:
    pytest.importorskip("transformers")
    check_generate(gpu())


def check_meta_init(device: torch.device) -> None:
    with torch.device("meta"):
        meta = GPT()
    torch.manual_seed(1234)
    sharded = ShardedModule(meta, auto_wrap=Block, device=device)
    assert all(p.device == device for p in sharded.parameters())
    start = sharded.full_state_dict()
    assert all(torch.isfinite(v).all() for v in start.values())
    for name, value in start.items():
        if "ln" in name:  # LayerNorm: weight 1, bias 0, exactly as plain construction
            assert torch.equal(value, torch.full_like(value, float(name.endswith("weight"))))
    plain = GPT()
    plain.load_state_dict(start)
    moved = on(device, gpt_loss)
    ref = train_reference(plain.to(device), sgd, GPT_BATCHES, moved)
    losses = train_steps(sharded, 0, 1, None, sgd, GPT_BATCHES, moved)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref.losses), atol=1e-5, rtol=0)
    torch.testing.assert_close(sharded.full_state_dict(), cpu(ref.state), atol=1e-5, rtol=0)


def test_a_model_built_on_meta_is_materialised_on_the_gpu_and_trains_like_plain() -> None:
    check_meta_init(gpu())


def test_cuda_without_an_index_is_the_current_gpu_and_trains_like_plain() -> None:
    m = trains_like_plain(_gpt(), sgd, GPT_BATCHES, gpt_loss, torch.device("cuda"), auto_wrap=Block)
    assert all(p.device == gpu() for p in m.parameters())


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_nccl_world_of_one_trains_like_the_plain_model(stage: int) -> None:
    with nccl_world():
        m = trains_like_plain(
            _gpt(), sgd, GPT_BATCHES, gpt_loss, gpu(), auto_wrap=Block, stage=stage
        )
        assert m._shardwrap_root.mesh.shard is not None  # sharded over the NCCL group


def check_muon(device: torch.device, **wrap: Any) -> None:
    """Muon's matrices stepped whole on their owner, against the same Muon on the plain model;
    within 1e-4: its bf16 Newton-Schulz iteration amplifies rounding."""
    model = _gpt()
    ref = train_reference(model.to(device), MuonAndAdamW, GPT_BATCHES, on(device, gpt_loss))
    sharded = ShardedModule(copy.deepcopy(model), auto_wrap=Block, device=device, **wrap)
    train_steps(sharded, 0, 1, None, MuonAndAdamW, GPT_BATCHES, on(device, gpt_loss))
    torch.testing.assert_close(sharded.full_state_dict(), cpu(ref.state), atol=1e-4, rtol=0)


def test_nccl_world_of_one_steps_muon_whole_like_the_plain_model() -> None:
    with nccl_world():
        check_muon(gpu())
