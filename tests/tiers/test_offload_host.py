"""The host tier's logic, on the CPU: shards, gradients and optimizer state in a home apart from
the compute device, training exactly as without offload.

``Offload(device="cpu")`` is built for a CUDA compute device (pinned host memory, copies on
side streams: ``tests/tiers/test_gpu.py``). Here the wrapper is handed a ``HostHome`` on a CPU
device (plain copies, no streams), so that everything but the streams is
covered: every gather reads a staged copy of the shard, reduced gradients land in the home's
gradient buffer, the optimizer steps on the home's tensors. Proves, against the unwrapped
model trained on the whole global batch:

- parity at world sizes 1 and 2 and at stages 1, 2 and 3: SGD with momentum (parameters
  within 1e-5), AdamW (losses within 1e-5), a tied GPT, frozen parameters; mixed precision
  equal to the same run without offload; gradient accumulation over two backward passes; an
  optimizer that keeps every ``.grad`` past ``zero_grad()`` finds it unchanged at its next step;
  the global gradient norm;
- placement: gathers read staged copies, never the shard itself, and after the first step each
  unit's copy was staged ahead, when the unit before it was gathered; ``.grad`` is a view of
  the home's gradient buffer; the optimizer's state lives with the shards and its step is
  fused unless the user chose;
- checkpoints: a save resumed in a fresh host-tier model repeats the steps bit for bit, a
  meta-device model loads a full state dict, export equals ``full_state_dict``;
- errors: the disk tier with a CUDA device is refused before anything runs.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/tiers/test_offload_host.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed import ProcessGroup

import shardwrap.engine.wrap.sharded_module as sharded_module
from shardwrap import (
    MixedPrecision,
    Offload,
    ShardedModule,
    export,
    load_checkpoint,
    save_checkpoint,
)
from shardwrap.tiers.home import Home, HostHome
from tests.support.models import GPT, Block, FrozenPart, LoRALinear, make_batch
from tests.support.optimizers import (
    SGDKeepingGrads,
    fp32_grad_runs,
    overflow_at_the_second_step,
    runs_with_a_zero_grad,
)
from tests.support.ranks import run_ranks

STEPS, GLOBAL_BATCH = 3, 4
MakeOpt = Callable[[Any], torch.optim.Optimizer]


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


@pytest.fixture(autouse=True)
def staged_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``Offload(device="cpu")`` on the CPU gets the host tier (the library keeps it for GPUs)."""
    make_home = sharded_module.make_home

    def staged(offload: Offload | None, device: torch.device, rank: int) -> Home:
        if offload is not None and offload.device == "cpu":
            return HostHome(device)
        return make_home(offload, device, rank)

    monkeypatch.setattr(sharded_module, "make_home", staged)


def train(
    model: nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    world: int,
    vocab: int = 67,
    steps: range = range(STEPS),
    accumulate: int = 1,
) -> list[float]:
    """Train ``steps``, each over ``accumulate`` micro-batches; the losses, averaged over ranks
    when the model is sharded over more than one."""
    losses = []
    for step in steps:
        total = 0.0
        for micro in range(accumulate):
            x, y = make_batch(step * accumulate + micro, GLOBAL_BATCH, vocab=vocab)
            loss = model(x.chunk(world)[rank], y.chunk(world)[rank]) / accumulate
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def reference(
    model: nn.Module, make_opt: MakeOpt, vocab: int = 67, accumulate: int = 1
) -> tuple[list[float], dict[str, Any]]:
    ref = copy.deepcopy(model)
    losses = train(ref, make_opt(ref.parameters()), 0, 1, vocab, accumulate=accumulate)
    return losses, ref.state_dict()


def run(world: int, fn: Callable[[int, ProcessGroup | None], Any]) -> list[Any]:
    return [fn(0, None)] if world == 1 else run_ranks(world, fn, timeout=60.0)


def mean_over_ranks(values: list[float], pg: ProcessGroup | None) -> list[float]:
    if pg is None:
        return values
    total = torch.tensor(values)
    pg.allreduce([total]).wait()
    return (total / pg.size()).tolist()


def host(model: Any) -> HostHome:
    home = model._shardwrap_root.home
    assert isinstance(home, HostHome)
    return home


CASES = [
    ("gpt-sgd", lambda: GPT(), Block, sgd, 67),
    ("gpt-adamw", lambda: GPT(), Block, adamw, 67),
    ("tied-sgd", lambda: GPT(tied=True), Block, sgd, 67),
    ("frozen-adamw", lambda: FrozenPart(), LoRALinear, adamw, 29),
    ("gpt-sgd-keeping-grads", lambda: GPT(), Block, SGDKeepingGrads, 67),
]


def check_parity(
    world: int, stage: int, build: Any, wrap: type, make_opt: MakeOpt, vocab: int
) -> None:
    torch.manual_seed(0)
    model = build()
    ref_losses, ref_state = reference(model, make_opt, vocab)

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[list[float], dict[str, Any]]:
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=wrap,
            process_group=pg,
            stage=stage,
            offload=Offload(device="cpu"),
        )
        host(m)
        opt = make_opt(m.parameters())
        losses = train(m, opt, rank, world, vocab)
        return mean_over_ranks(losses, pg), m.full_state_dict()

    for losses, state in run(world, fn):
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        if make_opt in (sgd, SGDKeepingGrads):
            torch.testing.assert_close(state, dict(ref_state), atol=1e-5, rtol=0)


@pytest.mark.stage3
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("name", "build", "wrap", "make_opt", "vocab"), CASES)
def test_host_tier_trains_like_the_plain_model(
    world: int, name: str, build: Any, wrap: type, make_opt: MakeOpt, vocab: int
) -> None:
    check_parity(world, 3, build, wrap, make_opt, vocab)


@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize(("name", "build", "wrap", "make_opt", "vocab"), CASES[:2])
def test_host_tier_at_stages_1_and_2(
    stage: int, name: str, build: Any, wrap: type, make_opt: MakeOpt, vocab: int
) -> None:
    check_parity(2, stage, build, wrap, make_opt, vocab)


@pytest.mark.stage3
def test_mixed_precision_equals_the_same_run_without_offload() -> None:
    torch.manual_seed(0)
    model = GPT()
    precision = MixedPrecision(param_dtype=torch.bfloat16)

    def fn(rank: int, pg: ProcessGroup) -> list[list[float]]:
        runs = []
        for offload in (None, Offload(device="cpu")):
            m = ShardedModule(
                copy.deepcopy(model),
                auto_wrap=Block,
                process_group=pg,
                mixed_precision=precision,
                offload=offload,
            )
            runs.append(train(m, adamw(m.parameters()), rank, 2))
        return runs

    for plain, offloaded in run_ranks(2, fn, timeout=60.0):
        assert offloaded == plain  # the same casts, on the same device: bit for bit


@pytest.mark.stage3
def test_bf16_parameters_with_fp32_gradients_train_as_without_the_tier() -> None:
    """A bfloat16 GPT whose parameters' ``grad_dtype`` is float32 (set before wrapping), at 2
    ranks: the host tier's run equals the same run without offload bit for bit (SGD with
    momentum, unfused: torch's fused kernel refuses the mixed dtypes), and each ``.grad`` is
    float32, a view of the home's gradient buffer."""
    torch.manual_seed(0)
    model = GPT().to(torch.bfloat16)

    def in_home(m: nn.Module, grad: torch.Tensor) -> bool:
        groups = [g for u in m._shardwrap_root.units for g in u.groups]
        homes = {g.home_grad.data_ptr() for g in groups if g.home_grad is not None}
        return grad.untyped_storage().data_ptr() in homes

    def fn(rank: int, pg: ProcessGroup) -> list[tuple[list[float], dict[str, Any]]]:
        return fp32_grad_runs(model, rank, pg, Offload(device="cpu"), in_home)

    for plain, offloaded in run_ranks(2, fn, timeout=60.0):
        assert offloaded[0] == plain[0]
        torch.testing.assert_close(offloaded[1], plain[1], atol=0, rtol=0)


@pytest.mark.stage3
def test_zero_grad_between_no_sync_micro_batches_as_without_the_tier() -> None:
    """A micro-batch under ``no_sync()``, ``zero_grad()``, then one more under ``no_sync()`` and
    a synced one, at 2 ranks: the host tier's run equals the run without offload bit for bit,
    and both the run without the first micro-batch (dropped, zeros standing for it in
    ``.grad`` meanwhile)."""
    torch.manual_seed(0)
    model = GPT()
    tier = Offload(device="cpu")
    runs = run_ranks(2, lambda rank, pg: runs_with_a_zero_grad(model, rank, pg, tier))
    for plain, offloaded, without_first in runs:
        torch.testing.assert_close(offloaded, plain, atol=0, rtol=0)
        torch.testing.assert_close(plain, without_first, atol=0, rtol=0)


@pytest.mark.stage3
def test_an_inf_in_one_ranks_home_gradients_makes_torchs_grad_scaler_skip_on_both() -> None:
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> list[tuple[bool, float]]:
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=Block,
            process_group=pg,
            mixed_precision=MixedPrecision(param_dtype=torch.float16),
            offload=Offload(device="cpu"),
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        opt = adamw(m.parameters())
        return overflow_at_the_second_step(m, opt, scaler, rank, 2, torch.device("cpu"))

    for seen in run_ranks(2, fn, timeout=60.0):
        assert seen == [(True, 1024.0), (False, 512.0), (True, 512.0)]


@pytest.mark.stage3
def test_gradient_accumulation_and_the_global_norm() -> None:
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    ref_opt = sgd(ref.parameters())
    for micro in range(2):  # two micro-batches, one step
        x, y = make_batch(micro, GLOBAL_BATCH)
        (ref(x, y) / 2).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    ref_opt.step()

    def fn(rank: int, pg: ProcessGroup) -> tuple[float, dict[str, Any]]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, process_group=pg, offload=Offload(device="cpu")
        )
        opt = sgd(m.parameters())
        for micro in range(2):
            x, y = make_batch(micro, GLOBAL_BATCH)
            (m(x.chunk(2)[rank], y.chunk(2)[rank]) / 2).backward()
            if micro == 0:  # the first backward's gradients are the home's buffers
                for g in (g for u in m._shardwrap_root.units for g in u.trainable):
                    for p in g.shard_params:
                        assert p.grad.untyped_storage().data_ptr() == g.home_grad.data_ptr()
        norm = m.clip_grad_norm_(0.5)
        opt.step()
        return norm.item(), m.full_state_dict()

    for norm, state in run_ranks(2, fn, timeout=60.0):
        assert norm == pytest.approx(ref_norm.item(), abs=1e-5)
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


@pytest.mark.stage3
def test_gathers_read_copies_staged_ahead_and_state_stays_home(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    m = ShardedModule(GPT(depth=3), auto_wrap=Block, offload=Offload(device="cpu"))
    opt = adamw(m.parameters())
    home = host(m)
    ahead: list[bool] = []  # per gather: whether its shard's copy was staged ahead
    staged_inputs: list[torch.Tensor] = []
    gather_input = HostHome.gather_input

    def spy(self: HostHome, shard: torch.Tensor) -> torch.Tensor:
        staged = self._staged.get(id(shard))
        ahead.append(staged is not None and staged.version == shard._version)
        out = gather_input(self, shard)
        staged_inputs.append(out)
        return out

    monkeypatch.setattr(HostHome, "gather_input", spy)
    train(m, opt, 0, 1, steps=range(1))
    assert not all(ahead)  # the first step knows no order yet, and stages some late
    shard_ptrs = {g.shard.data_ptr() for u in m._shardwrap_root.units for g in u.groups}
    assert not shard_ptrs & {t.data_ptr() for t in staged_inputs}  # copies, never the shard
    ahead.clear()
    train(m, opt, 0, 1, steps=range(1, 2))
    # After a step, only the root's gather in forward comes first, with nothing before it.
    assert ahead.count(False) == len(m._shardwrap_root.root.groups), ahead

    assert all(group["fused"] for group in opt.param_groups)  # the home's step: fused
    homes = [g.shard for u in m._shardwrap_root.units for g in u.groups]
    for p in m.parameters():  # shard parameters and their state are views of home tensors
        base = p.untyped_storage().data_ptr()
        assert any(base == h.untyped_storage().data_ptr() for h in homes)
        assert all(v.device == home.memory for v in opt.state[p].values())


@pytest.mark.stage3
def test_resume_from_a_checkpoint_repeats_the_steps_and_exports(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = GPT()
    ref_losses, _ = reference(plain, adamw)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], list[float]]:
        with torch.device("meta"):
            meta = GPT()
        m = ShardedModule(
            meta,
            auto_wrap=Block,
            process_group=pg,
            offload=Offload(device="cpu"),
            sync_module_states=False,
        )
        m.load_full_state_dict(plain.state_dict())
        opt = adamw(m.parameters())
        first = train(m, opt, rank, 2, steps=range(1))
        save_checkpoint(tmp_path / "ckpt", m, opt)
        again = ShardedModule(
            copy.deepcopy(plain), auto_wrap=Block, process_group=pg, offload=Offload(device="cpu")
        )
        again_opt = adamw(again.parameters())
        load_checkpoint(tmp_path / "ckpt", again, again_opt)
        export(tmp_path / "export", again)
        exported = load_file(tmp_path / "export" / "model.safetensors")
        torch.testing.assert_close(exported, m.full_state_dict(), atol=0, rtol=0)
        first += train(m, opt, rank, 2, steps=range(1, STEPS))
        rest = train(again, again_opt, rank, 2, steps=range(1, STEPS))
        return mean_over_ranks(first, pg), mean_over_ranks(rest, pg)

    for first, rest in run_ranks(2, fn, timeout=60.0):
        assert first[1:] == rest  # resumed from the checkpoint: the same steps, bit for bit
        torch.testing.assert_close(first, ref_losses, atol=1e-5, rtol=0)


@pytest.mark.stage3
def test_the_disk_tier_with_a_cuda_device_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='runs on a CPU compute device.*Offload.device="cpu"'):
        ShardedModule(GPT(), device="cuda", offload=Offload(device="disk", path=tmp_path))
