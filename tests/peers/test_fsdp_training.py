"""Training behaviours that PyTorch FSDP2's own suite asserts, ported to shardwrap.

Upstream: ``test/distributed/_composable/fsdp/test_fully_shard_training.py``,
``test_fully_shard_grad_acc.py``, ``test_fully_shard_shared_params.py`` and the post-optimizer
wait of ``test_fully_shard_comm.py``. Each test names the
upstream test it mirrors and trains a plain deep copy of its model on the whole global batch
beside a ``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3, over several
steps (``tests/support/peers.py``): SGD with momentum, parameters equal within 1e-5; AdamW,
losses equal within 1e-5; plus each behaviour's own reads (full gradients, outputs), equal
within 1e-5. 2 ranks unless a test says 4.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp_training.py
-q -n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, Block, make_batch
from tests.support.peer_models import MLP, ChunkedHead
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    adamw,
    assert_peer_parity,
    full_tensor,
    make_batches,
    note_grads,
    plain_step,
    sgd,
    shapes_of,
)

pytestmark = pytest.mark.peers

VOCAB, CONTEXT = 31, 8
GPT_BATCHES = [make_batch(seed=s, batch=8, context=CONTEXT, vocab=VOCAB) for s in range(3)]
stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])


def _gpt(tied: bool = False, depth: int = 2) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, width=12, heads=2, depth=depth, context=CONTEXT, tied=tied)


def _gpt_loss(model: nn.Module, idx: Tensor, targets: Tensor) -> Tensor:
    return model(idx, targets)


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


def _accumulate(
    side: Side,
    batch: Batch,
    then: Callable[[int, Tensor], None] | None = None,
    loss_fn: Callable[[nn.Module, Tensor, Tensor], Tensor] = _mse,
) -> Tensor:
    """Forward and backward over ``MICRO`` micro-batches of ``batch`` (``loss_fn`` each, over
    ``MICRO``), under ``no_sync()`` on the sharded side but the last, ``then(i, loss)`` after
    micro-batch ``i``'s backward: the loss."""
    total = torch.zeros(())
    micro = list(zip(side.micro(batch[0], MICRO), side.micro(batch[1], MICRO)))
    for i, (x, y) in enumerate(micro):
        loss = loss_fn(side.model, x, y) / MICRO
        sync = side.model.no_sync() if side.sharded and i < MICRO - 1 else None
        with sync or contextlib.nullcontext():
            loss.backward()
        total = total + loss.detach()
        if then is not None:
            then(i, loss)
    return total


def _zero_grad_alternating(side: Side, opt: torch.optim.Optimizer) -> None:
    """As FSDP2's loops: ``set_to_none`` on even steps, zeroed gradients on odd ones."""
    opt.step()
    opt.zero_grad(set_to_none=side.step_index % 2 == 0)


# one unit, many units ---------------------------------------------------------------------


SHAPES = {"16x15-15x8": [(16, 15), (15, 8)], "7x15-15x3": [(7, 15), (15, 3)]}


@stages
@pytest.mark.parametrize("shapes", list(SHAPES))
def test_whole_model_as_one_unit_trains_like_plain(stage: int, shapes: str) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_single_group_shard_dim0: a model
    wrapped as one unit (no policy), with sizes that split unevenly over the ranks."""
    (a, b), (_, c) = SHAPES[shapes]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(a, b), nn.ReLU(), nn.Linear(b, c))
    batches = make_batches(4, (8, a), (8, c))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        _zero_grad_alternating(side, opt)
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step)


@stages
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_transformer_blocks_as_units_train_like_plain(stage: int, optimizer: str) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_multi_group: a transformer with
    each block a unit and the rest in the root, zeroed and ``None`` gradients alternating."""

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _gpt_loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        _zero_grad_alternating(side, opt)
        return loss

    make = {"sgd": sgd, "adamw": adamw}[optimizer]
    assert_peer_parity(
        _gpt(), stage=stage, batches=GPT_BATCHES, step=step, make_optimizer=make, auto_wrap=Block
    )


@stages
def test_world_size_one_trains_like_plain_without_communication(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_single_worldsize1: one rank and no
    process group, the same code path; nothing goes between processes."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 17), nn.ReLU(), nn.Linear(17, 8))
    batches = make_batches(4, (4, 16), (4, 8))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        if side.sharded:
            assert side.pg is None
        _zero_grad_alternating(side, opt)
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, world_size=1)


@stages
def test_root_then_a_unit_alone_forward_and_backward(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_non_root_forward_backward: a step through the
    root, then a step through one unit called on its own; both update as in plain PyTorch."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP(), MLP())
    batches = make_batches(4, (8, 9), (8, 9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = side.local(batch[0]), side.local(batch[1])
        module = side.model if side.step_index % 2 == 0 else side.model[0]
        loss = F.mse_loss(module(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


class MultiForward(nn.Module):
    """``inner`` runs twice in every forward."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(5, 5)
        self.outer = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 5)
        return self.outer(self.inner(x) + torch.tanh(self.inner(x * 2)))


def _inner(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.out_features == 5


@stages
def test_unit_called_twice_in_one_forward(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_multi_forward_module: a unit that runs twice
    per forward gets the sum of both uses' gradients."""
    torch.manual_seed(0)
    batches = make_batches(4, (8, 5), (8, 4))
    assert_peer_parity(
        MultiForward(), stage=stage, batches=batches, step=plain_step(_mse), auto_wrap=_inner
    )


@stages
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_activation_checkpointing_trains_like_plain(stage: int, tied: bool) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_with_activation_checkpointing:
    every block recomputed in backward, with and without a tied embedding and head."""
    assert_peer_parity(
        _gpt(tied),
        stage=stage,
        batches=GPT_BATCHES,
        step=plain_step(_gpt_loss),
        auto_wrap=Block,
        checkpoint_activations=True,
    )


# a loss computed chunk by chunk ---------------------------------------------------------------

DIM, HEAD_VOCAB, CHUNKS, MICRO = 10, 23, 2, 3
TOKENS = [
    (
        torch.randint(HEAD_VOCAB, (8, 6), generator=torch.Generator().manual_seed(s)),
        torch.randint(HEAD_VOCAB, (8, 6), generator=torch.Generator().manual_seed(100 + s)),
    )
    for s in range(3)
]


def _head_policy(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.Linear, nn.RMSNorm))


def _chunked_backward(
    side: Side, tokens: Tensor, targets: Tensor, scale: float, note: bool = True
) -> Tensor:
    """Forward up to the head, then the head and its loss one chunk of positions at a time
    (a backward each), then the body's backward from the chunks' input gradients. With
    ``note``, notes the head's full gradient after every chunk."""
    model = side.model
    h = model(tokens, skip_head=True)
    grads, total = [], torch.zeros(())
    for chunk, target in zip(h.detach().chunk(CHUNKS, dim=1), targets.chunk(CHUNKS, dim=1)):
        chunk = chunk.contiguous().requires_grad_(True)
        logits = model.head(chunk)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten()) * scale / CHUNKS
        loss.backward()
        grads.append(chunk.grad)
        total = total + loss.detach()
        if note:
            head_grad = full_tensor(side, model.head.weight.grad, _HEAD)
            side.note("head grad after each chunk", head_grad)
    h.backward(torch.cat(grads, dim=1))
    return total


_HEAD = torch.Size([HEAD_VOCAB, DIM])


@stages
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_chunked_loss_runs_the_head_per_chunk(stage: int, tied: bool) -> None:
    """Mirrors test_fully_shard_training.py::test_partial_group_forward_then_standalone: forward
    skips the head, the head then runs on its own per chunk with a backward each, and the body's
    backward follows; every chunk adds to the head's gradient, all parameters match."""
    torch.manual_seed(0)
    model = ChunkedHead(DIM, HEAD_VOCAB, tie=tied)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _chunked_backward(side, side.local(batch[0]), side.local(batch[1]), 1.0)
        _zero_grad_alternating(side, opt)
        return loss

    assert_peer_parity(model, stage=stage, batches=TOKENS, step=step, auto_wrap=_head_policy)


@stages
def test_units_kept_gathered_across_the_optimizer_step_see_the_step(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_partial_group_reshard_toggle and
    test_fully_shard_comm.py::test_post_optim_event: units held gathered through a whole step
    (``keep_gathered(True)``: a no-grad forward, the chunked-loss training step, the optimizer
    step, another no-grad forward); the forward after the step computes with the stepped
    weights, not the buffers gathered before it."""
    torch.manual_seed(0)
    model = ChunkedHead(DIM, HEAD_VOCAB)
    probe = torch.randint(HEAD_VOCAB, (2, 6), generator=torch.Generator().manual_seed(7))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        held = side.model.keep_gathered(True) if side.sharded else contextlib.nullcontext()
        with held:
            with torch.no_grad():
                side.note("before the step", side.model(probe))
            loss = _chunked_backward(side, side.local(batch[0]), side.local(batch[1]), 1.0)
            opt.step()
            opt.zero_grad()
            with torch.no_grad():
                side.note("after the step", side.model(probe))
        return loss

    assert_peer_parity(model, stage=stage, batches=TOKENS, step=step, auto_wrap=_head_policy)


@stages
def test_chunked_loss_with_gradient_accumulation(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_partial_group_forward_grad_accum_chunked:
    micro-batches under ``no_sync()``, then a synced one, each with the chunked loss (head per
    chunk, then the body's backward from the chunks' gradients): the accumulated gradients of
    every unit reach the step, as in plain PyTorch."""
    torch.manual_seed(0)
    model = ChunkedHead(DIM, HEAD_VOCAB)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        total = torch.zeros(())
        micro = zip(side.micro(batch[0], MICRO), side.micro(batch[1], MICRO))
        for i, (tokens, targets) in enumerate(micro):
            last = i == MICRO - 1
            sync = side.model.no_sync() if side.sharded and not last else contextlib.nullcontext()
            with sync:
                total = total + _chunked_backward(side, tokens, targets, 1.0 / MICRO, last)
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return total

    batches = [(torch.cat([t, t[:4]]), torch.cat([y, y[:4]])) for t, y in TOKENS]  # 12 rows
    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=_head_policy)


@stages
def test_two_partial_forwards_then_one_backward(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_double_partial_forward_then_backward: two
    forwards that stop before the head, one backward of both: every used parameter gets its
    gradient and the head, never run, keeps ``grad = None``."""
    torch.manual_seed(0)
    model = ChunkedHead(DIM, HEAD_VOCAB)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        tokens = side.local(batch[0])
        h1 = side.model(tokens, skip_head=True)
        h2 = side.model(tokens.flip(0), skip_head=True)
        loss = h1.pow(2).mean() + 0.5 * h2.tanh().mean()
        loss.backward()
        assert side.model.head.weight.grad is None
        assert side.model.embed.weight.grad is not None
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=TOKENS, step=step, auto_wrap=_head_policy)


@stages
def test_two_forwards_before_backward_with_nested_units_and_checkpointing(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_double_forward_with_nested_fsdp_and_checkpoint
    (the DPO pattern): two forwards of the model, then one backward of a loss over both, with
    units nested (each block's attention a unit inside the block's) and every unit
    recomputed."""

    def policy(module: nn.Module) -> bool:
        return isinstance(module, Block) or type(module).__name__ == "CausalSelfAttention"

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        idx, targets = side.local(batch[0]), side.local(batch[1])
        chosen = side.model(idx, targets)
        rejected = side.model(idx.flip(1), targets.flip(1))
        loss = chosen - 0.5 * rejected
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        _gpt(),
        stage=stage,
        batches=GPT_BATCHES,
        step=step,
        auto_wrap=policy,
        checkpoint_activations=True,
    )


class Raiser(nn.Module):
    """Runs ``inner``, or raises while armed (a data error half-way through forward)."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.armed = False

    def forward(self, x: Tensor) -> Tensor:
        if self.armed:
            raise RuntimeError("boom")
        return self.inner(x)


@stages
def test_training_goes_on_after_a_forward_that_raised(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_reset_iter_state_after_exception: a forward
    that raises after some units ran, caught; the next forward and backward of the same step
    train as if it had never run."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), Raiser(MLP()), MLP())
    batches = make_batches(3, (8, 9), (8, 9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = side.local(batch[0]), side.local(batch[1])
        if side.step_index == 1:
            side.model[1].armed = True
            with pytest.raises(RuntimeError, match="boom"):
                side.model(x)
            side.model[1].armed = False
        loss = F.mse_loss(side.model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


class ParameterOnly(nn.Module):
    """A forward that takes no input at all."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 5) / 2)
        self.other = nn.Parameter(torch.randn(5, 4) / 2)

    def forward(self) -> Tensor:
        return self.weight @ self.other


@stages
def test_forward_without_inputs(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_root_no_forward_inputs: ``model()`` with no
    argument runs, and its backward trains the parameters."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = (side.model() - 1).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(ParameterOnly(), stage=stage, batches=[(torch.zeros(2),)] * 3, step=step)


@stages
def test_parameters_are_the_same_pieces_after_forward_and_backward(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_param_registration_after_forward and
    ::test_param_registration_after_backward: the registered parameters are the same objects,
    of the same shapes, after a forward without backward, after a forward and after a
    backward, and their values are unchanged until the optimizer steps."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), MLP())
    batches = make_batches(3, (8, 9), (8, 9))

    def registered(m: nn.Module) -> list[tuple[str, int, torch.Size]]:
        return [(n, id(p), p.shape) for n, p in m.named_parameters()]

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = side.local(batch[0]), side.local(batch[1])
        before = registered(side.model)
        values = [p.detach().clone() for p in side.model.parameters()]
        side.model(x)  # a forward whose graph is dropped
        assert registered(side.model) == before
        loss = F.mse_loss(side.model(x), y)
        assert registered(side.model) == before
        loss.backward()
        assert registered(side.model) == before
        assert all(torch.equal(v, p) for v, p in zip(values, side.model.parameters()))
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_float64_model_trains_in_float64(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_to_float64_after_init: a float64 model trains
    with float64 parameters and gradients. Casting after wrapping, which FSDP2 allows, is
    refused here with a ValueError naming ``mixed_precision`` (the cast would detach the
    parameters from the flat shards): build the model in its dtype first."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(bias=True), MLP()).double()
    batches = [(x.double(), y.double()) for x, y in make_batches(3, (8, 9), (8, 9))]

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        assert all(p.dtype == p.grad.dtype == torch.float64 for p in side.model.parameters())
        opt.step()
        opt.zero_grad()
        return loss

    def finish(side: Side) -> None:
        if side.sharded:
            with pytest.raises(ValueError, match="mixed_precision"):
                side.model.to(torch.float32)

    assert_peer_parity(model, stage=stage, batches=batches, step=step, finish=finish, auto_wrap=MLP)


class OtherMethod(nn.Module):
    """A unit whose parent calls a method other than ``forward`` on it."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 9)

    def features(self, x: Tensor) -> Tensor:
        return torch.tanh(self.proj(x))

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x).sum(-1)


class CallsFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit = OtherMethod()
        self.projector = nn.Linear(9, 5)

    def forward(self, x: Tensor) -> Tensor:
        return self.projector(self.vit.features(x))


@stages
def test_parent_calls_a_units_method_other_than_forward(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_register_fsdp_forward_method: the parent runs
    ``self.vit.features(x)``, a method of a unit that is not its ``forward``. FSDP2 needs
    ``register_fsdp_forward_method`` for it; the plain model just runs it."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, 12), (8, 5))
    assert_peer_parity(
        CallsFeatures(), stage=stage, batches=batches, step=plain_step(_mse), auto_wrap=OtherMethod
    )


# tied parameters ------------------------------------------------------------------------------


@stages
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_tied_embedding_and_head_train_like_plain(stage: int, recompute: bool) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_with_shared_params and
    test_fully_shard_shared_params.py::test_train_shared_params: a head tied to the embedding,
    blocks as units, with and without activation checkpointing."""
    assert_peer_parity(
        _gpt(tied=True),
        stage=stage,
        batches=GPT_BATCHES,
        step=plain_step(_gpt_loss),
        auto_wrap=Block,
        checkpoint_activations=recompute,
    )


class Tied(nn.Module):
    def __init__(self, vocab: int, hidden: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, hidden)
        self.output = nn.Linear(hidden, vocab, bias=False)
        self.output.weight = self.tok_embeddings.weight

    def forward(self, ids: Tensor) -> Tensor:  # ids: (B, T)
        return self.output(self.tok_embeddings(ids))


def _tied_loss(model: nn.Module, ids: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


@stages
def test_tied_weight_with_uneven_rows_updates_every_row(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_train_shared_params_uneven_shard: a tied
    vocabulary of 4 x ranks + 1 rows (the last piece padded): every row is updated, as on the
    plain model."""
    vocab = 4 * 2 + 1
    torch.manual_seed(0)
    model = Tied(vocab)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randint(vocab, (4, 8), generator=g),) * 2 for _ in range(4)]

    ref, runs = assert_peer_parity(model, stage=stage, batches=batches, step=plain_step(_tied_loss))
    start = model.tok_embeddings.weight.detach()
    for run in [ref, *runs]:
        moved = (run.state["tok_embeddings.weight"] - start).abs().amax(dim=1)
        assert (moved > 0).all(), f"rows never updated: {(moved == 0).nonzero().flatten()}"


def _separate_units(module: nn.Module) -> bool:
    return isinstance(module, (nn.Embedding, nn.Linear))


@stages
def test_tied_weight_used_by_two_units(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_shared_params_separate_fsdp_groups_error:
    embedding and head as two units sharing one weight. FSDP2 raises ("already managed by
    another"); shardwrap keeps the weight once, in the lowest unit enclosing both uses (here the
    root), and trains like the plain model."""
    torch.manual_seed(0)
    model = Tied(17)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(17, (4, 8), generator=g),) * 2 for _ in range(3)]

    def finish(side: Side) -> None:
        if side.sharded:
            units = side.model._shardwrap_root.units
            tied = side.model.tok_embeddings.weight
            holders = [u for u in units if any(p is tied for g in u.groups for p in g.shard_params)]
            assert [u.module for u in holders] == [side.model]

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(_tied_loss),
        finish=finish,
        auto_wrap=_separate_units,
    )


# gradient accumulation ----------------------------------------------------------------------


@stages
def test_no_sync_accumulation_reduces_only_on_the_last_micro_batch(stage: int) -> None:
    """Mirrors test_fully_shard_grad_acc.py::test_requires_gradient_sync_ and
    test_fully_shard_training.py::test_gradient_accumulation: micro-batches under ``no_sync()``
    reduce nothing, the last one reduces everything accumulated, and the step matches the plain
    model accumulating all of them; zeroed and ``None`` gradients alternate between steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 9), MLP(), MLP(), MLP())
    batches = make_batches(4, (12, 9), (12, 9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        total = torch.zeros(())
        micro = list(zip(side.micro(batch[0], MICRO), side.micro(batch[1], MICRO)))
        for i, (x, y) in enumerate(micro):
            last = i == MICRO - 1
            loss = _mse(side.model, x, y) / MICRO
            if side.sharded:
                reduced = side.model.comm_stats.calls.get("reduce_scatter", 0)
                with side.model.no_sync() if not last else contextlib.nullcontext():
                    loss.backward()
                now = side.model.comm_stats.calls.get("reduce_scatter", 0)
                assert (now > reduced) == last, f"micro-batch {i}: {reduced} -> {now} reductions"
            else:
                loss.backward()
            total = total + loss.detach()
        _zero_grad_alternating(side, opt)
        return total

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


CLEARS = {
    "optimizer": lambda model, opt: opt.zero_grad(),
    "optimizer-zeros": lambda model, opt: opt.zero_grad(set_to_none=False),
    "model-zeros": lambda model, opt: model.zero_grad(set_to_none=False),
    "one-unit": lambda model, opt: model[2].zero_grad(),
    "one-unit-zeros": lambda model, opt: model[2].zero_grad(set_to_none=False),
}


@stages
@pytest.mark.parametrize("clear", list(CLEARS))
def test_zero_grad_between_no_sync_micro_batches_drops_what_they_accumulated(
    stage: int, clear: str
) -> None:
    """Mirrors test_fully_shard_pending_grad.py::test_grouped_clear_after_forward, and what DDP
    does: a micro-batch under ``no_sync()``, then ``zero_grad()`` (the optimizer's or the
    model's, set to ``None`` or zeroed, or one unit's alone), then another under ``no_sync()``
    and a synced one. What the first accumulated is dropped where it was cleared and kept
    elsewhere, as on the plain model whose ``.grad`` holds it: the step and the gradients
    match. Between the micro-batches every parameter given a gradient has a ``.grad`` (zeros:
    its part of the unreduced gradient is not this rank's to show)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(9, 9), MLP(), MLP(), MLP())
    shapes = shapes_of(model)
    batches = make_batches(3, (12, 9), (12, 9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        def clear_after_the_first(i: int, loss: Tensor) -> None:
            if i == 0:
                if side.sharded:
                    assert all(p.grad is not None for p in side.model.parameters())
                CLEARS[clear](side.model, opt)

        total = _accumulate(side, batch, clear_after_the_first)
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_micro_batches_with_units_kept_gathered(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_1f1b_microbatching: a pipeline-style step of
    three micro-batches, forward and backward each, only the last synced; at stage 3 the units
    stay gathered between forward and backward (``reshard_after_forward=False``)."""
    keep: dict[str, Any] = {"reshard_after_forward": False} if stage == 3 else {}

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        def note_loss(i: int, loss: Tensor) -> None:
            side.note("micro-batch loss", side.mean(loss))

        total = _accumulate(side, batch, note_loss, _gpt_loss)
        opt.step()
        opt.zero_grad()
        return total

    batches = [make_batch(seed=s, batch=12, context=CONTEXT, vocab=VOCAB) for s in range(3)]
    assert_peer_parity(
        _gpt(),
        stage=stage,
        batches=batches,
        step=step,
        make_optimizer=adamw,
        auto_wrap=Block,
        **keep,
    )


@stages
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recomputed"])
def test_hybrid_sharding_2x2_trains_like_plain(stage: int, recompute: bool) -> None:
    """Mirrors test_fully_shard_training.py::test_train_parity_hsdp: 4 ranks as 2 replicas of
    2 shards each, with gradient accumulation whose earlier micro-batches are not synced; also
    with each MLP recomputed in backward, as its activation-checkpointing case."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(9, bias=False), MLP(), MLP(), MLP())
    batches = make_batches(3, (12, 9), (12, 9))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        total = _accumulate(side, batch)
        _zero_grad_alternating(side, opt)
        return total

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=step,
        world_size=4,
        group=hybrid_mesh,
        auto_wrap=MLP,
        checkpoint_activations=recompute,
    )
