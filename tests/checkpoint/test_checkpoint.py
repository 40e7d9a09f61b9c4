"""Sharded checkpoints and consolidated export, against plain models trained without a break.

Proves that a checkpoint saved at world size 1, 2 or 4 under one ``auto_wrap`` policy loads at
any other world size and policy with its parameters, buffers and optimizer state (SGD
momentum, AdamW moments and step, hyperparameters, a scheduler in ``extra``), so that training
continues exactly (same world size: identical losses) or within 1e-5 (another world size);
that saves are atomic and prune only after completing; that missing, truncated, corrupt and
mismatched checkpoints raise errors naming what differs on every rank, before anything is
modified; and that ``export`` streams one flat group at a time into files that plain
``load_state_dict``, ``transformers`` ``from_pretrained`` and ``load_pretrained`` read. A save
SIGKILLed half-way, in a process of its own: ``tests/e2e/test_checkpoint.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint.py -q``
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
import shardwrap.checkpoint.load
from shardwrap import ShardedModule, export, load_checkpoint, load_pretrained, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from shardwrap.engine.shards.pool import BufferPool
from tests.support.models import GPT, Block, FrozenPart, WithBatchNorm, make_batch, tiny_gpt2_config
from tests.support.ranks import run_ranks

GLOBAL_BATCH = 8  # divisible by every world size tested

# helpers -----------------------------------------------------------------------------


def _group(pg: ProcessGroup) -> ProcessGroup | None:
    return pg if pg.size() > 1 else None


def _wrap(model: nn.Module, pg: ProcessGroup | None, auto_wrap: Any = Block, **options: Any) -> Any:
    group = _group(pg) if pg is not None else None
    return ShardedModule(copy.deepcopy(model), auto_wrap=auto_wrap, process_group=group, **options)


def _local(t: Tensor, pg: ProcessGroup) -> Tensor:
    return t.chunk(pg.size())[pg.rank()]


def _rank_mean(x: Tensor, pg: ProcessGroup) -> float:
    t = x.detach().clone()
    pg.allreduce([t]).wait()
    return t.item() / pg.size()


def _gpt(seed: int = 0, **kwargs: Any) -> GPT:
    torch.manual_seed(seed)
    return GPT(**kwargs)


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(model: nn.Module, lr: float = 1e-2) -> torch.optim.Optimizer:
    """AdamW with the usual two groups chosen by name: no weight decay on biases and norms."""
    named = list(model.named_parameters())
    flat = {n for n, _ in named if "bias" in n or "ln" in n}
    groups = [
        {"params": [p for n, p in named if n not in flat], "weight_decay": 0.1},
        {"params": [p for n, p in named if n in flat], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr)


def _train(
    model: nn.Module, opt: torch.optim.Optimizer, pg: ProcessGroup | None, steps: range
) -> list[float]:
    """Global loss per step; batch ``step`` of the global batches, each rank on its slice."""
    losses = []
    for step in steps:
        idx, targets = make_batch(step, GLOBAL_BATCH)
        if pg is not None:
            idx, targets = _local(idx, pg), _local(targets, pg)
        loss = model(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(_rank_mean(loss, pg) if pg is not None else loss.item())
    return losses


def _assert_close(got: dict[str, Tensor], expected: dict[str, Tensor], atol: float = 0.0) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0.0, msg=key)


def _saved(
    world_size: int,
    path: Path,
    model: nn.Module,
    auto_wrap: Any = Block,
    steps: int = 2,
    make_opt: Callable[[Any], torch.optim.Optimizer] = lambda m: _sgd(m.parameters()),
) -> None:
    """Train ``steps`` steps at ``world_size`` and save a checkpoint at ``path``."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap)
        opt = make_opt(m)
        _train(m, opt, pg, range(steps))
        save_checkpoint(path, m, opt, step=steps)

    run_ranks(world_size, fn)


# round trips -------------------------------------------------------------------------

CROSSED = [(s, d) for s in (1, 2, 4) for d in (1, 2, 4) if s != d]


@pytest.mark.parametrize(("save_ws", "load_ws"), CROSSED)
def test_sgd_round_trip_across_world_sizes_and_policies(
    tmp_path: Path, save_ws: int, load_ws: int
) -> None:
    """Save under one policy and world size, load under another, continue: parameter parity."""
    model = _gpt(tied=True)
    ref = copy.deepcopy(model)
    ref_opt = _sgd(ref.parameters())
    _train(ref, ref_opt, None, range(4))
    _saved(save_ws, tmp_path / "ckpt", model, auto_wrap=Block)
    other = _gpt(seed=1, tied=True)  # other weights: everything must come from the checkpoint

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(other, pg, auto_wrap=200 if load_ws > save_ws else None)
        opt = _sgd(m.parameters())
        assert load_checkpoint(tmp_path / "ckpt", m, opt) == {"step": 2}
        _train(m, opt, pg, range(2, 4))
        return m.full_state_dict()

    for state in run_ranks(load_ws, fn):
        _assert_close(state, ref.state_dict(), atol=1e-5)


@pytest.mark.parametrize("world_size", [1, 2])
def test_adamw_resume_reproduces_losses_exactly(tmp_path: Path, world_size: int) -> None:
    """Same world size: the resumed run's losses are bit-identical to the uninterrupted run's;
    hyperparameters, the scheduler in ``extra`` and each rank's RNG state come back too."""
    model, other = _gpt(), _gpt(seed=7)

    def run(rank: int, pg: ProcessGroup, resume: bool) -> list[float]:
        m = _wrap(model, pg)
        opt = _adamw(m)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        losses = []
        for step in range(6):
            if resume and step == 3:
                save_checkpoint(
                    tmp_path / "ckpt",
                    m,
                    opt,
                    scheduler=sched.state_dict(),
                    rng=torch.Generator().manual_seed(10 + rank).get_state(),
                )
                m = _wrap(other, pg)
                opt = _adamw(m, lr=0.5)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
                extra = load_checkpoint(tmp_path / "ckpt", m, opt)
                sched.load_state_dict(extra["scheduler"])
                assert torch.equal(
                    extra["rng"], torch.Generator().manual_seed(10 + rank).get_state()
                )
            losses += _train(m, opt, pg, range(step, step + 1))
            sched.step()
        return losses

    plain = run_ranks(world_size, lambda rank, pg: run(rank, pg, resume=False))
    resumed = run_ranks(world_size, lambda rank, pg: run(rank, pg, resume=True))
    assert resumed == plain


@pytest.mark.parametrize("load_ws", [1, 4])
def test_adamw_resume_at_another_world_size_within_1e5(tmp_path: Path, load_ws: int) -> None:
    model = _gpt()

    def uninterrupted(rank: int, pg: ProcessGroup) -> list[float]:
        m = _wrap(model, pg)
        return _train(m, _adamw(m), pg, range(6))

    expected = run_ranks(2, uninterrupted)[0]
    _saved(2, tmp_path / "ckpt", model, steps=3, make_opt=_adamw)
    other = _gpt(seed=3)

    def resumed(rank: int, pg: ProcessGroup) -> list[float]:
        m = _wrap(other, pg, auto_wrap=None)
        opt = _adamw(m, lr=1.0)
        load_checkpoint(tmp_path / "ckpt", m, opt)
        assert [g["lr"] for g in opt.param_groups] == [1e-2, 1e-2]
        assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
        return _train(m, opt, pg, range(3, 6))

    for losses in run_ranks(load_ws, resumed):
        assert losses == pytest.approx(expected[3:], abs=1e-5)


@pytest.mark.parametrize(
    ("model_fn", "auto_wrap"), [(WithBatchNorm, nn.BatchNorm1d), (FrozenPart, nn.Linear)]
)
def test_buffers_and_frozen_parameters_round_trip(
    tmp_path: Path, model_fn: Callable[[], nn.Module], auto_wrap: Any
) -> None:
    torch.manual_seed(0)
    model = model_fn()
    with torch.no_grad():  # buffers and frozen weights that differ from a fresh model's
        for t in [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]:
            t.add_(torch.rand_like(t))
    expected = model.state_dict()

    def save(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap)
        save_checkpoint(tmp_path / "ckpt", m, _sgd(m.parameters()))

    run_ranks(2, save)
    torch.manual_seed(1)
    fresh = model_fn()

    def load(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(fresh, pg, None)
        load_checkpoint(tmp_path / "ckpt", m)
        return m.full_state_dict()

    for state in run_ranks(4, load):
        _assert_close(state, expected)


def test_a_batchnorm_model_resumed_evaluates_on_every_rank_as_one_never_stopped(
    tmp_path: Path,
) -> None:
    """The checkpoint holds rank 0's running statistics; every rank holds them too after each
    step, so a run stopped after step 3 and resumed from its checkpoint trains and evaluates on
    every rank exactly as the run never stopped (before, the other ranks resumed with rank 0's
    statistics in place of their own, and their evaluations changed)."""
    torch.manual_seed(0)
    model = WithBatchNorm()
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(GLOBAL_BATCH, 13, generator=generator) * (1 + s) for s in range(6)]
    probe = torch.randn(GLOBAL_BATCH, 13, generator=generator)

    def steps(m: nn.Module, opt: torch.optim.Optimizer, pg: ProcessGroup, span: range) -> Tensor:
        for s in span:
            m.train()
            m(_local(batches[s], pg)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        m.eval()
        with torch.no_grad():
            return m(_local(probe, pg))

    def unbroken(rank: int, pg: ProcessGroup) -> Tensor:
        m = _wrap(model, pg, nn.BatchNorm1d)
        opt = _sgd(m.parameters())
        steps(m, opt, pg, range(3))
        save_checkpoint(tmp_path / "ckpt", m, opt)
        return steps(m, opt, pg, range(3, 6))

    def resumed(rank: int, pg: ProcessGroup) -> Tensor:
        torch.manual_seed(1)
        m = _wrap(WithBatchNorm(), pg, nn.BatchNorm1d)
        opt = _sgd(m.parameters())
        load_checkpoint(tmp_path / "ckpt", m, opt)
        return steps(m, opt, pg, range(3, 6))

    for expected, got in zip(run_ranks(2, unbroken), run_ranks(2, resumed), strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_layout_on_disk_is_keyed_by_name_and_range(tmp_path: Path) -> None:
    """Each rank file holds 1-D pieces; together they are each parameter, whatever the policy."""
    model = _gpt()
    _saved(4, tmp_path / "ckpt", model, steps=0)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    assert meta["world_size"] == 4 and sorted(meta["params"]) == sorted(
        n for n, _ in model.named_parameters()
    )
    for name, p in model.named_parameters():
        entry = meta["params"][name]
        assert entry["shape"] == list(p.shape) and entry["dtype"] == "float32"
        pieces = []
        for file, start, stop in entry["pieces"]:
            with safe_open(tmp_path / "ckpt" / file, framework="pt") as f:
                pieces.append(f.get_tensor(f"model/{name}"))
            assert pieces[-1].shape == (stop - start,)
        torch.testing.assert_close(torch.cat(pieces), p.detach().reshape(-1), rtol=0, atol=0)


def test_each_rank_opens_only_the_files_holding_its_pieces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same world size and policy: rank r reads rank r's file and no other."""
    _saved(2, tmp_path / "ckpt", _gpt(), make_opt=_adamw)
    opened: list[tuple[str, str]] = []
    real = shardwrap.checkpoint.load.safe_open

    def spy(path: Path, framework: str) -> Any:
        opened.append((threading.current_thread().name, Path(path).name))
        return real(path, framework=framework)

    monkeypatch.setattr(shardwrap.checkpoint.load, "safe_open", spy)
    other = _gpt(seed=1)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(other, pg)
        load_checkpoint(tmp_path / "ckpt", m, _adamw(m))

    run_ranks(2, fn)
    assert sorted(opened) == [
        ("rank0", "rank-00000-of-00002.safetensors"),
        ("rank1", "rank-00001-of-00002.safetensors"),
    ]


# atomicity ---------------------------------------------------------------------------


def test_keep_last_prunes_only_after_the_new_checkpoint_is_complete(tmp_path: Path) -> None:
    model = _gpt()
    m = _wrap(model, None)
    opt = _sgd(m.parameters())
    (tmp_path / ".step-9.partial").mkdir()  # left by a killed save
    for step in range(1, 4):
        _train(m, opt, None, range(step - 1, step))
        save_checkpoint(tmp_path / f"step-{step}", m, opt, keep_last=2, step=step)
        assert shardwrap.latest_checkpoint(tmp_path) == tmp_path / f"step-{step}"
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2", "step-3"]
    save_checkpoint(tmp_path / "step-3", m, opt, keep_last=2, step=33)  # replaces it
    assert sorted(os.listdir(tmp_path)) == ["latest", "step-2", "step-3"]
    assert load_checkpoint(tmp_path, _wrap(model, None), None) == {"step": 33}


def test_a_failed_save_leaves_the_previous_checkpoint_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _gpt()
    write = SafetensorsWriter.write

    def fail_on_rank_1(self: SafetensorsWriter, tensor: Tensor) -> None:
        if self.path.parent.name == ".step-2.partial" and self.path.name.startswith("rank-00001"):
            raise OSError("No space left on device")
        write(self, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", fail_on_rank_1)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = _sgd(m.parameters())
        _train(m, opt, pg, range(1))
        save_checkpoint(tmp_path / "step-1", m, opt, keep_last=1, step=1)
        expected = m.full_state_dict()
        _train(m, opt, pg, range(1, 2))
        error = (
            "No space left on device" if rank == 1 else r"save_checkpoint failed on rank\(s\) \[1\]"
        )
        with pytest.raises((OSError, RuntimeError), match=error):
            save_checkpoint(tmp_path / "step-2", m, opt, keep_last=1, step=2)
        fresh = _wrap(model, pg)
        assert load_checkpoint(tmp_path, fresh) == {"step": 1}
        _assert_close(fresh.full_state_dict(), expected)

    run_ranks(2, fn)
    assert shardwrap.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert not (tmp_path / "step-2").exists()


# errors ------------------------------------------------------------------------------


@pytest.fixture
def saved_sgd(tmp_path: Path) -> Path:
    """A checkpoint of ``_gpt()`` with SGD momentum, saved at world size 2."""
    _saved(2, tmp_path / "ckpt", _gpt())
    return tmp_path / "ckpt"


def _unchanged_after_error(
    path: Path, model: nn.Module, opt_fn: Callable[[Any], Any], error: type[Exception], match: str
) -> None:
    """Loading raises ``error`` matching ``match``; model and optimizer stay as they were."""
    m = _wrap(model, None, None)
    opt = opt_fn(m)
    if opt is not None:
        _train(m, opt, None, range(1))
    before, opt_before = m.full_state_dict(), copy.deepcopy(opt.state_dict()) if opt else None
    with pytest.raises(error, match=match):
        load_checkpoint(path, m, opt)
    _assert_close(m.full_state_dict(), before)
    if opt is not None:
        after = opt.state_dict()
        assert after["param_groups"] == opt_before["param_groups"]
        for i, state in opt_before["state"].items():
            _assert_close(after["state"][i], state)


def test_missing_checkpoint_and_missing_or_truncated_files(saved_sgd: Path, tmp_path: Path) -> None:
    model = _gpt()
    sgd = lambda m: _sgd(m.parameters())  # noqa: E731
    _unchanged_after_error(
        tmp_path / "nowhere", model, sgd, FileNotFoundError, "neither metadata.json nor a 'latest'"
    )
    broken = tmp_path / "broken"
    truncated = r" is \d+ bytes, the checkpoint recorded \d+: truncated"
    for name, error, match in [
        (
            "rank-00001-of-00002.safetensors",
            FileNotFoundError,
            "rank-00001-of-00002.safetensors is missing",
        ),
        (
            "rank-00001-of-00002.safetensors",
            ValueError,
            "rank-00001-of-00002.safetensors" + truncated,
        ),
        ("optimizer.pt", FileNotFoundError, "optimizer.pt is missing"),
        ("optimizer.pt", ValueError, "optimizer.pt" + truncated),
        ("extra-00000.pt", ValueError, "extra-00000.pt fails its checksum"),
        ("metadata.json", ValueError, "metadata.json is corrupt"),
    ]:
        shutil.rmtree(broken, ignore_errors=True)
        shutil.copytree(saved_sgd, broken)
        if error is FileNotFoundError:
            (broken / name).unlink()
        else:
            data = (broken / name).read_bytes()
            (broken / name).write_bytes(data[: len(data) - 9])
        _unchanged_after_error(broken, model, sgd, error, match)


def test_wrong_model_names_every_difference(saved_sgd: Path) -> None:
    cases = [
        (
            _gpt(width=48, heads=4),
            r"of another shape: 'wte.weight': checkpoint \(67, 36\), model \(67, 48",
        ),
        (_gpt(depth=2), r"parameters not in the model: 'blocks.2.ln_1.weight'"),
        (_gpt(depth=4), r"parameters missing from the checkpoint: 'blocks.3.ln_1.weight'"),
        (
            WithBatchNorm(),
            r"missing from the checkpoint: 'net.0.weight'.*buffers missing.*running_mean",
        ),
    ]
    for model, match in cases:
        _unchanged_after_error(saved_sgd, model, lambda m: None, ValueError, match)


def test_optimizer_mismatch_is_named(saved_sgd: Path, tmp_path: Path) -> None:
    model = _gpt()
    _unchanged_after_error(
        saved_sgd,
        model,
        lambda m: torch.optim.AdamW(m.parameters()),
        ValueError,
        "optimizer mismatch: the checkpoint holds SGD state, got AdamW",
    )
    _unchanged_after_error(
        saved_sgd,
        model,
        _sgd_two_groups,
        ValueError,
        "the checkpoint has 1 parameter groups, the optimizer 2",
    )
    _unchanged_after_error(
        saved_sgd,
        model,
        _sgd_without_head,
        ValueError,
        "optimizer mismatch in parameter group 0: only in the checkpoint 'lm_head.weight'",
    )
    m = _wrap(model, None)
    save_checkpoint(tmp_path / "no-opt", m)
    _unchanged_after_error(
        tmp_path / "no-opt",
        model,
        lambda m: _sgd(m.parameters()),
        ValueError,
        "saved without an optimizer",
    )


def _sgd_two_groups(m: nn.Module) -> torch.optim.Optimizer:
    named = list(m.named_parameters())
    return _sgd([{"params": [p for _, p in named[:3]]}, {"params": [p for _, p in named[3:]]}])


def _sgd_without_head(m: nn.Module) -> torch.optim.Optimizer:
    return _sgd([p for n, p in m.named_parameters() if n != "lm_head.weight"])


def test_failure_on_one_rank_raises_on_every_rank(saved_sgd: Path) -> None:
    (saved_sgd / "rank-00001-of-00002.safetensors").unlink()
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        before = m.full_state_dict()
        with pytest.raises((FileNotFoundError, RuntimeError)) as info:
            load_checkpoint(saved_sgd, m)
        _assert_close(m.full_state_dict(), before)
        if rank == 0:  # its pieces are all in rank 0's file: it learns of the failure from rank 1
            assert "load_checkpoint failed on rank(s) [1]" in str(info.value)
        else:
            assert "rank-00001-of-00002.safetensors is missing" in str(info.value)

    run_ranks(2, fn)


def test_optimizer_state_that_is_not_elementwise_is_refused_before_writing(tmp_path: Path) -> None:
    m = _wrap(_gpt(), None)
    opt = _sgd(m.parameters())
    opt.state[m.wte.weight]["preconditioner"] = torch.eye(3)
    with pytest.raises(
        ValueError, match="'preconditioner' of 'wte.weight' is a Tensor of shape \\(3, 3\\)"
    ):
        save_checkpoint(tmp_path / "ckpt", m, opt)
    assert list(tmp_path.iterdir()) == []


# export ------------------------------------------------------------------------------


@pytest.mark.stage3
@pytest.mark.parametrize("world_size", [1, 2])
def test_export_loads_into_the_plain_model_one_group_at_a_time(
    tmp_path: Path, world_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _gpt(tied=True)
    model.register_buffer("stat", torch.arange(5.0))
    ref = copy.deepcopy(model)
    _train(ref, _sgd(ref.parameters()), None, range(2))
    write, take, give = SafetensorsWriter.write, BufferPool.take, BufferPool.give
    live: set[int] = set()  # flat groups with a full buffer taken and not yet given back
    rank0_groups: set[int] = set()
    gathered: list[int] = []  # at each write (rank 0's), how many of its flat groups are gathered

    def spy_take(self: BufferPool, *args: Any) -> Tensor:
        live.add(id(args[-1]))  # the group gathered into the buffer
        return take(self, *args)

    def spy_give(self: BufferPool, buf: Tensor, *args: Any, **kwargs: Any) -> None:
        live.discard(id(self.holder[buf.data_ptr()]))
        give(self, buf, *args, **kwargs)

    def spy_write(self: SafetensorsWriter, tensor: Tensor) -> None:
        gathered.append(len(live & rank0_groups))
        write(self, tensor)

    monkeypatch.setattr(BufferPool, "take", spy_take)
    monkeypatch.setattr(BufferPool, "give", spy_give)
    monkeypatch.setattr(SafetensorsWriter, "write", spy_write)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        _train(m, _sgd(m.parameters()), pg, range(2))
        if rank == 0:
            rank0_groups.update(id(g) for u in m._shardwrap_root.units for g in u.groups)
        export(tmp_path / "export", m)

    run_ranks(world_size, fn)
    assert len(rank0_groups) > 2 and max(gathered) == 1  # one flat group gathered at a time
    plain = GPT(tied=True)
    plain.register_buffer("stat", torch.zeros(5))
    plain.load_state_dict(load_file(tmp_path / "export" / "model.safetensors"))
    _assert_close(plain.state_dict(), ref.state_dict(), atol=1e-5)


def test_sharded_export_with_index_and_load_pretrained_at_another_world_size(
    tmp_path: Path,
) -> None:
    model = _gpt()

    def save(rank: int, pg: ProcessGroup) -> None:
        export(tmp_path / "export", _wrap(model, pg), max_shard_size="20KB")

    run_ranks(2, save)
    files = sorted(f.name for f in (tmp_path / "export").iterdir())
    index = json.loads((tmp_path / "export" / "model.safetensors.index.json").read_text())
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(set(index["weight_map"].values())) == shards
    assert list(index["weight_map"]) == sorted(model.state_dict())
    assert index["metadata"]["total_size"] == sum(v.nbytes for v in model.state_dict().values())
    combined: dict[str, Tensor] = {}
    for f in shards:
        assert (tmp_path / "export" / f).stat().st_size < 20_000 + 2_000  # limit plus one header
        combined |= load_file(tmp_path / "export" / f)
    _assert_close(dict(sorted(combined.items())), dict(sorted(model.state_dict().items())))

    def load(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        # built on each rank from a shared global seed: weights alike only by luck, loaded next
        m = _wrap(_gpt(seed=2), pg, auto_wrap=None, sync_module_states=False)
        load_pretrained(tmp_path / "export", m)
        return m.full_state_dict()

    for state in run_ranks(4, load):
        _assert_close(state, model.state_dict())
    with pytest.raises(
        ValueError, match="shape mismatch: 'wte.weight': file \\(67, 36\\), model \\(67, 48\\)"
    ):
        load_pretrained(tmp_path / "export", _wrap(_gpt(width=48, heads=4), None))
    with pytest.raises(ValueError, match="not in the model: 'blocks.2.attn.proj.bias'"):
        load_pretrained(tmp_path / "export", _wrap(_gpt(depth=2), None))
    load_pretrained(tmp_path / "export", _wrap(_gpt(depth=2), None), strict=False)
    (tmp_path / "export" / shards[-1]).unlink()
    with pytest.raises(FileNotFoundError, match=f"{shards[-1]} is missing"):
        load_pretrained(tmp_path / "export", _wrap(model, None))


def test_export_of_a_transformers_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = tiny_gpt2_config(bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    idx, _ = make_batch(0, GLOBAL_BATCH)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap=GPT2Block)
        opt = _sgd(m.parameters())
        loss = m(input_ids=_local(idx, pg), labels=_local(idx, pg)).loss
        loss.backward()
        opt.step()
        export(tmp_path / "export", m)

    run_ranks(2, fn)
    ref = copy.deepcopy(model)
    ref_opt = _sgd(ref.parameters())
    ref(input_ids=idx, labels=idx).loss.backward()
    ref_opt.step()
    ref.save_pretrained(tmp_path / "hf")
    with safe_open(tmp_path / "hf" / "model.safetensors", framework="pt") as f:
        hf_keys = sorted(f.keys())
    assert "lm_head.weight" not in hf_keys  # tied to the embedding: HF leaves it out
    with safe_open(tmp_path / "export" / "model.safetensors", framework="pt") as f:
        assert sorted(f.keys()) == hf_keys
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx).logits, ref.eval()(idx).logits, atol=1e-5, rtol=0)

    def load(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(GPT2LMHeadModel(config), pg, auto_wrap=GPT2Block, sync_module_states=False)
        load_pretrained(tmp_path / "hf", m)  # a save_pretrained folder, tied key absent
        return m.full_state_dict()

    for state in run_ranks(2, load):
        _assert_close(state, ref.state_dict(), atol=1e-6)
