"""Behaviours that PyTorch FSDP1's own suite asserts, ported to shardwrap.

Upstream: ``test/distributed/fsdp/test_fsdp_apply.py`` (initialising through module
attributes, here after an evaluation forward). Each test names the upstream test it mirrors
and trains a plain deep copy of its model on the whole global batch beside a
``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3, over several steps
(``tests/support/peers.py``): SGD with momentum, parameters equal within 1e-5. 2 ranks.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp1.py -q
-n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.peer_models import MLP
from tests.support.peers import STAGES, Batch, Side, assert_peer_parity, make_batches

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])


def _model() -> nn.Sequential:
    """MLPs as units, one nested in a Sequential beside a linear layer the root holds."""
    torch.manual_seed(0)
    return nn.Sequential(MLP(6), nn.Sequential(MLP(6), nn.Linear(6, 6)), MLP(6))


def _mse(side: Side, batch: Batch) -> Tensor:
    return F.mse_loss(side.model(side.local(batch[0])), side.local(batch[1]))


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
