"""The CUDA tier: the host tier's pinned memory, side streams and NCCL paths, which the CPU suite
cannot reach (it runs the same logic staged on a CPU device: ``tests/tiers/test_offload_host.py``).

Every test is marked ``gpu`` and skipped, with its reason, where ``torch.cuda.is_available()``
is false. Proves, against the unwrapped model on the same GPU over the whole global batch:

- the host tier on one GPU (world size 1, no process group): SGD with momentum parameters
  within 1e-5, AdamW losses within 1e-5, a tied GPT; shards and gradients in pinned host
  memory, optimizer state on the host, the step fused on the CPU;
- the host tier at world size 2 over NCCL (two GPUs, one process each): the same parity;
- device memory: with the host tier, what stays allocated on the GPU between steps holds no
  fp32 shard and no optimizer state (``torch.cuda.memory_allocated``), and the peak during a
  step is the working set of a few units, while without offload it holds all of them;
- the disk tier with a CUDA device is refused by name;
- a non-blocking save (pinned snapshot, side stream) holds the state at the call while the
  model trains on; compressed gathers compute with the decoded weights on a GPU.

Run: ``.venv/bin/python -m pytest -m gpu tests/tiers/test_gpu.py -q -ra``
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwrap import Compression, Offload, ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.comm.quantize import Codec
from shardwrap.tiers.home import HostHome
from tests.support.models import GPT, Block, make_batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.stage3,  # stages are chosen here explicitly
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() false)"
    ),
]

STEPS, GLOBAL_BATCH = 3, 4


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    device = torch.device("cuda", torch.cuda.current_device())
    losses = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in make_batch(step, GLOBAL_BATCH))
        loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        total = loss.detach()
        if world > 1:
            dist.all_reduce(total)
        losses.append(total.item() / world)
    return losses


def check_host_tier(rank: int, world: int, optimizer: str, tied: bool, stage: int) -> None:
    """Train the host tier and the plain model on this GPU; assert parity and placement."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(tied=tied)  # on the CPU: the full model never needs to fit on the GPU
    ref = copy.deepcopy(model).to(device)
    make_opt = OPTIMIZERS[optimizer]
    ref_losses = train(ref, make_opt(ref.parameters()), 0, 1)

    m = ShardedModule(
        model, auto_wrap=Block, device=device, stage=stage, offload=Offload(device="cpu")
    )
    assert isinstance(m._shardwrap_root.home, HostHome)
    opt = make_opt(m.parameters())
    losses = train(m, opt, rank, world)
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    groups = [g for u in m._shardwrap_root.units for g in u.groups]
    assert all(g.shard.device.type == "cpu" and g.shard.is_pinned() for g in groups)
    assert all(g.home_grad.is_pinned() for g in groups if g.home_grad is not None)
    assert all(p.device.type == "cpu" for p in m.parameters())
    for state in opt.state.values():
        assert all(v.device.type == "cpu" for v in state.values() if v.dim() > 0)
    assert all(group["fused"] for group in opt.param_groups)
    if optimizer == "sgd":
        state = m.full_state_dict()
        torch.testing.assert_close(
            state, {k: v.cpu() for k, v in ref.state_dict().items()}, atol=1e-5, rtol=0
        )


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("optimizer", "tied"), [("sgd", False), ("adamw", False), ("sgd", True)])
def test_host_tier_on_one_gpu(optimizer: str, tied: bool, stage: int) -> None:
    check_host_tier(0, 1, optimizer, tied, stage)


def _nccl_worker(rank: int, init_file: str, optimizer: str, stage: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    try:
        check_host_tier(rank, 2, optimizer, False, stage)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
@pytest.mark.parametrize(("optimizer", "stage"), [("sgd", 3), ("adamw", 3), ("sgd", 2)])
def test_host_tier_over_nccl_at_world_size_2(tmp_path: Path, optimizer: str, stage: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(
        _nccl_worker, args=(str(tmp_path / "init"), optimizer, stage), nprocs=2, join=True
    )


def _memory(offload: bool) -> tuple[int, int, int]:
    """(allocated between steps, peak during a step, fp32 bytes of the model) on this GPU."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT(width=256, heads=4, depth=24)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(device)
    m = ShardedModule(
        model if offload else model.to(device),
        auto_wrap=Block,
        device=device,
        offload=Offload(device="cpu") if offload else None,
    )
    opt = adamw(m.parameters())
    x, y = (t.to(device) for t in make_batch(0, 2))
    for _ in range(2):
        torch.cuda.reset_peak_memory_stats(device)
        m(x, y).backward()
        opt.step()
        opt.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(device) - before
    resting = torch.cuda.memory_allocated(device) - before
    del m, opt, model
    torch.cuda.empty_cache()
    return resting, peak, model_bytes


def test_device_memory_holds_no_shards_or_optimizer_state_with_the_host_tier() -> None:
    resting, peak, model_bytes = _memory(offload=True)
    plain_resting, _, _ = _memory(offload=False)
    assert plain_resting >= 3 * model_bytes  # shards and two AdamW moments on the GPU
    assert resting < 0.05 * model_bytes, (resting, model_bytes)
    assert peak < 0.5 * model_bytes, (peak, model_bytes)  # a few of 24 blocks at a time


def test_the_disk_tier_with_a_cuda_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="runs on a CPU compute device"):
        ShardedModule(GPT(), device="cuda", offload=Offload(device="disk", path=tmp_path))


def test_a_nonblocking_save_on_a_gpu_holds_the_state_at_the_call(tmp_path: Path) -> None:
    """The snapshot is copied on a side stream into pinned memory; the steps that follow on the
    compute stream wait for it and change nothing of what is written."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT()
    m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, device=device)
    opt = adamw(m.parameters())
    train(m, opt, 0, 1)
    pending = save_checkpoint(tmp_path / "ckpt", m, opt, blocking=False, step=STEPS)
    at_call = m.full_state_dict()
    train(m, opt, 0, 1)
    pending.wait()
    fresh = ShardedModule(copy.deepcopy(model), auto_wrap=Block, device=device)
    assert load_checkpoint(tmp_path / "ckpt", fresh, adamw(fresh.parameters())) == {"step": STEPS}
    torch.testing.assert_close(fresh.full_state_dict(), at_call, atol=0, rtol=0)


def test_compressed_gathers_on_a_gpu_compute_with_the_decoded_weights() -> None:
    """At world size 1 a compressed gather still decodes its own shard: forward equals the
    plain model's with every parameter packed and decoded, and the shards stay exact."""
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = GPT().to(device)
    codec = Codec("int8", 256)
    m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, compression=Compression(params="int8"))
    ref = copy.deepcopy(model)
    x, y = (t.to(device) for t in make_batch(0, GLOBAL_BATCH))
    got = m(x, y)
    exact = m.full_state_dict()
    torch.testing.assert_close(exact, model.state_dict(), atol=0, rtol=0)
    for g in (g for u in m._shardwrap_root.units for g in u.groups):
        full = torch.zeros(g.layout.padded_numel, device=device)
        for name, offset, n in zip(g.names, g.layout.offsets, g.layout.numels):
            full[offset : offset + n] = exact[name].reshape(-1).float()
        decoded = codec.round_trip(full)
        with torch.no_grad():
            for name, offset, n in zip(g.names, g.layout.offsets, g.layout.numels):
                ref.get_parameter(name).copy_(decoded[offset : offset + n].view_as(exact[name]))
    torch.testing.assert_close(got, ref(x, y), atol=0, rtol=0)
