"""The CUDA tier: the host tier's pinned memory, side streams and NCCL paths, which the CPU suite
cannot reach (it runs the same logic staged on a CPU device: ``tests/tiers/test_offload_host.py``).

Every test is marked ``gpu`` and skipped, with its reason, where ``torch.cuda.is_available()``
is false; ``make gpu-check`` runs them all on a GPU machine. Proves, against the unwrapped
model on the same GPU over the whole global batch:

- the host tier on one GPU (world size 1, no process group, and over NCCL's default group of
  one rank): SGD with momentum parameters within 1e-5, AdamW losses within 1e-5, a tied GPT,
  at stages 1, 2 and 3; shards and gradients in pinned host memory, optimizer state on the
  host, the step fused on the CPU; copies on two side streams of the home's own;
- the host tier with Muon (matrices stepped whole) and AdamW: parameters within 1e-4 of the
  same recipe by hand (forward and backward on the GPU, the optimizer on CPU masters);
- the host tier under bf16 mixed precision: losses within 1e-5 of the same run without
  offload;
- the host tier under float16 with torch's ``GradScaler`` (pinned host gradients, the scale on
  the GPU): an inf in rank 0's piece skips that step and halves the scale, on every rank (one
  GPU, and two over NCCL);
- staging: every gather reads a device copy of its shard made on the side stream (an event
  recorded there), never the shard; after the first step each is staged ahead, but the
  root's first gather of the step; with the GPU held busy after forward, before the optimizer
  step or before the next forward, training ends where it ends without the lag (1e-5);
- the host tier at world size 2 over NCCL (two GPUs, one process each): the same parity, and
  Muon's whole matrices exchanged over NCCL on the GPU, though their pieces live on the host;
- over NCCL on two GPUs: weights that differ across ranks, built in host memory, become rank
  0's, and rank 0's edits in ``gathered(modifier_rank=0)`` reach every rank, over the default
  group and a group of the user's;
- device memory: with the host tier, what stays allocated on the GPU between steps holds no
  fp32 shard and no optimizer state (``torch.cuda.memory_allocated``), and the peak during a
  step is the working set of a few units, while without offload it holds all of them;
- the disk tier with a CUDA device is refused by name;
- a non-blocking save, from shards on the GPU (a pinned snapshot filled on a side stream) and
  from the host tier's pinned shards, holds the state at the call while the model trains on;
- inputs given on the CPU are moved to the GPU by the root, as DDP and FSDP2 move them.

Run: ``.venv/bin/python -m pytest -m gpu tests/tiers/test_gpu.py -q -ra``
"""

from __future__ import annotations

import copy
import gc
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardwrap import MixedPrecision, Offload, ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.tiers.home import HostHome
from tests.support.cuda import NEEDS_CUDA, gpu, nccl_world
from tests.support.models import GPT, Block, make_batch
from tests.support.optimizers import MuonAndAdamW, overflow_at_the_second_step

pytestmark = [pytest.mark.gpu, pytest.mark.stage3, NEEDS_CUDA]  # stages chosen here

STEPS, GLOBAL_BATCH = 3, 4


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int) -> list[float]:
    device = gpu()
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
    device = gpu()
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
    home = m._shardwrap_root.home
    compute = torch.cuda.current_stream(device)
    assert home._up is not None and home._down is not None
    assert compute not in (home._up, home._down)  # copies overlap compute on streams of their own
    if optimizer == "sgd":
        state = m.full_state_dict()
        torch.testing.assert_close(
            state, {k: v.cpu() for k, v in ref.state_dict().items()}, atol=1e-5, rtol=0
        )


def check_host_tier_grad_scaler(rank: int, world: int) -> None:
    """float16 with torch's ``GradScaler`` over the host tier's pinned gradients (the scale on
    the GPU): an inf in rank 0's piece at the second step makes every rank skip that step and
    halve the scale; the other steps are taken."""
    device = gpu()
    torch.manual_seed(0)
    m = ShardedModule(
        GPT(),
        auto_wrap=Block,
        device=device,
        mixed_precision=MixedPrecision(param_dtype=torch.float16),
        offload=Offload(device="cpu"),
    )
    scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
    seen = overflow_at_the_second_step(m, adamw(m.parameters()), scaler, rank, world, device)
    assert seen == [(True, 1024.0), (False, 512.0), (True, 512.0)], rank
    groups = [g for u in m._shardwrap_root.units for g in u.groups]
    assert all(g.home_grad.is_pinned() for g in groups if g.home_grad is not None)


def test_host_tier_grad_scaler_on_one_gpu() -> None:
    check_host_tier_grad_scaler(0, 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize(("optimizer", "tied"), [("sgd", False), ("adamw", False), ("sgd", True)])
def test_host_tier_on_one_gpu(optimizer: str, tied: bool, stage: int) -> None:
    check_host_tier(0, 1, optimizer, tied, stage)


def test_host_tier_over_nccl_world_of_one() -> None:
    with nccl_world():
        check_host_tier(0, 1, "adamw", False, 3)


def _offloaded_recipe(
    model: nn.Module, make_opt: Any, world: int = 1
) -> tuple[list[float], dict[str, Any]]:
    """The host tier by hand: forward and backward on the GPU, the optimizer stepping fp32
    masters on the CPU, which are copied back to the GPU after each step. With ``world``
    ranks, the batch's gradient is the mean of the ranks' slices', summed in rank order (as
    the ranks' reduction sums them: Muon's bf16 iteration would turn another order's last bits
    into more than the tolerance)."""
    work = copy.deepcopy(model).to(gpu())
    master = copy.deepcopy(model)
    opt = make_opt(master.parameters())
    losses = []
    for step in range(STEPS):
        x, y = (t.to(gpu()) for t in make_batch(step, GLOBAL_BATCH))
        loss = sum(work(xs, ys) / world for xs, ys in zip(x.chunk(world), y.chunk(world)))
        loss.backward()
        for m, w in zip(master.parameters(), work.parameters()):
            m.grad, w.grad = w.grad.cpu(), None
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters()):
                w.copy_(m)
        losses.append(loss.item())
    return losses, master.state_dict()


def check_host_tier_muon(rank: int, world: int, stage: int) -> None:
    """Muon orthogonalises each matrix's update in bf16 on the host: within 1e-4 of the recipe
    by hand on the whole batch. Over ranks, each matrix is exchanged whole to its owner."""
    torch.manual_seed(0)
    model = GPT()
    ref_losses, ref_state = _offloaded_recipe(model, MuonAndAdamW, world)
    m = ShardedModule(
        copy.deepcopy(model),
        auto_wrap=Block,
        device=gpu(),
        stage=stage,
        offload=Offload(device="cpu"),
    )
    losses = train(m, MuonAndAdamW(m.parameters()), rank, world)
    torch.testing.assert_close(losses, ref_losses, atol=1e-4, rtol=0)
    torch.testing.assert_close(m.full_state_dict(), ref_state, atol=1e-4, rtol=0)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_tier_steps_muon_whole_like_the_recipe_by_hand(stage: int) -> None:
    check_host_tier_muon(0, 1, stage)


def test_host_tier_under_bf16_trains_like_the_same_run_without_offload() -> None:
    torch.manual_seed(0)
    model = GPT()
    precision = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    runs = []
    for offload in (None, Offload(device="cpu")):
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=Block,
            device=gpu(),
            mixed_precision=precision,
            offload=offload,
        )
        runs.append(train(m, adamw(m.parameters()), 0, 1))
    # the same casts on the same GPU; the AdamW step on the CPU rounds like the GPU's
    torch.testing.assert_close(runs[1], runs[0], atol=1e-5, rtol=0)


def test_gathers_read_copies_staged_ahead_on_the_side_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    m = ShardedModule(GPT(), auto_wrap=Block, device=gpu(), offload=Offload(device="cpu"))
    opt = adamw(m.parameters())
    ahead: list[bool] = []  # per gather: whether its shard's copy was staged ahead
    on_side_stream: list[bool] = []  # per gather: whether its copy's event was recorded
    staged_inputs: list[torch.Tensor] = []
    gather_input = HostHome.gather_input

    def spy(self: HostHome, shard: torch.Tensor) -> torch.Tensor:
        staged = self._staged.get(id(shard))
        ahead.append(staged is not None and staged.version == shard._version)
        on_side_stream.append(staged is None or staged.done is not None)
        out = gather_input(self, shard)
        staged_inputs.append(out)
        return out

    monkeypatch.setattr(HostHome, "gather_input", spy)
    for step in range(STEPS):
        ahead.clear()  # the last step's
        x, y = (t.to(gpu()) for t in make_batch(step, GLOBAL_BATCH))
        m(x, y).backward()
        opt.step()
        opt.zero_grad()
    assert all(on_side_stream)
    assert all(t.device == gpu() for t in staged_inputs)
    shards = {g.shard.data_ptr() for u in m._shardwrap_root.units for g in u.groups}
    assert not shards & {t.data_ptr() for t in staged_inputs}  # copies, never the shard
    # After a step, only the root's gather in forward comes first, with nothing before it.
    assert ahead.count(False) == len(m._shardwrap_root.root.groups), ahead


@contextmanager
def _nccl_rank(rank: int, init_file: str) -> Iterator[None]:
    """This process as rank ``rank`` of two over NCCL, on GPU ``rank``, for the body."""
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=2,
        device_id=torch.device("cuda", rank),
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def _nccl_worker(rank: int, init_file: str, optimizer: str, stage: int) -> None:
    with _nccl_rank(rank, init_file):
        if optimizer == "muon":
            check_host_tier_muon(rank, 2, stage)
        elif optimizer == "grad-scaler":
            check_host_tier_grad_scaler(rank, 2)
        else:
            check_host_tier(rank, 2, optimizer, False, stage)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
@pytest.mark.parametrize(
    ("optimizer", "stage"),
    [("sgd", 3), ("adamw", 3), ("sgd", 2), ("muon", 3), ("grad-scaler", 3)],
)
def test_host_tier_over_nccl_at_world_size_2(tmp_path: Path, optimizer: str, stage: int) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(
        _nccl_worker, args=(str(tmp_path / "init"), optimizer, stage), nprocs=2, join=True
    )


def _agreement_worker(rank: int, init_file: str) -> None:
    with _nccl_rank(rank, init_file):
        torch.manual_seed(0)
        want = GPT().state_dict()
        for group in (None, dist.new_group(ranks=[0, 1])):  # the default group; one's own
            torch.manual_seed(rank)  # built in host memory, each rank its own weights
            m = ShardedModule(GPT(), auto_wrap=Block, device=gpu(), process_group=group)
            torch.testing.assert_close(m.full_state_dict(), want, atol=0, rtol=0)
            with m.gathered(modifier_rank=0):
                if rank == 0:
                    with torch.no_grad():
                        m.lm_head.weight.fill_(0.5)
            assert torch.equal(m.full_state_dict()["lm_head.weight"].unique(), torch.tensor([0.5]))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for NCCL")
def test_over_nccl_rank_0s_weights_and_edits_reach_every_gpu(tmp_path: Path) -> None:
    """Weights that differ across ranks, built in host memory, become rank 0's (sent from the
    GPU: NCCL takes no host tensor), and rank 0's edits inside ``gathered(modifier_rank=0)``
    reach every rank, over the default group and over a group of the user's (whose
    agreements run on the GPU)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.multiprocessing.spawn(
        _agreement_worker, args=(str(tmp_path / "init"),), nprocs=2, join=True
    )


def _memory(offload: bool) -> tuple[int, int, int]:
    """(allocated between steps, peak during a step, fp32 bytes of the model) on this GPU."""
    device = gpu()
    torch.manual_seed(0)
    model = GPT(width=256, heads=4, depth=24)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # cuBLAS's workspaces, one for this thread and one for autograd's, before the count starts;
    # and models of earlier tests that only a collection frees
    warm = nn.Linear(8, 8).to(device)
    warm(torch.ones(2, 8, device=device)).sum().backward()
    del warm
    gc.collect()
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
    device = gpu()
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


def test_a_nonblocking_save_from_the_host_tiers_pinned_shards_holds_the_state_at_the_call(
    tmp_path: Path,
) -> None:
    """The host tier's shards and optimizer state are in host memory: the snapshot copies them
    at the call, and the steps after it change nothing of what is written."""
    torch.manual_seed(0)
    model = GPT()

    def wrapped() -> nn.Module:
        return ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, device=gpu(), offload=Offload(device="cpu")
        )

    m = wrapped()
    opt = adamw(m.parameters())
    train(m, opt, 0, 1)
    pending = save_checkpoint(tmp_path / "ckpt", m, opt, blocking=False, step=STEPS)
    at_call = m.full_state_dict()
    train(m, opt, 0, 1)
    pending.wait()
    fresh = wrapped()
    assert load_checkpoint(tmp_path / "ckpt", fresh, adamw(fresh.parameters())) == {"step": STEPS}
    torch.testing.assert_close(fresh.full_state_dict(), at_call, atol=0, rtol=0)


def test_cpu_inputs_are_moved_to_the_gpu_as_ddp_and_fsdp2_move_them() -> None:
    """A batch left on the CPU (the token ids in a tuple, the targets as a keyword) reaches a
    model computing on the GPU: the root moves every CPU tensor of its inputs to the compute
    device before its forward, and the loss equals the one of the batch given on the GPU."""
    torch.manual_seed(0)
    model = ShardedModule(GPT(), auto_wrap=Block, device=gpu())
    idx, targets = make_batch(0, GLOBAL_BATCH)
    with torch.no_grad():
        on_gpu = model(idx.to(gpu()), targets=targets.to(gpu()))
        on_cpu = model(idx, targets=targets)
    assert on_cpu.device == gpu()
    torch.testing.assert_close(on_cpu, on_gpu, atol=0, rtol=0)


LAG_CYCLES = 200_000_000  # ~0.1 s of GPU clock: the GPU still busy when the CPU moves on


@pytest.mark.parametrize("where", ["after_forward", "before_step", "before_forward"])
def test_host_tier_trains_alike_with_the_gpu_lagging_behind_the_cpu(where: str) -> None:
    """The host tier's copies (shards staged to the GPU on a side stream, gradients landed in
    pinned host memory) and its CPU optimizer step must each wait for what they read: with the
    compute stream held busy (``torch.cuda._sleep``) after forward, before the optimizer step
    or before the next forward, three AdamW steps end within 1e-5 of where they end without the
    lag (a copy or step that did not wait would read stale or half-written values, far off)."""
    torch.manual_seed(0)
    model = GPT()
    device = gpu()

    def run(lag: bool) -> dict[str, torch.Tensor]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, device=device, offload=Offload(device="cpu")
        )
        opt = adamw(m.parameters())
        for step in range(STEPS):
            x, y = (t.to(device) for t in make_batch(step, GLOBAL_BATCH))
            if lag and where == "before_forward":
                torch.cuda._sleep(LAG_CYCLES)
            loss = m(x, y)
            if lag and where == "after_forward":
                torch.cuda._sleep(LAG_CYCLES)
            loss.backward()
            if lag and where == "before_step":
                torch.cuda._sleep(LAG_CYCLES)
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    torch.testing.assert_close(run(lag=True), run(lag=False), atol=1e-5, rtol=0)
