"""The parity loop the tests share: train a plain reference on the whole global batch and a
``ShardedModule`` copy on every rank, each on its slice, and compare.

- SGD with momentum: every parameter (``full_state_dict()``) equals the reference's within 1e-5;
- AdamW: the global loss of every step equals the reference's within 1e-5.

Also the batches, losses and builders of the GPT and Hugging Face cases, greedy decoding, and
``train_recipe``: plain mixed precision by hand, the reference for bf16 runs.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, HF_VOCAB, make_batch, tiny_gpt2_config, tiny_llama_config
from tests.support.ranks import run_ranks

Batch = tuple[Tensor, Tensor]  # (inputs, targets), global batch first
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
Finish = Callable[[nn.Module], Any]

STEPS = 4
GLOBAL_BATCH = 8  # divisible by every world size tested


def fp32_grads(model: nn.Module) -> nn.Module:
    """``model`` with float32 as every parameter's ``grad_dtype`` (torch's ``Tensor.grad_dtype``;
    a deep copy drops it, so set it on each copy)."""
    for p in model.parameters():
        p.grad_dtype = torch.float32
    return model


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def fused_sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def fused_adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3, fused=True)


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


CLIP_NORM = 0.05  # below every step's gradient norm in ``train_clipped``: each step clips


def train_clipped(
    m: nn.Module, rank: int, world: int, device: torch.device | str = "cpu"
) -> tuple[list[float], torch.optim.Optimizer]:
    """AdamW over 3 steps, each on this rank's slice (of ``world``) of 8 rows of width 8, the
    loss the outputs' mean square, the gradients clipped to ``CLIP_NORM`` by their global norm.
    Returns each step's norm and the optimizer."""
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=0.01)
    norms = []
    g = torch.Generator().manual_seed(1)
    for x in [torch.randn(8, 8, generator=g) for _ in range(3)]:
        m(x.chunk(world)[rank].to(device)).square().mean().backward()
        norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), CLIP_NORM).item())
        opt.step()
        opt.zero_grad()
    return norms, opt


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


# tests.support.models.GPT --------------------------------------------------------------

GPT_BATCHES = [make_batch(seed=step, batch=GLOBAL_BATCH) for step in range(STEPS)]


def slice_summed_grads(
    model: nn.Module,
    loss: Callable[[nn.Module, Tensor, Tensor], Tensor],
    inputs: Tensor,
    targets: Tensor,
    world: int,
) -> Tensor:
    """Give each parameter of the unwrapped ``model`` the global batch's gradient as shardwrap's
    reductions add it: summed over ``world`` slices of the batch in rank order, then averaged
    (one backward over the whole batch differs in the last bits, which block-quantized state or
    Muon's bf16 iteration turn into other values). Returns the slices' mean loss."""
    grads = [torch.zeros_like(p) for p in model.parameters()]
    total = torch.zeros(())
    for x, y in zip(inputs.chunk(world), targets.chunk(world)):
        value = loss(model, x, y)
        value.backward()
        total += value.detach()
        for g, p in zip(grads, model.parameters()):
            if p.grad is not None:
                g.add_(p.grad)
                p.grad = None
    for g, p in zip(grads, model.parameters()):
        p.grad = g / world
    return total / world


def gpt_loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return model(inputs, targets)


def build_gpt(tied: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(tied=tied)


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


# mixed precision by hand ---------------------------------------------------------------


def train_recipe(
    model: nn.Module,
    world_size: int,
    dtype: torch.dtype,
    batches: list = GPT_BATCHES,
    make_optimizer: MakeOptimizer = sgd,
    loss_fn: LossFn = gpt_loss,
    cast_buffers: bool = True,
) -> tuple[list, dict]:
    """Plain mixed precision: fp32 masters, a ``dtype`` copy per rank slice, fp32 mean grads.

    With ``dtype=torch.float32`` this is the unwrapped model trained on each global batch by
    gradient accumulation over the ranks' slices: the ranks' own summation order, for
    optimizers whose step amplifies rounding (Muon's bf16 Newton-Schulz iteration). With
    ``cast_buffers=False`` only the parameters are cast, as ``MixedPrecision`` casts them (a
    Llama's rotary frequencies stay float32).
    """
    master = copy.deepcopy(model)
    work = copy.deepcopy(model)
    # floating-point tensors only, as MixedPrecision casts (``Module.to`` casts complex ones too)
    for t in [*work.parameters(), *(work.buffers() if cast_buffers else [])]:
        if t.is_floating_point():
            t.data = t.data.to(dtype)
    optimizer = make_optimizer(p for p in master.parameters() if p.requires_grad)
    losses = []
    for inputs, targets in batches:
        grads: list[Tensor] = [torch.zeros_like(p) for p in master.parameters()]
        step_loss = 0.0
        for x, y in zip(inputs.chunk(world_size), targets.chunk(world_size)):
            with torch.no_grad():
                for w, m in zip(work.parameters(), master.parameters()):
                    w.copy_(m)
            loss = loss_fn(work, x, y)
            loss.backward()
            step_loss += loss.float().item() / world_size
            for g, w in zip(grads, work.parameters()):
                if w.grad is not None:  # in float32 (a complex gradient: complex64)
                    g.add_(w.grad.to(torch.promote_types(w.grad.dtype, torch.float32)))
                    w.grad = None
        for m, g in zip(master.parameters(), grads):
            m.grad = g / world_size if m.requires_grad else None
        optimizer.step()
        optimizer.zero_grad()
        losses.append(step_loss)
    return losses, {k: v.detach().clone() for k, v in master.state_dict().items()}
