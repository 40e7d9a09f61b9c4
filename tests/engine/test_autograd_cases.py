"""Parity in the autograd situations users meet: tied, frozen, skipped and reused modules,
no-grad and inference-mode decoding, gradient accumulation, non-None zeroed gradients and buffers.

Every case trains a sharded model (ranks as threads, each on its slice of the global batch)
and a deep-copied plain reference side by side with SGD with momentum, then checks that the
full parameters agree within 1e-5, plus the case's own invariant (where a tied parameter
lives, which collectives ran, which gradients exist, which units are resharded).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_autograd_cases.py -q``
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.nn.utils import prune

from shardwrap import ShardedModule
from shardwrap.engine.shards.unit import ShardState
from tests.support.models import (
    GPT,
    Block,
    Branch,
    Branchy,
    FrozenPart,
    LoRALinear,
    WithBatchNorm,
    make_batch,
)
from tests.support.ranks import run_ranks

VOCAB = 67
LR, MOMENTUM = 0.1, 0.9
ATOL = 1e-5


def _shard(model: nn.Module, pg: ProcessGroup, **kwargs: object) -> ShardedModule:
    """Wrap ``model``; world size 1 takes the no-process-group path."""
    return ShardedModule(model, process_group=pg if pg.size() > 1 else None, **kwargs)


def _sgd(model: nn.Module) -> torch.optim.SGD:
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _assert_close(got: dict[str, Tensor], want: dict[str, Tensor]) -> None:
    """Every entry of ``want`` is in ``got`` and equal within ``ATOL``."""
    assert set(want) <= set(got), f"missing {set(want) - set(got)}"
    for name in want:
        torch.testing.assert_close(
            got[name], want[name], rtol=0, atol=ATOL, msg=lambda m, n=name: f"{n}: {m}"
        )


def _gpt_batches(steps: int, seed: int, context: int = 8) -> list[tuple[Tensor, Tensor]]:
    """One global batch of 8 sequences (two per rank at world size 4) per step."""
    return [make_batch(seed + s, 8, context, VOCAB) for s in range(steps)]


def _slice(t: Tensor, rank: int, world: int) -> Tensor:
    return t.chunk(world)[rank]


# tied parameters ---------------------------------------------------------------------


class Wrapper(nn.Module):
    """A tied GPT one level down, so the lowest common ancestor of the tie is not the root."""

    def __init__(self) -> None:
        super().__init__()
        self.gpt = GPT(vocab=VOCAB, depth=2, context=8, tied=True)
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, idx: Tensor, targets: Tensor) -> Tensor:
        return self.gpt(idx, targets) * self.scale


def _tie_policy(module: nn.Module) -> bool:
    """Embedding and head become two different units (plus the GPT itself and its blocks)."""
    return (
        isinstance(module, (GPT, Block))
        or (isinstance(module, nn.Embedding) and module.num_embeddings == VOCAB)
        or (isinstance(module, nn.Linear) and module.out_features == VOCAB)
    )


@pytest.mark.parametrize("nested", [False, True], ids=["lca_root", "lca_inner"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_tied_parameter_across_units_lives_in_lca_and_sums_grads(
    world_size: int, nested: bool
) -> None:
    """Embedding and head in two units: the weight lives once, in their LCA; grads sum."""
    torch.manual_seed(0)
    model = Wrapper() if nested else GPT(vocab=VOCAB, depth=2, context=8, tied=True)
    batches = _gpt_batches(3, seed=10)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=_tie_policy)
        gpt = m.gpt if nested else m
        tied = gpt.wte._parameters["weight"]
        assert gpt.lm_head._parameters["weight"] is tied
        units = m._shardwrap_root.units
        holders = [u for u in units if any(p is tied for g in u.groups for p in g.shard_params)]
        assert [u.module for u in holders] == [gpt]  # exactly one unit: the LCA
        for use in (gpt.wte, gpt.lm_head):  # each use is a unit of its own
            assert any(u.module is use for u in units)
        opt = _sgd(m)
        for idx, targets in batches:
            opt.zero_grad()
            m(_slice(idx, rank, world_size), _slice(targets, rank, world_size)).backward()
            opt.step()
        return m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for idx, targets in batches:
        opt.zero_grad()
        ref(idx, targets).backward()
        opt.step()
    want = ref.state_dict()
    for got in run_ranks(world_size, fn, timeout=30.0):
        _assert_close(got, want)


# frozen parameters -------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_frozen_parameters_get_no_grad_no_buffer_no_reduction(world_size: int) -> None:
    """Frozen groups (a whole module, and half of a LoRA layer) never produce gradients."""
    torch.manual_seed(1)
    model = FrozenPart()
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert frozen == ["embed.weight", "adapter.base.weight", "adapter.base.bias"]
    steps = 3
    batches = [make_batch(20 + s, 8, 8, vocab=29) for s in range(steps)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=LoRALinear)
        groups = [g for u in m._shardwrap_root.units for g in u.groups]
        adapter = next(u for u in m._shardwrap_root.units if u.module is m.adapter)
        assert sorted(g.requires_grad for g in adapter.groups) == [False, True]  # mixed module
        trainable = [g for g in groups if g.requires_grad]
        frozen_groups = [g for g in groups if not g.requires_grad]
        assert len(trainable) == 2 and len(frozen_groups) == 2
        named = dict(m.named_parameters())
        assert all(not named[n].requires_grad for n in frozen)
        opt = _sgd(m)
        for idx, targets in batches:
            opt.zero_grad()
            m(_slice(idx, rank, world_size), _slice(targets, rank, world_size)).backward()
            for g in frozen_groups:
                assert g.full.grad is None and g.shard_grads.flat is None
                assert all(p.grad is None for p in g.shard_params)
            for n in frozen:
                assert named[n].grad is None, n
            for g in trainable:
                assert all(p.grad is not None for p in g.shard_params if p.numel())
            opt.step()
        # every trainable flat gradient is reduced each step, and nothing else is
        reduced = sum(g.layout.padded_numel * g.grad_dtype.itemsize for g in trainable)
        assert m.comm_stats.bytes["reduce_scatter"] == reduced * steps
        return m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for idx, targets in batches:
        opt.zero_grad()
        ref(idx, targets).backward()
        opt.step()
    initial = model.state_dict()
    for got in run_ranks(world_size, fn, timeout=30.0):
        _assert_close(got, ref.state_dict())
        for n in frozen:
            assert torch.equal(got[n], initial[n]), f"frozen {n} changed"


# modules some ranks skip, and a module called twice -----------------------------------


def _branchy_data(world: int, plan: list[list[bool]], seed: int) -> list[tuple[Tensor, Tensor]]:
    """Per step a global batch whose rank slice sums to > 0 exactly where ``plan`` says so."""
    generator = torch.Generator().manual_seed(seed)
    data = []
    for runs in plan:
        x = torch.randn(world, 3, 11, generator=generator)
        for r, run in enumerate(runs):
            if bool(x[r].sum() > 0) != run:
                x[r] = -x[r]
        data.append((x.reshape(world * 3, 11), torch.randn(world * 3, generator=generator)))
    return data


def _train_branchy_reference(
    model: nn.Module, data: list[tuple[Tensor, Tensor]], world: int, set_to_none: bool
) -> dict[str, Tensor]:
    """The branch condition is per call: run each rank's slice separately, average losses."""
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for x, y in data:
        opt.zero_grad(set_to_none=set_to_none)
        losses = [
            F.mse_loss(ref(xs), ys) for xs, ys in zip(x.chunk(world), y.chunk(world), strict=True)
        ]
        torch.stack(losses).mean().backward()
        opt.step()
    return ref.state_dict()


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]

    def hook(mod: nn.Module, args: object, output: object) -> None:
        calls[0] += 1

    module.register_forward_hook(hook)
    return calls


@pytest.mark.parametrize("read", [False, True], ids=["", "full_state_dict_each_step"])
@pytest.mark.parametrize("set_to_none", [True, False], ids=["grad_none", "grad_zeroed"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_branch_run_by_some_ranks_all_or_none(
    world_size: int, set_to_none: bool, read: bool
) -> None:
    """Steps where some, none and all ranks run ``branch``: no hang, plain-PyTorch updates.

    With ``set_to_none`` a step no rank ran leaves the branch's gradients ``None`` and its
    parameters untouched; with zeroed gradients momentum still moves them, as in PyTorch.
    ``full_state_dict()`` after each step (logging, an average) changes nothing: at stages 1
    and 2 it had taken a rank's part in a peer's gather of the branch it skipped, still in
    flight over the optimizer step, for the stepped values, and the rank's next use of the
    branch computed with the values before the step.
    """
    plan = [
        [r % 2 == 0 for r in range(world_size)],  # rank 0 runs the branch, rank 1 skips it
        [False] * world_size,  # every rank skips it
        [True] * world_size,  # every rank runs it
        [r % 2 == 1 for r in range(world_size)],
    ]
    data = _branchy_data(world_size, plan, seed=2)
    assert [[bool(c.sum() > 0) for c in x.chunk(world_size)] for x, _ in data] == plan
    torch.manual_seed(2)
    model = Branchy()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[int]]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Branch)
        calls = _count_calls(m.branch)
        ran = []
        opt = _sgd(m)
        for (x, y), runs in zip(data, plan, strict=True):
            opt.zero_grad(set_to_none=set_to_none)
            before = [p.detach().clone() for p in m.branch.parameters()]
            calls[0] = 0
            F.mse_loss(m(_slice(x, rank, world_size)), _slice(y, rank, world_size)).backward()
            ran.append(calls[0])
            opt.step()
            if read:
                m.full_state_dict()
            if set_to_none and not any(runs):  # no rank used it: plain PyTorch skips it
                assert all(p.grad is None for p in m.branch.parameters())
                assert all(
                    torch.equal(a, p) for a, p in zip(before, m.branch.parameters(), strict=True)
                )
        return m.full_state_dict(), ran

    want = _train_branchy_reference(model, data, world_size, set_to_none)
    for rank, (got, ran) in enumerate(run_ranks(world_size, fn, timeout=30.0)):
        assert ran == [int(runs[rank]) for runs in plan]
        _assert_close(got, want)


@pytest.mark.parametrize(
    "reshard_after_forward", [None, pytest.param(False, marks=pytest.mark.stage3)]
)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_module_called_twice_in_one_forward(
    world_size: int, reshard_after_forward: bool | None
) -> None:
    """``shared_block`` runs twice per forward; both uses' gradients reach its shard."""
    plan = [[True] * world_size, [r % 2 == 0 for r in range(world_size)], [True] * world_size]
    data = _branchy_data(world_size, plan, seed=3)
    torch.manual_seed(3)
    model = Branchy()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[int]]:
        m = _shard(
            copy.deepcopy(model), pg, auto_wrap=Branch, reshard_after_forward=reshard_after_forward
        )
        calls = _count_calls(m.shared_block)
        ran = []
        opt = _sgd(m)
        for x, y in data:
            opt.zero_grad()
            calls[0] = 0
            F.mse_loss(m(_slice(x, rank, world_size)), _slice(y, rank, world_size)).backward()
            ran.append(calls[0])
            opt.step()
        return m.full_state_dict(), ran

    want = _train_branchy_reference(model, data, world_size, set_to_none=True)
    for got, ran in run_ranks(world_size, fn, timeout=30.0):
        assert ran == [2] * len(plan)
        _assert_close(got, want)


# eval + no_grad decoding -------------------------------------------------------------


GradOff = Callable[[], AbstractContextManager[object]]  # torch.no_grad, torch.inference_mode


def _decode(
    model: nn.Module, prompt: Tensor, steps: int, grad_off: GradOff = torch.no_grad
) -> tuple[Tensor, Tensor]:
    """Greedy decoding in eval mode, under ``grad_off()``: ``steps`` forwards, each on the whole
    sequence so far.

    Returns:
        The tokens ``(B, T + steps)`` and the last forward's logits, which expose any stale
        parameter that happens not to flip an argmax.
    """
    model.eval()
    idx = prompt
    with grad_off():
        for _ in range(steps):
            logits = model(idx)
            assert not logits.requires_grad
            idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    model.train()
    return idx.clone(), logits.clone()  # plain tensors, also from inference mode


@pytest.mark.parametrize("grad_off", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_greedy_decoding_between_training_steps(world_size: int, grad_off: GradOff) -> None:
    """Train, decode, backward, decode, step, decode, train: decodes and parameters agree.

    The first decode is 30 forwards long. The decode between backward and step leaves the root
    gathered; the step then changes its shard, so the next decode must not reuse the stale
    gathered buffer (a few forwards each suffice there). Under ``torch.inference_mode()`` the
    buffers a decode first gathers into are kept for training's gathers (before: "Inplace
    update to inference tensor outside InferenceMode" at the next training forward).
    """
    lengths = [30, 4, 4]
    torch.manual_seed(4)
    model = GPT(vocab=VOCAB, depth=2, context=32)
    batches = _gpt_batches(3, seed=40, context=16)
    prompts = torch.randint(VOCAB, (world_size, 2, 2), generator=torch.Generator().manual_seed(4))

    def train(
        model: nn.Module,
        opt: torch.optim.Optimizer,
        batch: tuple[Tensor, Tensor],
        rank: int | None,
        between: Callable[[], None] = lambda: None,
    ) -> None:
        idx, targets = batch
        if rank is not None:
            idx, targets = _slice(idx, rank, world_size), _slice(targets, rank, world_size)
        opt.zero_grad()
        model(idx, targets).backward()
        between()
        opt.step()

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[tuple[Tensor, Tensor]], dict[str, Tensor]]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Block)
        root = m._shardwrap_root
        opt = _sgd(m)
        decoded = []

        def decode() -> None:
            grads = [None if p.grad is None else p.grad.clone() for p in m.parameters()]
            reductions = root.stats.calls.get("reduce_scatter", 0)
            decoded.append(_decode(m, prompts[rank], lengths[len(decoded)], grad_off))
            assert root.stats.calls.get("reduce_scatter", 0) == reductions  # no backward ran
            for g, p in zip(grads, m.parameters(), strict=True):
                assert (g is None and p.grad is None) or torch.equal(g, p.grad)
            if root.strategy.stage == 3:
                assert all(u.state is ShardState.SHARDED for u in root.units[1:])

        train(m, opt, batches[0], rank)
        decode()
        train(m, opt, batches[1], rank, between=decode)
        decode()
        train(m, opt, batches[2], rank)
        return decoded, m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    want: list[list[tuple[Tensor, Tensor]]] = [[] for _ in range(world_size)]

    def ref_decode() -> None:
        steps = lengths[len(want[0])]
        for r in range(world_size):
            want[r].append(_decode(ref, prompts[r], steps, grad_off))

    train(ref, opt, batches[0], None)
    ref_decode()
    train(ref, opt, batches[1], None, between=ref_decode)
    ref_decode()
    train(ref, opt, batches[2], None)
    for rank, (decoded, got) in enumerate(run_ranks(world_size, fn, timeout=30.0)):
        assert [tokens.shape for tokens, _ in decoded] == [(2, 2 + n) for n in lengths]
        for (tokens, logits), (want_tokens, want_logits) in zip(decoded, want[rank], strict=True):
            assert torch.equal(tokens, want_tokens)
            torch.testing.assert_close(logits, want_logits, rtol=0, atol=ATOL)
        _assert_close(got, ref.state_dict())


# gradient accumulation and zeroed (not None) gradients -------------------------------


@pytest.mark.parametrize("mode", ["accumulate", "no_sync"])
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_gradient_accumulation(world_size: int, mode: str) -> None:
    """Several micro-batches per step, reduced each time or (``no_sync``) only at the last."""
    torch.manual_seed(5)
    model = GPT(vocab=VOCAB, depth=2, context=8)
    steps, micro = 2, 3
    batches = [_gpt_batches(micro, seed=50 + 10 * s) for s in range(steps)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Block)
        stats = m.comm_stats
        groups = [g for u in m._shardwrap_root.units for g in u.trainable]
        trainable = sum(g.layout.padded_numel * g.grad_dtype.itemsize for g in groups)
        opt = _sgd(m)
        for micro_batches in batches:
            opt.zero_grad()
            for i, (idx, targets) in enumerate(micro_batches):
                idx, targets = _slice(idx, rank, world_size), _slice(targets, rank, world_size)
                reduced = stats.bytes.get("reduce_scatter", 0)
                if mode == "no_sync" and i < micro - 1:
                    with m.no_sync():
                        (m(idx, targets) / micro).backward()
                    assert stats.bytes.get("reduce_scatter", 0) == reduced
                    # zeros, not None: a zero_grad() now would drop what was accumulated
                    assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
                else:  # every flat gradient reduced
                    (m(idx, targets) / micro).backward()
                    assert stats.bytes["reduce_scatter"] == reduced + trainable
            opt.step()
        return m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for micro_batches in batches:
        opt.zero_grad()
        for idx, targets in micro_batches:
            (ref(idx, targets) / micro).backward()
        opt.step()
    for got in run_ranks(world_size, fn, timeout=30.0):
        _assert_close(got, ref.state_dict())


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_zero_grad_without_set_to_none(world_size: int) -> None:
    """Zeroed (not ``None``) shard gradients accumulate the next step's reduction."""
    torch.manual_seed(6)
    model = GPT(vocab=VOCAB, depth=2, context=8)
    batches = _gpt_batches(3, seed=60)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Block)
        opt = _sgd(m)
        for step, (idx, targets) in enumerate(batches):
            opt.zero_grad(set_to_none=False)
            if step:
                assert all(p.grad is not None and not p.grad.any() for p in m.parameters())
            m(_slice(idx, rank, world_size), _slice(targets, rank, world_size)).backward()
            opt.step()
        return m.full_state_dict()

    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for idx, targets in batches:
        opt.zero_grad(set_to_none=False)
        ref(idx, targets).backward()
        opt.step()
    for got in run_ranks(world_size, fn, timeout=30.0):
        _assert_close(got, ref.state_dict())


# buffers -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_batchnorm_buffers_stay_full_and_become_rank_zeros_after_each_step(world_size: int) -> None:
    """Running statistics are whole on every rank, each updated from its own batch (BatchNorm
    without sync), and at the end of each step's backward every rank takes rank 0's, as DDP
    copies rank 0's buffers before the next forward: an evaluation then runs on every rank the
    model rank 0 saves. Parameters are global.

    The reference runs each rank's slice separately and averages the losses; before each
    slice it swaps in that rank's running statistics, so it tracks both at once (in training
    mode BatchNorm's output does not depend on its running statistics), and after each step
    every rank's statistics become a copy of rank 0's.
    """
    torch.manual_seed(7)
    model = WithBatchNorm()
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randn(3, world_size * 4, 13, generator=generator)
    labels = torch.randint(5, (3, world_size * 4), generator=generator)
    data = list(zip(inputs, labels, strict=True))
    probe = torch.randn(world_size * 3, 13, generator=generator)

    def fn(
        rank: int, pg: ProcessGroup
    ) -> tuple[dict[str, Tensor], list[dict[str, Tensor]], Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=nn.BatchNorm1d)
        bn = m.net[1]
        assert any(u.module is bn for u in m._shardwrap_root.units)
        names = {n for u in m._shardwrap_root.units for g in u.groups for n in g.names}
        assert not names & {n for n, _ in m.named_buffers()}
        opt = _sgd(m)
        after_forward = []
        for x, y in data:
            opt.zero_grad()
            loss = F.cross_entropy(m(_slice(x, rank, world_size)), _slice(y, rank, world_size))
            after_forward.append({n: b.clone() for n, b in m.named_buffers()})
            loss.backward()
            opt.step()
        assert bn.running_mean.shape == bn.running_var.shape == (22,)
        m.eval()
        with torch.no_grad():
            out = m(_slice(probe, rank, world_size))
        return m.full_state_dict(), after_forward, out

    ref = copy.deepcopy(model)
    local = [{n: b.clone() for n, b in ref.named_buffers()} for _ in range(world_size)]

    def swap_in(rank: int) -> None:
        """Point the reference's buffers at ``rank``'s, which its forward then updates."""
        for name, buffer in local[rank].items():
            owner, _, attr = name.rpartition(".")
            ref.get_submodule(owner)._buffers[attr] = buffer

    opt = _sgd(ref)
    expected_after_forward: list[list[dict[str, Tensor]]] = []
    for x, y in data:
        opt.zero_grad()
        losses = []
        for r, (xs, ys) in enumerate(zip(x.chunk(world_size), y.chunk(world_size), strict=True)):
            swap_in(r)
            losses.append(F.cross_entropy(ref(xs), ys))
        expected_after_forward.append([{n: b.clone() for n, b in c.items()} for c in local])
        torch.stack(losses).mean().backward()
        opt.step()
        local = [{n: b.clone() for n, b in local[0].items()} for _ in range(world_size)]
    params = {n: p.detach() for n, p in ref.named_parameters()}
    ref.eval()
    swap_in(0)
    for rank, (got, after_forward, out) in enumerate(run_ranks(world_size, fn, timeout=30.0)):
        _assert_close(got, params)
        for step, buffers in enumerate(after_forward):  # each rank's own, until the backward
            _assert_close(buffers, expected_after_forward[step][rank])
        assert got["net.1.num_batches_tracked"] == len(data)
        _assert_close(got, local[0])  # the state dict carries rank 0's statistics
        with torch.no_grad():
            torch.testing.assert_close(out, ref(_slice(probe, rank, world_size)), rtol=0, atol=ATOL)
    if world_size > 1:  # the ranks' own statistics differed: the copy is what made them agree
        first, second = expected_after_forward[-1][:2]
        assert (first["net.1.running_mean"] - second["net.1.running_mean"]).abs().max() > 1e-3


@pytest.mark.parametrize("world_size", [1, 2])
def test_gradients_with_respect_to_inputs_and_not_parameters(world_size: int) -> None:
    """``torch.autograd.grad(loss, x)`` and ``loss.backward(inputs=[x])`` give each rank the
    plain model's gradient of its slice's input and leave the parameters' ``.grad`` ``None``;
    the next plain backward and step train as the plain model. A gradient with respect to the
    parameters (the shard parameters, in no graph of the model's) is refused naming
    ``loss.backward()``: ``autograd.grad`` would say only that they are unused, or with
    ``allow_unused`` / ``materialize_grads`` answer ``None`` / zeros for every one, and
    ``backward(inputs=...)`` would leave their ``.grad`` as it was. A graph built on a piece
    itself is differentiated as usual."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)

    def loss_of(m: nn.Module, xs: Tensor, ys: Tensor) -> Tensor:
        return F.mse_loss(m(xs), ys)

    ref = copy.deepcopy(model)
    want = [
        torch.autograd.grad(loss_of(ref, xs.requires_grad_(True), ys), xs)[0]
        for xs, ys in zip(x.clone().chunk(world_size), y.chunk(world_size))
    ]
    opt = _sgd(ref)
    loss_of(ref, x, y).backward()
    opt.step()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg)
        xs, ys = _slice(x, rank, world_size), _slice(y, rank, world_size)
        inp = xs.clone().requires_grad_(True)
        (got,) = torch.autograd.grad(loss_of(m, inp, ys), inp)
        torch.testing.assert_close(got, want[rank], atol=ATOL, rtol=0)
        inp = xs.clone().requires_grad_(True)
        loss_of(m, inp, ys).backward(inputs=[inp])
        torch.testing.assert_close(inp.grad, want[rank], atol=ATOL, rtol=0)
        assert all(p.grad is None for p in m.parameters())
        fix = r"no graph holds a piece\. Call loss\.backward\(\)"
        for lenient in ({}, {"allow_unused": True}, {"materialize_grads": True}):
            # where torch would answer None or zeros for every parameter, refused too
            with pytest.raises(RuntimeError, match=r"autograd\.grad with respect to 0\.weight"):
                torch.autograd.grad(loss_of(m, xs, ys), list(m.parameters()), **lenient)
        inp = xs.clone().requires_grad_(True)
        unused = torch.ones(3, requires_grad=True)  # and materialized as torch does
        got = torch.autograd.grad(loss_of(m, inp, ys), [inp, unused], materialize_grads=True)
        torch.testing.assert_close(got, (want[rank], torch.zeros(3)), atol=ATOL, rtol=0)
        with pytest.raises(RuntimeError, match=fix):
            loss_of(m, xs, ys).backward(inputs=list(m.parameters()))
        assert all(p.grad is None for p in m.parameters())
        piece = next(m.parameters())
        (of_piece,) = torch.autograd.grad(piece.square().sum(), piece)
        torch.testing.assert_close(of_piece, 2 * piece.detach(), atol=0, rtol=0)
        opt = _sgd(m)
        loss_of(m, xs, ys).backward()
        opt.step()
        return m.full_state_dict()

    for got in run_ranks(world_size, fn):
        _assert_close(got, ref.state_dict())


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_transform_that_refuses_saved_tensor_hooks_is_refused_and_training_goes_on(
    world_size: int,
) -> None:
    """``torch.func.grad`` (and ``vmap`` over it, or over a forward with gradients: torch's
    bare ``setup_context`` error before) and a forward under
    ``disable_saved_tensors_hooks`` refuse the saved-tensor hooks a sharded model keeps its
    gathered parameters' saved views with: each raises shardwrap's error naming the ways to
    take gradients, and the model is left as it was, so the plain steps that follow train as
    the plain model (before: torch's error, then an internal assert failure at every later
    forward, the hooks of the failed call left half registered)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for _ in range(2):
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    fix = r"refused .*Take gradients with loss\.backward\(\), or torch\.autograd\.grad"

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=nn.Linear)
        xs, ys = _slice(x, rank, world_size), _slice(y, rank, world_size)
        opt = _sgd(m)
        for _ in range(2):
            with pytest.raises(RuntimeError, match=fix):
                torch.func.grad(lambda inp: m(inp).sum())(xs)
            with pytest.raises(RuntimeError, match=fix):
                torch.func.vmap(torch.func.grad(lambda row: m(row).sum()))(xs)
            with pytest.raises(RuntimeError, match=fix):
                torch.func.vmap(lambda row: m(row.unsqueeze(0)))(xs)
            with torch.no_grad():
                torch.testing.assert_close(
                    torch.func.vmap(lambda row: m(row.unsqueeze(0)))(xs).squeeze(1), m(xs)
                )
            with torch.autograd.graph.disable_saved_tensors_hooks("not here"):
                with pytest.raises(RuntimeError, match=r"refused \(not here\)"):
                    m(xs)
            F.mse_loss(m(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for got in run_ranks(world_size, fn):
        _assert_close(got, ref.state_dict())


def _rounding_hooks(skip: set[int], calls: list[int]) -> Any:
    """Saved-tensor hooks that keep each floating tensor in bf16 (lossy, as activation
    compression is), counting their packs; tensors over the storages in ``skip`` (the plain
    model's parameters) pass as they are."""

    def pack(t: Tensor) -> Any:
        if t.untyped_storage().data_ptr() in skip or not t.is_floating_point():
            return t
        calls.append(1)
        return t.dtype, t.detach().to(torch.bfloat16)

    def unpack(packed: Any) -> Tensor:
        return packed if isinstance(packed, Tensor) else packed[1].to(packed[0])

    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


@pytest.mark.parametrize("world_size", [1, 2])
def test_saved_tensor_hooks_around_the_forward_see_what_they_see_on_the_plain_model(
    world_size: int,
) -> None:
    """The user's saved-tensor hooks around the forward (``save_on_cpu()``, or activation
    compression, here to bf16) pack every tensor autograd saves as they do on the plain
    model, but the gathered parameters, which shardwrap keeps by address: as many calls, and
    the weights of the plain model trained with the hooks on its tensors but its parameters.
    They had never been called: shardwrap's hooks, pushed inside them at the root's call,
    hid them, and the model trained as without them."""
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, depth=2, context=8)
    batches = _gpt_batches(3, seed=40)
    ref = copy.deepcopy(model)
    skip = {p.untyped_storage().data_ptr() for p in ref.parameters()}
    want: list[int] = []
    opt = _sgd(ref)
    for x, y in batches:
        with _rounding_hooks(skip, want):
            loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], int]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Block)
        calls: list[int] = []
        opt = _sgd(m)
        for x, y in batches:
            with _rounding_hooks(set(), calls):
                loss = m(_slice(x, rank, world_size), _slice(y, rank, world_size))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict(), len(calls)

    for got, calls in run_ranks(world_size, fn):
        assert calls == len(want)
        _assert_close(got, ref.state_dict())


def test_a_saved_tensor_hook_that_is_a_method_of_torchs_is_taken_as_any() -> None:
    """A pack hook that is one of torch's own methods (``Tensor.clone``, which has no
    ``__module__``) is handed what autograd saves, as a function is, and the model trains as
    the plain model under it (before: the forward raised ``AttributeError``)."""
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, depth=2, context=8)
    batches = _gpt_batches(2, seed=60)
    trained = []
    for m in (copy.deepcopy(model), ShardedModule(copy.deepcopy(model), auto_wrap=Block)):
        opt = _sgd(m)
        for x, y in batches:
            with torch.autograd.graph.saved_tensors_hooks(Tensor.clone, Tensor.clone):
                loss = m(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
        trained.append(m)
    ref, sharded = trained
    _assert_close(sharded.full_state_dict(), ref.state_dict())


@pytest.mark.parametrize("world_size", [1, 2])
def test_checkpoint_around_the_whole_model_trains_as_the_plain_model(world_size: int) -> None:
    """``torch.utils.checkpoint.checkpoint(model, ...)`` (non-reentrant) around the whole
    sharded model: its saved-tensor hooks enclose the root's call but are handed nothing
    (its recomputation would save the gathered parameters' views, which the forward had
    kept by address), and the model trains as the plain model does under it."""
    torch.manual_seed(0)
    model = GPT(vocab=VOCAB, depth=2, context=8)
    batches = _gpt_batches(3, seed=50)
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    for x, y in batches:
        torch.utils.checkpoint.checkpoint(ref, x, y, use_reentrant=False).backward()
        opt.step()
        opt.zero_grad()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=Block)
        opt = _sgd(m)
        for x, y in batches:
            xs, ys = _slice(x, rank, world_size), _slice(y, rank, world_size)
            torch.utils.checkpoint.checkpoint(m, xs, ys, use_reentrant=False).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for got in run_ranks(world_size, fn):
        _assert_close(got, ref.state_dict())


@pytest.mark.parametrize("world_size", [1, 2])
def test_forward_mode_transforms_without_gradients_run_as_on_the_plain_model(
    world_size: int,
) -> None:
    """``torch.func.jvp`` and ``jacfwd`` of a forward under ``torch.no_grad()`` give the plain
    model's outputs, tangents and Jacobian of the rank's slice, and the model trains on as the
    plain model: the gathers run outside the transform, and the full parameters are constants
    to it, as the plain model's are (before: an internal error, "Cannot access data pointer of
    Tensor that doesn't have storage", from the pool or the exchange, at every stage on 2
    ranks, and every later forward garbage at stages 1 and 2). torch's forward-AD levels are
    process-wide, so no two rank threads may be inside ``jvp`` at once: the ranks take turns,
    the others running the same forwards plainly meanwhile, and wait for each other between
    turns."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    want = []
    for _ in range(2):
        with torch.no_grad():
            tangents = [
                torch.func.jvp(ref, (xs,), (torch.ones_like(xs),)) for xs in x.chunk(world_size)
            ]
            jacobians = [torch.func.jacfwd(ref)(xs) for xs in x.chunk(world_size)]
            want.append([(*t, j) for t, j in zip(tangents, jacobians)])
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    turns = threading.Barrier(world_size)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=nn.Linear)
        xs, ys = _slice(x, rank, world_size), _slice(y, rank, world_size)
        opt = _sgd(m)
        for step in range(2):
            for turn in range(world_size):
                with torch.no_grad():
                    if turn == rank:
                        got = (
                            *torch.func.jvp(m, (xs,), (torch.ones_like(xs),)),
                            torch.func.jacfwd(m)(xs),
                        )
                        torch.testing.assert_close(got, want[step][rank], atol=ATOL, rtol=0)
                    else:
                        m(xs), m(xs)
                turns.wait(timeout=10.0)
            F.mse_loss(m(xs), ys).backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for got in run_ranks(world_size, fn, timeout=20.0):
        _assert_close(got, ref.state_dict())


# torch.func.functional_call -------------------------------------------------------------


def _train_on(m: nn.Module, data: list[Tensor], world: int, rank: int) -> None:
    """SGD steps on each rank's slice of each global batch, the loss a mean of squares."""
    opt = _sgd(m)
    for xs in data:
        opt.zero_grad()
        m(_slice(xs, rank, world)).square().mean().backward()
        opt.step()


@pytest.mark.parametrize("given", ["state_dict", "clones"])
def test_functional_call_given_pieces_names_them_and_the_fix(given: str) -> None:
    """``functional_call(model, model.state_dict(), x)``, the unwrapped model's identity, and
    the EMA habit of calling with clones of ``named_parameters()`` give this rank's pieces:
    each rank raised torch's shape error alone (rank 0's blaming a parameter read outside its
    unit). Now every rank names the tensors given and the fix, and the model trains on."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3))
    x = torch.randn(8, 6)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _shard(copy.deepcopy(model), pg)
        tensors = (
            m.state_dict()
            if given == "state_dict"
            else {n: p.detach().clone() for n, p in m.named_parameters()}
        )
        with pytest.raises(
            RuntimeError,
            match=r"given for 0.weight \(given \(1, \d+\), is \(7, 6\)\)"
            r".*model.full_state_dict\(\)",
        ):
            with torch.no_grad():
                torch.func.functional_call(m, tensors, (_slice(x, rank, 2),))
        whole = m.full_state_dict()
        with torch.no_grad():
            out = torch.func.functional_call(m, whole, (_slice(x, rank, 2),))
        torch.testing.assert_close(out, model(_slice(x, rank, 2)), atol=1e-6, rtol=0)

    run_ranks(2, fn)


@pytest.mark.parametrize("world_size", [1, 2])
def test_functional_call_computes_with_the_tensors_given(world_size: int) -> None:
    """``torch.func.functional_call(model, tensors, x)`` (meta-learning's inner loop, a
    look-ahead) computes with the tensors given, as on the unwrapped model: outputs and their
    gradients with respect to those tensors equal the plain model's, for a whole set of
    parameters and for a part of one unit's. With the whole set the model's own parameters get
    no gradient; with a part, the rest get the plain model's, averaged over ranks. Training
    afterwards is in parity with the plain model. Before, every unit's gathered parameters
    shadowed the tensors given, and the call returned the model's own output without a word."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(6, 8),
        nn.Tanh(),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 2),
    )
    generator = torch.Generator().manual_seed(1)
    given = {n: torch.randn(p.shape, generator=generator) for n, p in model.named_parameters()}
    part = {"2.0.weight": given["2.0.weight"], "3.bias": given["3.bias"]}
    x = torch.randn(4 * world_size, 6, generator=generator)
    data = [torch.randn(4 * world_size, 6, generator=generator) for _ in range(3)]

    def called(m: nn.Module, tensors: dict[str, Tensor], xs: Tensor) -> tuple[Tensor, list[Tensor]]:
        leaves = {n: t.clone().requires_grad_() for n, t in tensors.items()}
        out = torch.func.functional_call(m, leaves, (xs,))
        out.square().sum().backward()
        return out.detach(), [leaves[n].grad for n in tensors]

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Any], dict[str, Tensor], dict[str, Tensor]]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=nn.Sequential)
        xs = _slice(x, rank, world_size)
        results = [called(m, given, xs)]
        assert all(p.grad is None for p in m.parameters())
        results.append(called(m, part, xs))
        torch.optim.SGD(m.parameters(), lr=1.0).step()  # the parameters less their gradients
        stepped = m.full_state_dict()
        m.load_full_state_dict(model.state_dict())
        _train_on(m, data, world_size, rank)
        return results, stepped, m.full_state_dict()

    plains = [copy.deepcopy(model) for _ in range(world_size)]
    expected = []
    for rank, plain in enumerate(plains):
        xs = _slice(x, rank, world_size)
        expected.append([called(copy.deepcopy(model), given, xs), called(plain, part, xs)])
    stepped_plain = {
        n: p.detach() - sum(q.get_parameter(n).grad for q in plains) / world_size
        if p.grad is not None
        else p.detach()
        for n, p in plains[0].named_parameters()
    }
    assert {n for n, p in plains[0].named_parameters() if p.grad is None} == set(part)
    ref = copy.deepcopy(model)
    _train_on(ref, data, 1, 0)
    for rank, (results, stepped, state) in enumerate(run_ranks(world_size, fn, timeout=30.0)):
        for (out, grads), (want_out, want_grads) in zip(results, expected[rank], strict=True):
            torch.testing.assert_close(out, want_out, rtol=0, atol=ATOL)
            for got, want in zip(grads, want_grads, strict=True):
                torch.testing.assert_close(got, want, rtol=0, atol=ATOL)
        _assert_close(stepped, stepped_plain)
        _assert_close(state, dict(ref.state_dict()))


# forward pre-hooks registered before wrapping ---------------------------------------------


def _pruned() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 2),
    )
    prune.l1_unstructured(model[0][0], "weight", amount=0.5)
    prune.random_structured(model[2], "weight", amount=0.5, dim=0)
    return model


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("auto_wrap", [nn.Sequential, nn.Linear])
def test_layers_pruned_before_wrapping_train_like_the_plain_model(
    world_size: int, auto_wrap: type[nn.Module]
) -> None:
    """``torch.nn.utils.prune`` registers a forward pre-hook that computes ``weight`` from
    ``weight_orig`` and the mask. A unit's gather now runs before every pre-hook of its module,
    so a pruned layer that is a unit itself (``auto_wrap=nn.Linear``) trains as one inside a
    unit does: as the plain model (before, its hook read this rank's piece, and the forward
    failed on its shape). Pruned weights stay zero."""
    models = [_pruned() for _ in range(world_size + 1)]  # built here: the threads share the RNG
    data = [torch.randn(4 * world_size, 6) for _ in range(3)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(models[rank], pg, auto_wrap=auto_wrap)
        _train_on(m, data, world_size, rank)
        return m.full_state_dict()

    ref = models[-1]
    _train_on(ref, data, 1, 0)
    for state in run_ranks(world_size, fn, timeout=30.0):
        _assert_close(state, dict(ref.state_dict()))
        weight = state["2.weight_orig"] * state["2.weight_mask"]
        assert (weight == 0).sum() == 8 and (state["0.0.weight_mask"] == 0).sum() == 24


@pytest.mark.parametrize("world_size", [1, 2])
def test_forward_hooks_registered_after_wrapping_see_the_full_parameters(world_size: int) -> None:
    """A forward hook on a unit registered after wrapping (weight statistics, say) runs before
    the unit releases its parameters: at each step it reads the plain model's full weight
    (before, this rank's piece). So does a pre-hook, also one given ``prepend=True``, on a unit
    and on the model (before, it ran ahead of the gather, on the pieces)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Sequential(nn.Linear(6, 8), nn.Tanh()),
        nn.Sequential(nn.Linear(8, 8), nn.Tanh()),
        nn.Linear(8, 2),
    )
    data = [torch.randn(4 * world_size, 6) for _ in range(3)]

    def watched(m: nn.Module) -> list[Tensor]:
        seen: list[Tensor] = []
        m[1].register_forward_pre_hook(lambda mod, args: seen.append(mod[0].weight.detach() + 0))
        m[1].register_forward_hook(lambda mod, args, out: seen.append(mod[0].weight.detach() + 0))
        m.register_forward_pre_hook(lambda mod, args: seen.append(mod[2].weight + 0), prepend=True)
        m[1].register_forward_pre_hook(
            lambda mod, args: seen.append(mod[0].weight.detach() + 0), prepend=True
        )
        return seen

    def fn(rank: int, pg: ProcessGroup) -> list[Tensor]:
        m = _shard(copy.deepcopy(model), pg, auto_wrap=nn.Sequential)
        seen = watched(m)
        _train_on(m, data, world_size, rank)
        return seen

    ref = copy.deepcopy(model)
    want = watched(ref)
    _train_on(ref, data, 1, 0)
    for seen in run_ranks(world_size, fn, timeout=30.0):
        assert len(seen) == len(want) == 4 * len(data)
        for got, expected in zip(seen, want, strict=True):
            torch.testing.assert_close(got, expected, rtol=0, atol=ATOL)


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_backward_that_would_differentiate_the_gradients_again_is_refused(
    world_size: int,
) -> None:
    """``loss.backward(create_graph=True)`` gave each piece the right ``.grad``, but a graph
    through it (a Hessian-vector product, a penalty on the parameters' gradients) held only
    this rank's share of the averaged gradient, and a second backward gave wrong values,
    silently. Refused as backward reaches the parameters, naming what works (a penalty on the
    gradient of inputs), before any gradient is written; training then goes on in parity."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    x, y = torch.randn(4, 8), torch.randn(4, 4)
    ref = copy.deepcopy(model)
    opt = _sgd(ref)
    F.mse_loss(ref(x), y).backward()
    opt.step()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _shard(copy.deepcopy(model), pg)
        xs, ys = _slice(x, rank, world_size), _slice(y, rank, world_size)
        with pytest.raises(RuntimeError, match=r"create_graph=True\) reached the parameters"):
            F.mse_loss(m(xs), ys).backward(create_graph=True)
        assert all(p.grad is None for p in m.parameters())
        opt = _sgd(m)
        F.mse_loss(m(xs), ys).backward()
        opt.step()
        return m.full_state_dict()

    for got in run_ranks(world_size, fn):
        _assert_close(got, ref.state_dict())
