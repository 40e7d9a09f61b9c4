"""Non-blocking checkpoint saves (``save_checkpoint(..., blocking=False)``).

Proves that what a non-blocking save writes is the state at the call while training goes on
(the writer is held back until two more steps have changed every parameter and the AdamW
state): a fresh model and optimizer loading it equal exactly those loading a blocking save
made at the same moment, at every stage (the suite's ``--stage``); that a write failing on
one rank raises on every rank from ``wait()``, or else from the next save, leaving ``latest``
and the previous checkpoint as they were; that where ``wait()`` raised it on one rank only, the
next save raises on every rank and the ranks stay in step; that a save whose writer group or
thread cannot be made on one rank raises on every rank at the call; and that a second save
waits for the first. A rank killed during a background write: ``tests/e2e/test_faults.py``; a
program ending while a save is written: ``tests/e2e/test_save_at_exit.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_background.py``
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.checkpoint.background import PendingSave
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def _wrap(model: nn.Module, pg: ProcessGroup) -> Any:
    return ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)


def _adamw(m: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)


def _train(m: nn.Module, opt: torch.optim.Optimizer, pg: ProcessGroup, steps: range) -> None:
    for step in steps:
        idx, targets = make_batch(step, 4)
        m(idx.chunk(2)[pg.rank()], targets.chunk(2)[pg.rank()]).backward()
        opt.step()
        opt.zero_grad()


def _opt_state(opt: torch.optim.Optimizer) -> dict[str, Any]:
    return opt.state_dict()["state"]


@pytest.fixture
def held_writers(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Background writers wait for the returned event before writing any tensor."""
    release = threading.Event()
    write = SafetensorsWriter.write

    def held(self: SafetensorsWriter, tensor: Tensor) -> None:
        if threading.current_thread().name.startswith("shardwrap save"):
            assert release.wait(30), "the test never released the writers"
        write(self, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", held)
    yield release
    release.set()


def test_what_is_saved_is_the_state_at_the_call(
    tmp_path: Path, held_writers: threading.Event
) -> None:
    torch.manual_seed(0)
    model, other = GPT(depth=2), GPT(depth=2)
    trained = threading.Barrier(2)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = _adamw(m)
        _train(m, opt, pg, range(2))
        save_checkpoint(tmp_path / "blocking", m, opt, step=2)
        pending = save_checkpoint(tmp_path / "background", m, opt, blocking=False, step=2)
        assert isinstance(pending, PendingSave) and not pending.done()
        at_call = m.full_state_dict()
        _train(m, opt, pg, range(2, 4))  # changes every parameter and all of AdamW's state
        trained.wait(30)
        held_writers.set()
        assert pending.wait(30) == tmp_path / "background" and pending.done()
        moved = m.full_state_dict()
        assert all(not torch.equal(moved[k], v) for k, v in at_call.items() if "weight" in k)
        loaded = {}
        for name in ("blocking", "background"):
            fresh = _wrap(other, pg)
            fresh_opt = _adamw(fresh)
            assert load_checkpoint(tmp_path / name, fresh, fresh_opt) == {"step": 2}
            loaded[name] = (fresh.full_state_dict(), _opt_state(fresh_opt))
        params, state = loaded["background"]
        torch.testing.assert_close(params, at_call, atol=0, rtol=0)
        torch.testing.assert_close(params, loaded["blocking"][0], atol=0, rtol=0)
        torch.testing.assert_close(state, loaded["blocking"][1], atol=0, rtol=0)
        assert all(float(s["step"]) == 2 for s in state.values())
        assert all(s["exp_avg"].abs().sum() > 0 for s in state.values() if s["exp_avg"].numel())

    run_ranks(2, fn)
    assert shardwrap.latest_checkpoint(tmp_path) == tmp_path / "background"


def _fail_on_rank_1(monkeypatch: pytest.MonkeyPatch, folder: str) -> None:
    write = SafetensorsWriter.write

    def fail(self: SafetensorsWriter, tensor: Tensor) -> None:
        if self.path.parent.name == folder and self.path.name.startswith("rank-00001"):
            raise OSError("No space left on device")
        write(self, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", fail)


@pytest.mark.parametrize("raised_by", ["wait", "next save"])
def test_a_failed_background_write_raises_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, raised_by: str
) -> None:
    """From ``wait()``, or else from the next save (which then saves nothing); the previous
    checkpoint and ``latest`` stay, nothing of the failed one is left, the save after works."""
    _fail_on_rank_1(monkeypatch, ".step-2.partial")
    torch.manual_seed(0)
    model = GPT(depth=2)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = _adamw(m)
        _train(m, opt, pg, range(1))
        save_checkpoint(tmp_path / "step-1", m, opt, blocking=False, step=1).wait()
        expected = m.full_state_dict()
        _train(m, opt, pg, range(1, 2))
        pending = save_checkpoint(tmp_path / "step-2", m, opt, blocking=False, step=2)
        error = "No space left on device" if rank == 1 else r"failed on rank\(s\) \[1\]"
        with pytest.raises((OSError, RuntimeError), match=error):
            if raised_by == "wait":
                pending.wait()
            else:
                save_checkpoint(tmp_path / "step-3", m, opt, blocking=False, step=3)
        assert pending.done()
        fresh = _wrap(model, pg)
        assert load_checkpoint(tmp_path, fresh) == {"step": 1}
        torch.testing.assert_close(fresh.full_state_dict(), expected, atol=0, rtol=0)
        save_checkpoint(tmp_path / "step-4", m, opt, blocking=False, step=4).wait()

    run_ranks(2, fn)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-4"]


def test_a_second_save_waits_for_the_first_at_world_size_1(
    tmp_path: Path, held_writers: threading.Event
) -> None:
    """World size 1 is the same path; ``keep_last`` prunes once the second is complete."""
    torch.manual_seed(0)
    m = ShardedModule(GPT(depth=2), auto_wrap=Block)
    opt = _adamw(m)
    first = save_checkpoint(tmp_path / "step-1", m, opt, blocking=False, keep_last=1, step=1)
    threading.Timer(0.2, held_writers.set).start()
    second = save_checkpoint(tmp_path / "step-2", m, opt, blocking=False, keep_last=1, step=2)
    assert first.done() and first.wait() == tmp_path / "step-1"
    assert second.wait() == tmp_path / "step-2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2"]
    assert load_checkpoint(tmp_path, m, opt) == {"step": 2}


def test_a_load_waits_for_the_save_in_flight(tmp_path: Path, held_writers: threading.Event) -> None:
    """A load right after a non-blocking save reads that save, not the one before it."""
    torch.manual_seed(0)
    m = ShardedModule(GPT(depth=2), auto_wrap=Block)
    opt = _adamw(m)
    save_checkpoint(tmp_path / "step-1", m, opt, step=1)
    pending = save_checkpoint(tmp_path / "step-2", m, opt, blocking=False, step=2)
    threading.Timer(0.2, held_writers.set).start()
    assert load_checkpoint(tmp_path, m, opt) == {"step": 2}
    assert pending.done()


def test_a_failure_waited_for_on_one_rank_only_raises_at_the_next_save_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0 alone calls ``wait()`` after a failed write: the next save raises on both ranks
    (rank 1 the write's own error, rank 0 naming rank 1) and writes nothing; the ranks stay in
    step, and the save after that works."""
    _fail_on_rank_1(monkeypatch, ".step-2.partial")
    torch.manual_seed(0)
    model = GPT(depth=2)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = _adamw(m)
        save_checkpoint(tmp_path / "step-1", m, opt, step=1)
        pending = save_checkpoint(tmp_path / "step-2", m, opt, blocking=False, step=2)
        if rank == 0:
            with pytest.raises(RuntimeError, match=r"failed on rank\(s\) \[1\]"):
                pending.wait()
        error = "No space left on device" if rank == 1 else r"but not on rank\(s\) \[1\]"
        with pytest.raises((OSError, RuntimeError), match=error):
            save_checkpoint(tmp_path / "step-3", m, opt, blocking=False, step=3)
        _train(m, opt, pg, range(1))  # the ranks' collectives still pair up
        save_checkpoint(tmp_path / "step-4", m, opt, blocking=False, step=4).wait()

    run_ranks(2, fn, timeout=60.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1", "step-4"]


@pytest.mark.parametrize("part", ["writer group", "writer thread"])
def test_a_save_that_cannot_start_on_one_rank_raises_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, part: str
) -> None:
    """Out of memory on rank 1 while it makes the writers' group or thread: every rank raises
    at the call, nothing is written, and the next save makes them again and works."""
    failing = [True]

    def fail_to_start() -> None:  # once every rank has its own process group
        if part == "writer group":
            make = dist.ProcessGroupGloo

            def made(*args: Any, **kwargs: Any) -> Any:
                backend = make(*args, **kwargs)  # every rank rendezvoused: the others have theirs
                if failing[0] and threading.current_thread().name == "rank1":
                    raise MemoryError("simulated: cannot allocate the writer group")
                return backend

            made._Options = make._Options  # type: ignore[attr-defined]
            made.create_default_device = make.create_default_device  # type: ignore[attr-defined]
            monkeypatch.setattr(dist, "ProcessGroupGloo", made)
        else:
            start = threading.Thread.start

            def started(self: threading.Thread) -> None:
                if failing[0] and threading.current_thread().name == "rank1":
                    if self.name.startswith("shardwrap save"):
                        raise RuntimeError("can't start new thread")
                start(self)

            monkeypatch.setattr(threading.Thread, "start", started)

    torch.manual_seed(0)
    model = GPT(depth=2)
    failed = threading.Barrier(2)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg)
        opt = _adamw(m)
        if failed.wait(30) == 0:
            fail_to_start()
        failed.wait(30)
        error = "simulated|can't start" if rank == 1 else r"failed on rank\(s\) \[1\]"
        with pytest.raises((MemoryError, RuntimeError), match=error):
            save_checkpoint(tmp_path / "step-1", m, opt, blocking=False, step=1)
        if failed.wait(30) == 0:
            failing[0] = False
        failed.wait(30)
        save_checkpoint(tmp_path / "step-2", m, opt, blocking=False, step=2).wait()

    run_ranks(2, fn, timeout=60.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2"]
