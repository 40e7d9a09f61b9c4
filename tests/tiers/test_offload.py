"""The disk tier: shards, gradients and optimizer state in files, training exactly as in memory.

``Offload(device="disk", path=...)`` keeps every tensor that grows with the model in
preallocated, mapped files under ``path``; optimizer state made "like" a shard parameter is
placed there too, whatever the optimizer. Proves, against the unwrapped model trained on the
whole global batch:

- parity at world sizes 1 and 2: SGD with momentum (parameters within 1e-5, momentum made from
  the gradient), AdamW (losses within 1e-5), a tied GPT and a model with frozen parameters; a
  model built on the meta device materialised into the store; resuming from a checkpoint; an
  optimizer that keeps every ``.grad`` past ``zero_grad()`` finds it unchanged at its next step;
  exporting, streamed from the store;
- the optimizer state and the gradients live in the store's files;
- the memory a rank holds outside the store (allocation tracking during training steps) does
  not grow with the model's depth, while without offload it does;
- the optimizer's step takes torch's fused kernel unless the user chose otherwise (Adam,
  AdamW, SGD and Adagrad; state loaded from an in-memory run's checkpoint keeps working), and
  a unit kept gathered by a ``no_grad`` forward sees the fused step's write;
- the step hook is each optimizer's own, none process-wide: two optimizers over one model are
  both hooked, an optimizer over other parameters is never touched, the hook goes with the
  model; an optimizer built after a backward is hooked at the next one, one handed to
  ``load_checkpoint`` at once;
- SGD with momentum over a block unfrozen mid-training (the fused kernel given zeros for its
  first buffers); a model freed late leaves a newer model's files in its folder alone;
- optimizer state replaced (``load_checkpoint`` into the live model, as a Logbook's rollback
  does, ``load_full_optimizer_state_dict``, a new optimizer) gives its files back: the store's
  files, bytes and this process's open descriptors stay level over repeated replacements
  (before, every load added a whole copy of the optimizer state on disk and a descriptor per
  file, until "Too many open files");
- errors: a stage other than 3, a store folder another live model holds, a malformed
  ``Offload``; the cpu tier on a CPU device says it changes nothing; a store file deleted,
  replaced or truncated under a live model raises ``StoreError`` naming it at the next
  forward, backward or step, before anything reads it (truncation in a subprocess, where a
  missed check would be a ``SIGBUS``), and the other rank fails within the group's timeout.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/tiers/test_offload.py -q``
"""

from __future__ import annotations

import copy
import gc
import os
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn
from torch.distributed import ProcessGroup

from shardwrap import (
    CollectiveFailed,
    Offload,
    ShardedModule,
    export,
    full_optimizer_state_dict,
    load_checkpoint,
    load_full_optimizer_state_dict,
    save_checkpoint,
)
from shardwrap.engine.optim import whole_params
from shardwrap.tiers.home import DiskHome
from shardwrap.tiers.offload import StoreError
from tests.support.launch import ROOT
from tests.support.memory import StorageTracker
from tests.support.models import GPT, Block, FrozenPart, LoRALinear, make_batch
from tests.support.optimizers import (
    SGDKeepingGrads,
    fp32_grad_runs,
    runs_with_a_zero_grad,
)
from tests.support.ranks import run_ranks
from tests.support.store import in_store

pytestmark = pytest.mark.stage3  # the disk tier is a stage-3 feature

STEPS, GLOBAL_BATCH = 3, 4
MakeOpt = Callable[[Any], torch.optim.Optimizer]


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=3e-3)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, rank: int, world: int, vocab: int = 67
) -> list[float]:
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step, GLOBAL_BATCH, vocab=vocab)
        loss = model(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _reference(
    model: nn.Module, make_opt: MakeOpt, vocab: int = 67
) -> tuple[list[float], dict[str, Any]]:
    ref = copy.deepcopy(model)
    losses = _train(ref, make_opt(ref.parameters()), 0, 1, vocab)
    return losses, ref.state_dict()


def _run(world: int, fn: Callable[[int, ProcessGroup | None], Any]) -> list[Any]:
    return [fn(0, None)] if world == 1 else run_ranks(world, fn, timeout=60.0)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(
    ("name", "build", "wrap", "make_opt", "vocab"),
    [
        ("gpt-sgd", lambda: GPT(), Block, _sgd, 67),
        ("gpt-adamw", lambda: GPT(), Block, _adamw, 67),
        ("tied-sgd", lambda: GPT(tied=True), Block, _sgd, 67),
        ("frozen-adamw", lambda: FrozenPart(), LoRALinear, _adamw, 29),
        ("gpt-sgd-keeping-grads", lambda: GPT(), Block, SGDKeepingGrads, 67),
    ],
)
def test_disk_tier_trains_like_the_plain_model(
    tmp_path: Path, world: int, name: str, build: Any, wrap: type, make_opt: MakeOpt, vocab: int
) -> None:
    torch.manual_seed(0)
    model = build()
    ref_losses, ref_state = _reference(model, make_opt, vocab)

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[list[float], dict[str, Any]]:
        offload = Offload(device="disk", path=tmp_path)
        m = ShardedModule(copy.deepcopy(model), auto_wrap=wrap, process_group=pg, offload=offload)
        opt = make_opt(m.parameters())
        losses = _train(m, opt, rank, world, vocab)
        for state in opt.state.values():
            for value in state.values():
                if value.dim() > 0:
                    assert in_store(m, value)  # optimizer state lives in the files
        assert all(in_store(m, p) for p in m.parameters())
        if pg is not None:
            mean = torch.tensor(losses)
            pg.allreduce([mean]).wait()
            losses = (mean / world).tolist()
        return losses, m.full_state_dict()

    for losses, state in _run(world, fn):
        torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
        if make_opt in (_sgd, SGDKeepingGrads):
            torch.testing.assert_close(state, dict(ref_state), atol=1e-5, rtol=0)


@pytest.mark.stage3
def test_bf16_parameters_with_fp32_gradients_train_as_without_the_tier(tmp_path: Path) -> None:
    """A bfloat16 GPT whose parameters' ``grad_dtype`` is float32 (set before wrapping), at 2
    ranks: the disk tier's run equals the same run without offload bit for bit (SGD with
    momentum, which torch steps unfused here: its fused kernel refuses the mixed dtypes), and
    each ``.grad`` is float32, in the tier's files."""
    torch.manual_seed(0)
    model = GPT().to(torch.bfloat16)

    def fn(rank: int, pg: ProcessGroup) -> list[tuple[list[float], dict[str, Any]]]:
        return fp32_grad_runs(model, rank, pg, Offload(device="disk", path=tmp_path), in_store)

    for plain, offloaded in run_ranks(2, fn, timeout=60.0):
        assert offloaded[0] == plain[0]
        torch.testing.assert_close(offloaded[1], plain[1], atol=0, rtol=0)


@pytest.mark.stage3
def test_zero_grad_between_no_sync_micro_batches_as_without_the_tier(tmp_path: Path) -> None:
    """A micro-batch under ``no_sync()``, ``zero_grad()``, then one more under ``no_sync()`` and
    a synced one, at 2 ranks: the disk tier's run equals the run without offload bit for bit,
    and both the run without the first micro-batch (dropped, zeros standing for it in
    ``.grad`` meanwhile)."""
    torch.manual_seed(0)
    model = GPT()
    tier = Offload(device="disk", path=tmp_path)
    runs = run_ranks(2, lambda rank, pg: runs_with_a_zero_grad(model, rank, pg, tier))
    for plain, offloaded, without_first in runs:
        torch.testing.assert_close(offloaded, plain, atol=0, rtol=0)
        torch.testing.assert_close(plain, without_first, atol=0, rtol=0)


def test_meta_model_materialises_into_the_store_and_resumes(tmp_path: Path) -> None:
    torch.manual_seed(0)
    plain = GPT()
    ref_losses, _ = _reference(plain, _adamw)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], list[float]]:
        with torch.device("meta"):
            m = GPT()
        m = ShardedModule(
            m,
            auto_wrap=Block,
            process_group=pg,
            offload=Offload(device="disk", path=tmp_path / "a"),
            sync_module_states=False,
        )
        m.load_full_state_dict(plain.state_dict())
        opt = _adamw(m.parameters())
        x, y = make_batch(0, GLOBAL_BATCH)
        loss = m(x.chunk(2)[rank], y.chunk(2)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        save_checkpoint(tmp_path / "ckpt", m, opt)
        again = ShardedModule(
            copy.deepcopy(plain),
            auto_wrap=Block,
            process_group=pg,
            offload=Offload(device="disk", path=tmp_path / "b"),
        )
        again_opt = _adamw(again.parameters())
        load_checkpoint(tmp_path / "ckpt", again, again_opt)
        export(tmp_path / "export", again)  # streamed from the store, one unit at a time
        exported = load_file(tmp_path / "export" / "model.safetensors")
        torch.testing.assert_close(exported, m.full_state_dict(), atol=0, rtol=0)
        first = [loss.item()]
        rest = []
        for model, opt_, out in ((m, opt, first), (again, again_opt, rest)):
            for step in range(1, STEPS):
                x, y = make_batch(step, GLOBAL_BATCH)
                loss = model(x.chunk(2)[rank], y.chunk(2)[rank])
                loss.backward()
                opt_.step()
                opt_.zero_grad()
                out.append(loss.item())
        states = [v for s in again_opt.state.values() for v in s.values() if v.dim()]
        assert all(in_store(again, v) for v in states)
        return first, rest

    results = run_ranks(2, fn, timeout=60.0)
    for first, rest in results:
        assert first[1:] == rest  # resumed from the checkpoint: the same steps, bit for bit
    means = [(a + b) / 2 for a, b in zip(results[0][0], results[1][0])]
    torch.testing.assert_close(means, ref_losses, atol=1e-5, rtol=0)


def _peak_outside_store(tmp_path: Path, depth: int, offload: bool) -> int:
    torch.manual_seed(0)
    model = GPT(width=128, heads=4, depth=depth)
    options = Offload(device="disk", path=tmp_path / f"d{depth}") if offload else None
    m = ShardedModule(model, auto_wrap=Block, offload=options)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    home = m._shardwrap_root.home
    ignore = (lambda t: home._map_of(t) is not None) if isinstance(home, DiskHome) else None
    x, y = make_batch(0, 1)
    with StorageTracker(existing=tuple(m.parameters()), ignore=ignore) as tracker:
        for _ in range(2):
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
    return tracker.peak


def test_memory_outside_the_store_does_not_grow_with_depth(tmp_path: Path) -> None:
    shallow, deep = (_peak_outside_store(tmp_path, d, True) for d in (2, 8))
    plain_shallow, plain_deep = (_peak_outside_store(tmp_path, d, False) for d in (2, 8))
    assert plain_deep > 2.5 * plain_shallow  # without offload the state grows with depth
    # What still grows is activations, well under half a block's fp32 parameters per added
    # block; any copy of a block's state left outside the store would add at least all of them.
    block = 4 * sum(p.numel() for p in Block(128, 4).parameters())
    assert deep - shallow < 6 * block / 2, (shallow, deep, block)


def test_bad_offload_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match='"cpu" or "disk"'):
        Offload(device="nvme")
    with pytest.raises(ValueError, match="needs a folder"):
        Offload(device="disk")
    with pytest.raises(ValueError, match="needs stage=3"):
        ShardedModule(GPT(), stage=2, offload=Offload(device="disk", path=tmp_path))
    with pytest.raises(TypeError, match="shardwrap.Offload"):
        ShardedModule(GPT(), offload="disk")  # type: ignore[arg-type]
    first = ShardedModule(GPT(), offload=Offload(device="disk", path=tmp_path))
    with pytest.raises(RuntimeError, match="in use by another run"):
        ShardedModule(GPT(), offload=Offload(device="disk", path=tmp_path))
    del first  # held in reference cycles until a collection: the next model's wrap runs one
    ShardedModule(GPT(), offload=Offload(device="disk", path=tmp_path))
    with pytest.warns(UserWarning, match="changes nothing"):
        ShardedModule(GPT(), offload=Offload(device="cpu"))


@pytest.mark.parametrize(
    ("make_opt", "choice"),
    [
        (lambda ps: torch.optim.AdamW(ps, lr=3e-3), {"fused": True, "foreach": None}),
        (lambda ps: torch.optim.Adam(ps, lr=3e-3), {"fused": True, "foreach": None}),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), {"fused": True, "foreach": None}),
        (_sgd, {"fused": True, "foreach": None}),
        (lambda ps: torch.optim.AdamW(ps, fused=False), {"fused": False, "foreach": None}),
        (lambda ps: torch.optim.AdamW(ps, foreach=False), {"fused": None, "foreach": False}),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, foreach=True), {"fused": None, "foreach": True}),
        (lambda ps: torch.optim.RMSprop(ps), {"foreach": None}),  # no fused kernel: as it was
    ],
)
def test_the_step_is_fused_unless_the_user_chose(
    tmp_path: Path, make_opt: MakeOpt, choice: dict[str, Any]
) -> None:
    torch.manual_seed(0)
    model = GPT()
    ref_losses, _ = _reference(model, make_opt)
    m = ShardedModule(model, auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    opt = make_opt(m.parameters())
    losses = _train(m, opt, 0, 1)
    for group in opt.param_groups:
        assert {k: group.get(k) for k in choice} == choice
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)


def test_a_fused_step_resumes_state_an_unfused_run_saved(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT()
    plain = ShardedModule(copy.deepcopy(model), auto_wrap=Block)
    plain_opt = _adamw(plain.parameters())
    losses: dict[str, list[float]] = {"plain": [], "disk": []}

    def step(m: nn.Module, opt: torch.optim.Optimizer, i: int, out: list[float]) -> None:
        x, y = make_batch(i, GLOBAL_BATCH)
        loss = m(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())

    step(plain, plain_opt, 0, [])
    save_checkpoint(tmp_path / "ckpt", plain, plain_opt)  # state with step counts, unfused
    disk = ShardedModule(model, auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    disk_opt = _adamw(disk.parameters())
    load_checkpoint(tmp_path / "ckpt", disk, disk_opt)
    for i in range(1, STEPS):
        step(plain, plain_opt, i, losses["plain"])
        step(disk, disk_opt, i, losses["disk"])
    assert all(group["fused"] for group in disk_opt.param_groups)
    torch.testing.assert_close(losses["disk"], losses["plain"], atol=1e-5, rtol=0)
    # The fused kernel rounds apart from the loop by ~4e-5 here; step counts lost or restarted
    # would move parameters by ~lr (3e-3).
    torch.testing.assert_close(disk.full_state_dict(), plain.full_state_dict(), atol=1e-4, rtol=0)


def test_the_offload_step_hook_is_registered_per_optimizer(tmp_path: Path) -> None:
    from torch.optim.optimizer import _global_optimizer_pre_hooks

    gc.collect()  # models other tests left to the collector
    torch.manual_seed(0)
    model = GPT()
    ref_losses, _ = _reference(model, _adamw)
    m = ShardedModule(model, auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    params = list(m.parameters())
    first, second = _adamw(params[:3]), _adamw(params[3:])  # two optimizers over one model
    other = nn.Linear(4, 4)
    other_opt = _adamw(other.parameters())  # over no shard: shardwrap never touches it
    losses = []
    for step in range(STEPS):
        x, y = make_batch(step, GLOBAL_BATCH)
        loss = m(x, y)
        loss.backward()
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()
        other(torch.ones(2, 4)).sum().backward()
        other_opt.step()
        losses.append(loss.item())
    # process-wide: only the shape-aware optimizers' hook, while a sharded model lives
    assert list(_global_optimizer_pre_hooks.values()) == [whole_params._before_step]
    models = whole_params._models  # sharded models alive, this one among them
    assert all(len(o._optimizer_step_pre_hooks) == 1 for o in (first, second))
    assert all(g["fused"] for o in (first, second) for g in o.param_groups)
    assert not other_opt._optimizer_step_pre_hooks and other_opt.param_groups[0]["fused"] is None
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)
    del m, model, loss
    gc.collect()
    assert not first._optimizer_step_pre_hooks  # gone with the model
    assert whole_params._models == models - 1  # the hook goes with the last model alive


def test_an_optimizer_built_after_backward_or_handed_to_a_load_is_hooked(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT()
    ref_losses, _ = _reference(model, _adamw)
    m = ShardedModule(model, auto_wrap=Block, offload=Offload(device="disk", path=tmp_path / "a"))
    losses, opt = [], None
    for step in range(STEPS):
        x, y = make_batch(step, GLOBAL_BATCH)
        loss = m(x, y)
        loss.backward()
        if opt is None:  # after the backward: its first step has no hook yet
            opt = _adamw(m.parameters())
            assert not opt._optimizer_step_pre_hooks
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert len(opt._optimizer_step_pre_hooks) == 1  # found at the next backward
    assert all(g["fused"] for g in opt.param_groups)
    torch.testing.assert_close(losses, ref_losses, atol=1e-5, rtol=0)

    save_checkpoint(tmp_path / "ckpt", m, opt)
    disk = Offload(device="disk", path=tmp_path / "b")
    fresh = ShardedModule(GPT(), auto_wrap=Block, offload=disk)
    fresh_opt = _adamw(fresh.parameters())
    load_checkpoint(tmp_path / "ckpt", fresh, fresh_opt)
    assert len(fresh_opt._optimizer_step_pre_hooks) == 1


def _store_file(tmp_path: Path, kind: str) -> Path:
    """One of the store's files: ``shard``, ``grad`` or ``tensor`` (optimizer state)."""
    return sorted((tmp_path / "rank-00000").glob(f"{kind}-*.bin"))[1]


def _replace(path: Path) -> None:
    """Put another file of the same size at ``path``, as a copy-then-rename would."""
    other = path.with_suffix(".new")
    other.write_bytes(path.read_bytes())
    other.replace(path)


@pytest.mark.parametrize("damage", [os.remove, _replace])
def test_a_store_file_deleted_or_replaced_under_a_live_model_is_named(
    tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    torch.manual_seed(0)
    m = ShardedModule(GPT(), auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    opt = _adamw(m.parameters())
    _train(m, opt, 0, 1)
    what = "deleted" if damage is os.remove else "replaced"
    x, y = make_batch(0, 2)

    victim = _store_file(tmp_path, "tensor")  # optimizer state: found before the step
    loss = m(x, y)
    loss.backward()
    damage(victim)
    with pytest.raises(StoreError, match=f"{victim.name} .training state. was {what}"):
        opt.step()
    with pytest.raises(StoreError, match="restart from the last checkpoint"):
        m(x, y)  # and at every later call


def test_a_store_file_truncated_under_a_live_model_is_named_not_a_crash(tmp_path: Path) -> None:
    # Touching a mapped page past a truncated file's end is SIGBUS: a missed check must fail
    # this test, not kill the test run.
    script = textwrap.dedent(
        f"""
        import os, pathlib, sys, torch
        from shardwrap import Offload, ShardedModule
        from shardwrap.tiers.offload import StoreError
        from tests.support.models import GPT, Block, make_batch

        def truncate(folder, kind):
            path = sorted((folder / "rank-00000").glob(kind + "-*.bin"))[1]
            os.truncate(path, 8)
            return path.name

        x, y = make_batch(0, 2)
        for case, kind in (("forward", "shard"), ("backward", "grad"), ("step", "tensor")):
            folder = pathlib.Path({str(tmp_path)!r}) / case
            m = ShardedModule(GPT(), auto_wrap=Block, offload=Offload(device="disk", path=folder))
            opt = torch.optim.AdamW(m.parameters())
            m(x, y).backward()
            opt.step()
            opt.zero_grad()
            try:
                if case == "forward":
                    name = truncate(folder, kind)
                    m(x, y)
                loss = m(x, y)
                if case == "backward":
                    name = truncate(folder, kind)
                loss.backward()
                name = truncate(folder, kind)
                opt.step()
            except StoreError as e:
                assert name in str(e) and "truncated to 8 of its" in str(e), str(e)
                print(case, "named")
        """
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert proc.stdout.split() == ["forward", "named", "backward", "named", "step", "named"]


def test_the_other_rank_fails_within_the_timeout_when_one_finds_its_store_damaged(
    tmp_path: Path,
) -> None:
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> str:
        offload = Offload(device="disk", path=tmp_path)
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, offload=offload)
        x, y = make_batch(0, 2)
        m(x, y).backward()
        if rank == 0:
            os.remove(_store_file(tmp_path, "shard"))
        with pytest.raises((StoreError, CollectiveFailed)) as raised:
            m(x, y)
        return type(raised.value).__name__

    # The groups' timeout is 2 s; run_ranks fails a run still going after 4 s.
    assert run_ranks(2, fn, timeout=4.0) == ["StoreError", "CollectiveFailed"]


def test_a_unit_kept_gathered_by_a_no_grad_forward_sees_the_fused_step(tmp_path: Path) -> None:
    # The fused kernels write parameters without bumping their version counters; the root,
    # kept gathered after a no_grad forward, must still be gathered afresh after the step.
    torch.manual_seed(0)
    model = GPT()
    ref = copy.deepcopy(model)
    m = ShardedModule(model, auto_wrap=Block, offload=Offload(device="disk", path=tmp_path))
    x, y = make_batch(0, GLOBAL_BATCH)
    outputs = []
    for net in (ref, m):
        opt = _adamw(net.parameters())
        net(x, y).backward()
        with torch.no_grad():
            net(x, y)
        opt.step()
        with torch.no_grad():
            outputs.append(net(x, y))
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-5, rtol=0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_over_a_block_unfrozen_mid_training_trains_like_the_plain_model(
    tmp_path: Path, nesterov: bool
) -> None:
    """The disk tier steps SGD with its fused kernel, which makes momentum buffers only where
    no parameter has one: a block unfrozen after the others had buffers failed in torch's
    kernel ("expected Tensor as element 0 in argument 2, but got NoneType"), where the plain
    model's loop starts the new parameters' momentum at their first gradient. Now they are
    given zeros, which the kernel turns into exactly that."""
    torch.manual_seed(0)
    model = GPT()
    for p in model.blocks[0].parameters():
        p.requires_grad_(False)

    def train(m: nn.Module, rank: int, world: int) -> None:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, nesterov=nesterov)
        _train(m, opt, rank, world)
        for p in m.blocks[0].parameters():  # unfrozen: its first gradients come now
            p.requires_grad_(True)
        _train(m, opt, rank, world)

    plain = copy.deepcopy(model)
    train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Any]:
        offload = Offload(device="disk", path=tmp_path)
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, offload=offload)
        train(m, rank, 2)
        return m.full_state_dict()

    for state in run_ranks(2, fn, timeout=60.0):
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-5, rtol=0)


def test_a_model_freed_late_leaves_a_newer_models_files_alone(tmp_path: Path) -> None:
    """A model is freed when the garbage collector breaks its reference cycles, which may be
    long after ``del``: its store's folder, removed by the user meanwhile and taken by a new
    model, was deleted whole then, the new model's files with it (its next step raised
    ``StoreError``). Now a freed store deletes only its own files."""
    torch.manual_seed(0)
    model = GPT()
    old = ShardedModule(
        copy.deepcopy(model), auto_wrap=Block, offload=Offload(device="disk", path=tmp_path)
    )
    shutil.rmtree(tmp_path)
    new = ShardedModule(
        copy.deepcopy(model), auto_wrap=Block, offload=Offload(device="disk", path=tmp_path)
    )
    held = sorted(os.listdir(tmp_path / "rank-00000"))
    del old
    gc.collect()
    assert sorted(os.listdir(tmp_path / "rank-00000")) == held
    _train(new, _sgd(new.parameters()), 0, 1)
    del new
    gc.collect()
    assert not (tmp_path / "rank-00000").exists()


@pytest.mark.parametrize("replace", ["load_checkpoint", "load_full_optimizer_state_dict", "new"])
def test_replaced_optimizer_state_gives_its_files_back(tmp_path: Path, replace: str) -> None:
    torch.manual_seed(0)
    model = GPT()
    idx, targets = make_batch(0, GLOBAL_BATCH)
    store = tmp_path / "store"

    def files(rank: int) -> tuple[int, int]:
        found = list((store / f"rank-{rank:05d}").glob("*.bin"))
        return len(found), sum(f.stat().st_size for f in found)

    def fn(rank: int, pg: ProcessGroup) -> list[tuple[int, int]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg,
                          offload=Offload(device="disk", path=store))  # fmt: skip
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        seen = []
        for step in range(6):
            m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                save_checkpoint(tmp_path / "ckpt" / "step-0", m, opt)
                state = full_optimizer_state_dict(m, opt)
            if replace == "load_checkpoint":
                load_checkpoint(tmp_path / "ckpt", m, opt)
            elif replace == "load_full_optimizer_state_dict":
                load_full_optimizer_state_dict(m, opt, state)
            else:
                opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
                m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
                opt.step()
                opt.zero_grad()
            gc.collect()
            pg.barrier().wait()
            seen.append((*files(rank), len(os.listdir("/proc/self/fd"))))
            pg.barrier().wait()
        return seen

    for seen in run_ranks(2, fn, timeout=120):
        assert len({(n, size) for n, size, _ in seen[1:]}) == 1, seen
        assert max(fds for _, _, fds in seen) - min(fds for _, _, fds in seen) < 20, seen
