"""Behaviours that PyTorch FSDP1's own suite asserts, ported to shardwrap.

Upstream: ``test/distributed/fsdp/test_fsdp_unshard_params.py`` (whole gradients inside
``summon_full_params(with_grads=True)``: ``gathered(with_grads=True)`` here),
``test_fsdp_apply.py`` (initialising through module attributes, here after an evaluation
forward) and ``test_fsdp_use_orig_params.py`` (gradients written between backwards). Each
test names the upstream test it mirrors and trains a plain deep copy of its model on the whole
global batch beside a ``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3,
over several steps (``tests/support/peers.py``): SGD with momentum, parameters equal within
1e-5; plus each behaviour's own reads (whole gradients), equal within 1e-5. 2 ranks unless a
test says 4.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp1.py -q
-n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.hybrid import hybrid_mesh
from tests.support.peer_models import MLP
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    Step,
    assert_peer_parity,
    full_param,
    make_batches,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])


def _model() -> nn.Sequential:
    """MLPs as units, one nested in a Sequential beside a linear layer the root holds."""
    torch.manual_seed(0)
    return nn.Sequential(MLP(6), nn.Sequential(MLP(6), nn.Linear(6, 6)), MLP(6))


def _mse(side: Side, batch: Batch) -> Tensor:
    return F.mse_loss(side.model(side.local(batch[0])), side.local(batch[1]))


def _whole_grads(side: Side, writeback: bool = False) -> dict[str, Tensor | None]:
    """Every parameter's whole gradient by name: the plain model's ``.grad``; on a sharded
    model the module attributes' ``.grad`` inside ``gathered(with_grads=True)``, where the
    test then zeroes each of them (an edit that must not reach the pieces)."""
    names = [n for n, _ in side.model.named_parameters()]
    if not side.sharded:
        return {n: side.model.get_parameter(n).grad for n in names}
    model = side.model
    with model.gathered(with_grads=True, writeback=writeback):
        full = {n: full_param(model, n) for n in names}
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in full.items()}
        for p in full.values():
            if p.grad is not None:
                p.grad.zero_()
    for n, p in model.named_parameters():  # the pieces again, their gradients untouched
        assert p.grad is None or p.grad.shape == p.shape, n
    return grads


def _noting_whole_grads(writeback: bool = False) -> Step:
    """The usual step, noting every whole gradient between backward and the optimizer's step."""

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side, batch)
        loss.backward()
        side.note("whole gradients", _whole_grads(side, writeback))
        opt.step()
        opt.zero_grad()
        return loss

    return step


@pytest.mark.parametrize("writeback", [False, True], ids=["read", "writeback"])
@stages
def test_whole_gradients_inside_gathered_with_grads(stage: int, writeback: bool) -> None:
    """Mirrors test_fsdp_unshard_params.py::test_with_grads_core: after each backward, inside
    ``gathered(with_grads=True)`` every full parameter's ``.grad`` is its whole gradient,
    equal to the plain model's (as under DDP); editing it inside the block changes nothing
    (the block's whole gradients are copies), with and without ``writeback``."""
    batches = make_batches(3, (8, 6), (8, 6))
    step = _noting_whole_grads(writeback)
    assert_peer_parity(_model(), stage=stage, batches=batches, step=step, auto_wrap=MLP)


@stages
def test_no_whole_gradient_where_no_rank_has_one(stage: int) -> None:
    """Mirrors test_fsdp_unshard_params.py::test_with_grads_none_grads: before the first
    backward, and after ``zero_grad()`` (to ``None``), every full parameter's ``.grad`` inside
    ``gathered(with_grads=True)`` is ``None``; a frozen parameter's stays ``None`` after
    backward, as on the plain model."""
    batches = make_batches(2, (8, 6), (8, 6))

    def prepare(side: Side) -> None:
        side.model[1][1].weight.requires_grad_(False)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        side.note("before backward", _whole_grads(side))
        loss = _mse(side, batch)
        loss.backward()
        side.note("after backward", _whole_grads(side))
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        _model(), stage=stage, batches=batches, step=step, prepare=prepare, auto_wrap=MLP
    )


def test_whole_gradients_with_hybrid_sharding() -> None:
    """test_with_grads_core's whole gradients on a 2 x 2 mesh (4 ranks): each shard group
    gathers its pieces; the replicas' are alike."""
    batches = make_batches(2, (8, 6), (8, 6))
    assert_peer_parity(
        _model(),
        stage=3,
        batches=batches,
        step=_noting_whole_grads(),
        world_size=4,
        group=hybrid_mesh,
        auto_wrap=MLP,
    )


def _init(module: nn.Module) -> None:
    """An initialiser as ``model.apply`` runs it: constant fills through module attributes."""
    if isinstance(module, nn.Linear):
        with torch.no_grad():
            module.weight.fill_(0.05)
            module.bias.zero_()


@pytest.mark.parametrize("before", ["no_grad", "inference_mode", "no_backward"])
@stages
def test_apply_after_an_evaluation_forward(stage: int, before: str) -> None:
    """Mirrors test_fsdp_apply.py::test_nested_module_apply, after a forward with no backward
    (an evaluation under ``no_grad`` or ``inference_mode``, or one with gradients whose output
    is dropped): ``model.apply(init)`` filling weights through the module attributes
    initialises the model as on the plain one, and it trains alike. Before, at stage 3 the
    root's unit stayed gathered after such a forward and its module attributes were full
    tensors that the next release dropped: the fills were lost without a word."""
    batches = make_batches(3, (8, 6), (8, 6))
    modes = {
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
        "no_backward": torch.enable_grad,
    }

    def prepare(side: Side) -> None:
        with modes[before]():
            side.model(side.local(batches[0][0]))
        side.model.apply(_init)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        _model(), stage=stage, batches=batches, step=step, prepare=prepare, auto_wrap=MLP
    )


@pytest.mark.parametrize("how", ["grad.data", "grad"])
@stages
def test_gradients_written_after_backward_accumulate_the_next_backward(
    stage: int, how: str
) -> None:
    """Mirrors test_fsdp_use_orig_params.py::test_grad_writeback: after a backward, each
    parameter's ``.grad`` is written (``p.grad.data = t`` or ``p.grad = t``, 2 everywhere); the
    next backward, with no ``zero_grad()`` between, adds to what was written, as on the plain
    model. Before, after ``p.grad.data = t`` it added into the memory ``.grad`` had left: the
    whole gradient stayed 2.0 (0.29 off)."""
    batches = make_batches(3, (8, 6), (8, 6))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side, batch)
        loss.backward()
        for p in side.model.parameters():
            if how == "grad.data":
                p.grad.data = torch.full_like(p, 2.0)
            else:
                p.grad = torch.full_like(p, 2.0)
        _mse(side, batch).backward()
        side.note("whole gradients", _whole_grads(side))
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(_model(), stage=stage, batches=batches, step=step, auto_wrap=MLP)
