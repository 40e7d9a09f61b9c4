"""Mixed precision: low-precision compute and gathers, full-precision shards and optimizer.

The reference is the plain model in the textbook recipe: float32 master weights, a bfloat16
working copy that runs forward and backward on each rank's slice of the batch, gradients cast
to float32 and averaged. A sharded run must follow it step for step (it does the same
arithmetic), and both must track plain float32 training closely.

float16 adds loss scaling: torch's ``GradScaler`` and ``ShardedGradScaler`` must skip a step on
every rank when only one rank's gradient shard overflows, with a fused optimizer too (which
checks in its own step, not in ``unscale_``).
``ShardedGradScaler(process_group=...)`` also agrees over that group for plain gradients.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import MixedPrecision, ShardedGradScaler, ShardedModule
from tests.support import parity
from tests.support.hybrid import hybrid_mesh
from tests.support.models import (
    GPT,
    Block,
    ComplexLayer,
    FrozenPart,
    LoRALinear,
    WithBatchNorm,
    WithComplex,
    make_batch,
)
from tests.support.optimizers import scaled_step
from tests.support.parity import fused_adamw, train_recipe
from tests.support.peers import full_param
from tests.support.ranks import run_ranks

STEPS = 4
BATCHES = [make_batch(seed=step, batch=8) for step in range(STEPS)]
BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def _gpt(tied: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(tied=tied)


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def _mean(value: Tensor, pg: ProcessGroup | None) -> float:
    total = value.detach().float().clone()
    if pg is not None:
        pg.allreduce([total]).wait()
        total /= pg.size()
    return total.item()


def _loss(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return model(inputs, targets).float()  # averaged across ranks in fp32, as the recipe does


def train_sharded(
    model: nn.Module,
    world_size: int,
    make_optimizer: Any,
    batches: list = BATCHES,
    auto_wrap: Any = Block,
    **wrap: Any,
) -> list[tuple[list[float], dict[str, Tensor]]]:
    """Per rank: the losses and final full state of ``tests/support/parity.py``'s sharded run."""
    runs = parity.train_sharded(
        model, world_size, make_optimizer, batches, _loss, auto_wrap=auto_wrap, **wrap
    )
    return [(run.losses, run.state) for run in runs]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_bf16_follows_the_plain_mixed_precision_recipe(world_size: int) -> None:
    model = _gpt()
    ref_losses, ref_state = train_recipe(model, world_size, torch.bfloat16)
    for losses, state in train_sharded(model, world_size, _sgd, mixed_precision=BF16):
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)
        assert all(v.dtype == torch.float32 for v in state.values())


def test_frozen_parameters_under_bf16_stay_put_while_the_rest_follows_the_recipe() -> None:
    torch.manual_seed(0)
    model = FrozenPart()
    batches = [make_batch(seed=step, batch=8, vocab=29) for step in range(STEPS)]
    ref_losses, ref_state = train_recipe(model, 2, torch.bfloat16, batches)
    runs = train_sharded(model, 2, _sgd, batches, auto_wrap=LoRALinear, mixed_precision=BF16)
    for losses, state in runs:
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)
        assert torch.equal(state["adapter.base.weight"], model.adapter.base.weight)


def test_complex_parameters_stay_complex64_while_the_rest_follows_the_recipe() -> None:
    """bfloat16 compute casts the floating-point parameters only: a complex parameter is
    gathered, computes and is reduced in complex64 (casting it would drop its imaginary part),
    and training follows the recipe, which casts the same ones."""
    torch.manual_seed(0)
    model = WithComplex()
    g = torch.Generator().manual_seed(1)
    batches = [(x, x) for x in (torch.randn(8, 8, generator=g) for _ in range(STEPS))]

    def loss(m: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        return m(inputs.bfloat16()).float().square().mean()  # the recipe casts no inputs

    ref_losses, ref_state = train_recipe(model, 2, torch.bfloat16, batches, _sgd, loss)
    runs = parity.train_sharded(
        model, 2, _sgd, batches, loss, auto_wrap=ComplexLayer, mixed_precision=BF16
    )
    for run in runs:
        torch.testing.assert_close(run.losses, ref_losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(run.state, ref_state, atol=1e-5, rtol=0)
        assert run.state["layers.0.w"].dtype == torch.complex64


def test_bf16_tracks_fp32_training() -> None:
    model = _gpt()
    fp32 = train_sharded(model, 2, _adamw)[0][0]
    for losses, _ in train_sharded(model, 2, _adamw, mixed_precision=BF16):
        assert losses != fp32  # bf16 really computed in bf16
        # bf16 keeps 8 bits of mantissa: the loss itself rounds by up to 0.4%.
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(fp32), atol=0, rtol=1e-2)
        assert losses[-1] < 0.8 * losses[0]


def test_masters_stay_fp32_while_forward_sees_bf16_and_gathers_move_half_the_bytes() -> None:
    model = _gpt(tied=False)
    seen: list[tuple[torch.dtype, torch.dtype]] = []

    def fn(rank: int, pg: ProcessGroup) -> dict[str, dict[str, int]]:
        bytes_by_mode = {}
        for name, mp in [
            ("fp32", None),
            ("bf16", BF16),
            ("bf16-reduce", MixedPrecision(reduce_dtype=torch.bfloat16)),
        ]:
            sharded = ShardedModule(
                copy.deepcopy(model), process_group=pg, auto_wrap=Block, mixed_precision=mp
            )
            qkv = sharded.blocks[1].attn.qkv
            if mp is not None and rank == 0:
                qkv.register_forward_pre_hook(
                    lambda m, args: seen.append((m.weight.dtype, args[0].dtype))
                )
            optimizer = _adamw(sharded.parameters())
            sharded.comm_stats.reset()
            inputs, targets = BATCHES[0]
            sharded(inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            bytes_by_mode[name] = dict(sharded.comm_stats.bytes)
            optimizer.step()
            for p in sharded.parameters():
                assert p.dtype == torch.float32 and p.grad.dtype == torch.float32
            for state in optimizer.state.values():
                assert state["exp_avg"].dtype == torch.float32
            assert qkv.weight.dtype == torch.float32 and qkv.weight.shape[0] == 1  # the shard
        return bytes_by_mode

    for stats in run_ranks(2, fn):
        assert stats["bf16"]["all_gather"] * 2 == stats["fp32"]["all_gather"]
        assert stats["bf16"]["reduce_scatter"] == stats["fp32"]["reduce_scatter"]
        assert stats["bf16-reduce"]["reduce_scatter"] * 2 == stats["fp32"]["reduce_scatter"]
    assert seen and all(s == (torch.bfloat16, torch.bfloat16) for s in seen)


def test_output_and_buffer_dtypes() -> None:
    torch.manual_seed(0)
    model = WithBatchNorm()
    x = torch.randn(6, 13)

    sharded = ShardedModule(
        copy.deepcopy(model),
        mixed_precision=MixedPrecision(output_dtype=torch.float32, buffer_dtype=torch.bfloat16),
    )
    out = sharded(x)
    assert out.dtype == torch.float32
    assert sharded.net[1].running_mean.dtype == torch.bfloat16
    assert sharded.net[1].num_batches_tracked.dtype == torch.int64
    torch.testing.assert_close(out, model(x), atol=0.1, rtol=0.05)

    gpt = _gpt()
    gpt.register_buffer("stat", torch.ones(3))
    default = ShardedModule(gpt, mixed_precision=MixedPrecision())
    assert default(BATCHES[0][0]).dtype == torch.bfloat16
    assert default.stat.dtype == torch.float32


def test_state_dict_and_gathered_read_the_fp32_masters_exactly() -> None:
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> None:
        sharded = ShardedModule(
            copy.deepcopy(model), process_group=pg, auto_wrap=Block, mixed_precision=BF16
        )
        optimizer = _adamw(sharded.parameters())
        inputs, targets = BATCHES[0]
        sharded(inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
        optimizer.step()
        shards = [p.detach().clone() for p in sharded.parameters()]
        sharded(inputs, targets)  # leaves the root gathered in bf16
        state = sharded.full_state_dict()
        weight = state["blocks.0.mlp.0.weight"]
        assert weight.dtype == torch.float32
        assert not torch.equal(weight.bfloat16().float(), weight)  # not rounded to bf16
        with sharded.gathered(writeback=True):
            assert sharded.blocks[0].mlp[0].weight.dtype == torch.float32
            torch.testing.assert_close(sharded.blocks[0].mlp[0].weight, weight, atol=0, rtol=0)
        for p, before in zip(sharded.parameters(), shards):
            assert torch.equal(p, before)  # written back bit for bit

    run_ranks(2, fn)


@pytest.mark.parametrize("make_optimizer", [_adamw, fused_adamw], ids=["adamw", "fused-adamw"])
@pytest.mark.parametrize("scaler_class", [ShardedGradScaler, torch.amp.GradScaler])
def test_fp16_overflow_on_one_rank_skips_the_step_on_every_rank(
    make_optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer],
    scaler_class: type[torch.amp.GradScaler],
) -> None:
    """Whichever scaler and optimizer step: the check over the shard gradients agrees over the
    model's ranks, for torch's own ``GradScaler`` as for ``ShardedGradScaler`` (given no group),
    fused kernels too."""
    model = _gpt()
    fp16 = MixedPrecision(param_dtype=torch.float16)

    def fn(rank: int, pg: ProcessGroup) -> list[float]:
        sharded = ShardedModule(
            copy.deepcopy(model), process_group=pg, auto_wrap=Block, mixed_precision=fp16
        )
        optimizer = make_optimizer(sharded.parameters())
        scaler = scaler_class("cpu", init_scale=1024.0)
        scales, losses = [], []
        for step, (inputs, targets) in enumerate(BATCHES):
            loss = sharded(inputs.chunk(2)[rank], targets.chunk(2)[rank])
            scaler.scale(loss).backward()
            if step == 1 and rank == 0:  # an overflow only rank 0's shard can see
                next(p for p in sharded.parameters() if p.numel()).grad[0] = float("inf")
            stepped, scale = scaled_step(scaler, optimizer, sharded)
            assert stepped == (step != 1), f"rank {rank} step {step}"
            scales.append(scale)
            losses.append(_mean(loss, pg))
        assert scales == [1024.0, 512.0, 512.0, 512.0]
        return losses

    fp32 = train_sharded(model, 2, _adamw)[0][0]
    for losses in run_ranks(2, fn, timeout=30.0):
        torch.testing.assert_close(losses[:2], fp32[:2], atol=0, rtol=1e-2)
        assert losses[-1] < 0.9 * losses[0]  # three of four steps taken


def test_fp16_large_scale_overflows_and_backs_off() -> None:
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> list[float]:
        sharded = ShardedModule(
            copy.deepcopy(model),
            process_group=pg,
            auto_wrap=Block,
            mixed_precision=MixedPrecision(param_dtype=torch.float16),
        )
        optimizer = _sgd(sharded.parameters())
        scaler = ShardedGradScaler("cpu", init_scale=2.0**40, process_group=pg)
        inputs, targets = BATCHES[0]
        before = [p.detach().clone() for p in sharded.parameters()]
        scaler.scale(sharded(inputs.chunk(2)[rank], targets.chunk(2)[rank])).backward()
        scaler.step(optimizer)
        scaler.update()
        assert all(torch.equal(p, b) for p, b in zip(sharded.parameters(), before))
        return [scaler.get_scale()]

    assert run_ranks(2, fn) == [[2.0**39], [2.0**39]]


@pytest.mark.parametrize("scaler_class", [ShardedGradScaler, torch.amp.GradScaler])
def test_a_process_group_given_to_the_sharded_scaler_agrees_over_plain_gradients(
    scaler_class: type[torch.amp.GradScaler],
) -> None:
    """``ShardedGradScaler(process_group=...)`` agrees over that group for gradients that are not
    a shardwrap model's: an inf in one rank's copy of a plain model skips the step on both;
    torch's scaler, given no group, skips on that rank alone."""

    def fn(rank: int, pg: ProcessGroup) -> bool:
        model = nn.Linear(4, 4)
        optimizer = _sgd(model.parameters())
        if scaler_class is ShardedGradScaler:
            scaler = ShardedGradScaler("cpu", init_scale=2.0, process_group=pg)
        else:
            scaler = scaler_class("cpu", init_scale=2.0)
        scaler.scale(model(torch.ones(2, 4)).sum()).backward()
        if rank == 0:
            model.weight.grad[0, 0] = float("inf")
        stepped, _ = scaled_step(scaler, optimizer, model)
        return stepped

    want = [False, False] if scaler_class is ShardedGradScaler else [False, True]
    assert run_ranks(2, fn) == want


def test_bad_mixed_precision_arguments() -> None:
    with pytest.raises(ValueError, match="param_dtype must be a floating-point"):
        MixedPrecision(param_dtype=torch.int32)
    with pytest.raises(TypeError):
        MixedPrecision(torch.bfloat16)  # type: ignore[misc]
    with pytest.raises(TypeError, match="mixed_precision takes a shardwrap.MixedPrecision"):
        ShardedModule(_gpt(), mixed_precision=torch.bfloat16)  # type: ignore[arg-type]


class _DtypeFromParameters(nn.Module):
    """Casts its input to the dtype of its first parameter, as read from ``parameters()``."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.linear(x.to(next(self.parameters()).dtype)))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_dtype_read_from_the_pieces_fails_naming_where_to_read_it(dtype: torch.dtype) -> None:
    """Code that takes the compute dtype from ``next(self.parameters())`` reads the float32
    pieces, while its unit computes in the low precision: torch failed on the dtypes alone
    ("mat1 and mat2 must have the same dtype"). Now the error says why and where to read the
    dtype; a dtype error of another kind (bfloat16 alone) passes as torch raised it."""
    torch.manual_seed(0)
    model = nn.Sequential(_DtypeFromParameters(), nn.Linear(8, 2))
    name = str(dtype).removeprefix("torch.")

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=_DtypeFromParameters,
            process_group=pg,
            mixed_precision=MixedPrecision(param_dtype=dtype),
        )
        with pytest.raises(RuntimeError) as error:
            m(torch.randn(2, 8))
        said = str(error.value)
        assert said.startswith(f"shardwrap: forward failed on mixing float32 with {name}")
        assert "next(self.parameters()).dtype" in said and "self.linear.weight.dtype" in said
        assert "must have the same dtype" in said  # torch's own words, kept

        def unsupported(module: nn.Module, args: Any) -> None:
            raise RuntimeError(f"unsupported scalar type {name}")

        m.register_forward_pre_hook(unsupported)
        with pytest.raises(RuntimeError, match=f"^unsupported scalar type {name}$"):
            m(torch.randn(2, 8))

    run_ranks(2, fn, timeout=30.0)


@pytest.mark.parametrize("scaler_class", [ShardedGradScaler, torch.amp.GradScaler])
def test_an_overflow_one_replica_alone_sees_skips_the_step_on_every_replica(
    scaler_class: type[torch.amp.GradScaler],
) -> None:
    """With hybrid sharding the check agreed over the shard group alone: a non-finite value
    that one replica's rank alone held after the reduction (a gradient hook's, a faulty
    device's) skipped the step on that replica, while the other stepped and kept its scale,
    and the replicas parted ways. Now the flag is agreed over the replicas too."""
    model = _gpt()
    fp16 = MixedPrecision(param_dtype=torch.float16)

    def fn(rank: int, pg: ProcessGroup) -> tuple[float, dict[str, Tensor]]:
        sharded = ShardedModule(
            copy.deepcopy(model), process_group=hybrid_mesh(pg), auto_wrap=Block,
            mixed_precision=fp16,
        )  # fmt: skip
        optimizer = _adamw(sharded.parameters())
        scaler = scaler_class("cpu", init_scale=1024.0)
        inputs, targets = BATCHES[0]
        scaler.scale(sharded(inputs.chunk(4)[rank], targets.chunk(4)[rank])).backward()
        if rank == 0:
            next(p for p in sharded.parameters() if p.numel()).grad[0] = float("inf")
        stepped, scale = scaled_step(scaler, optimizer, sharded)
        assert not stepped, f"rank {rank}"
        return scale, sharded.full_state_dict()

    runs = run_ranks(4, fn, timeout=30.0)
    for scale, state in runs:
        assert scale == 512.0
        torch.testing.assert_close(state, runs[0][1], atol=0, rtol=0)


@pytest.mark.parametrize("hybrid", [False, True], ids=["", "hybrid"])
def test_float16_gradients_whose_sum_overflows_average_to_their_finite_mean(hybrid: bool) -> None:
    """A float16 reduction summed the ranks' gradients, then divided: where each rank's and
    their mean fit in float16 but a sum of two does not, the reduced gradients were inf (a loss
    scaler then skipped the step and halved the scale for nothing). Each rank's part is now
    divided first, exactly at a power-of-two world size: every rank given the same batch, the
    mean is each rank's own gradient, bit for bit."""
    world = 4 if hybrid else 2
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    x = torch.randn(4, 8)
    fp16 = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16)

    def backward(m: nn.Module, scale: float) -> None:
        m(x.half() if m is work else x).float().square().sum().mul(scale).backward()

    work = copy.deepcopy(model).half()
    backward(work, 1.0)
    scale = 1.5 * 65504 / (2 * max(p.grad.abs().max().item() for p in work.parameters()))
    work.zero_grad()
    backward(work, scale)  # each rank's gradient fits float16; a sum of two does not
    own = [p.grad.clone() for p in work.parameters()]
    assert all(torch.isfinite(g).all() for g in own)
    assert not all(torch.isfinite(g + g).all() for g in own)

    def fn(rank: int, pg: ProcessGroup) -> list[Tensor]:
        group = hybrid_mesh(pg) if hybrid else pg
        m = ShardedModule(copy.deepcopy(model), process_group=group, mixed_precision=fp16)
        backward(m, scale)
        with m.gathered(with_grads=True):  # the module attributes: whole parameters
            return [full_param(m, n).grad.clone() for n, _ in m.named_parameters()]

    for grads in run_ranks(world, fn, timeout=30.0):
        for got, want in zip(grads, own):
            torch.testing.assert_close(got.half(), want, atol=0, rtol=0)
