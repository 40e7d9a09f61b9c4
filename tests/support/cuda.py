"""What the CUDA tier (``tests/tiers/test_gpu*.py``, ``tests/e2e/test_gpu_two_ranks.py``)
shares: its skip mark, the GPU it runs on, batches moved there, and the parity of a model
trained on one GPU against the unwrapped model trained on the same GPU.

A GPU run compares with a plain run on the same GPU, never with one on the CPU: the kernels
differ (cuBLAS, fused attention), so only the same device's arithmetic can be matched within
the suite's tolerances.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from shardwrap import ShardedModule
from tests.support.parity import Batch, LossFn, MakeOptimizer, sgd, train_reference, train_steps

__all__ = ["NEEDS_CUDA", "cpu", "gpu", "nccl_world", "on", "trains_like_plain"]

NEEDS_CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() false)"
)


def gpu() -> torch.device:
    """The GPU the tier runs on: the current CUDA device."""
    return torch.device("cuda", torch.cuda.current_device())


@contextmanager
def nccl_world() -> Iterator[None]:
    """torch.distributed's default group, NCCL over this one GPU (world size 1), for the body:
    what ``torchrun --nproc_per_node=1`` gives a training script. A model wrapped inside
    shards over it and issues NCCL's collectives (of one rank) where world size 1 without a
    group issues none, and makes its gloo control group over the loopback interface."""
    if not dist.is_nccl_available():
        pytest.skip(f"this torch ({torch.__version__}) was built without NCCL")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the hostname may resolve nowhere
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def on(device: torch.device, loss_fn: LossFn) -> LossFn:
    """``loss_fn`` with its batch moved to ``device`` first (the shared batches are on the CPU;
    a host-tier model's parameters are too, so the model's own device cannot tell)."""

    def moved(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        return loss_fn(model, inputs.to(device), targets.to(device))

    return moved


def cpu(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state``'s tensors on the CPU, where ``full_state_dict()`` returns its own."""
    return {k: v.detach().cpu() for k, v in state.items()}


def trains_like_plain(
    model: nn.Module,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    loss_fn: LossFn,
    device: torch.device,
    atol: float = 1e-5,
    reference: tuple[list[float], dict[str, Tensor]] | None = None,
    **wrap: Any,
) -> nn.Module:
    """Train ``model`` (on ``device``, or on the CPU for the host tier) unwrapped and as a
    ``ShardedModule`` at world size 1 on ``device``; assert the losses of every step within
    ``atol`` and, with SGD, every parameter after the last. ``reference``: the reference's
    losses and state where it is not the plain model's own training (mixed precision's recipe).

    Returns the trained sharded model, for further checks.
    """
    moved = on(device, loss_fn)
    if reference is None:
        ref = train_reference(copy.deepcopy(model).to(device), make_optimizer, batches, moved)
        reference = ref.losses, ref.state
    ref_losses, ref_state = reference
    start = cpu(model.state_dict())
    change = max((ref_state[k].cpu() - v).abs().max().item() for k, v in start.items())
    assert change > 1e-3, "the reference did not train; parity would prove nothing"
    sharded = ShardedModule(copy.deepcopy(model), device=device, **wrap)
    losses = train_steps(sharded, 0, 1, None, make_optimizer, batches, moved)
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), atol=atol, rtol=0, msg=_by_step
    )
    if make_optimizer is sgd:
        torch.testing.assert_close(sharded.full_state_dict(), cpu(ref_state), atol=atol, rtol=0)
    return sharded


def _by_step(message: str) -> str:
    return f"losses by step: {message}"
