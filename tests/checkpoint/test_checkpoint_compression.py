"""Checkpoints of compressed training keep error feedback's residuals, so a resume is exact.

Proves that a run with ``Compression(grads="int8")`` (error feedback on, as by default), saved
after 3 steps and loaded into a fresh model with other weights, trains the next 3 steps bit for
bit as the uninterrupted run does (every loss and parameter equal), at 2 ranks with a blocking
and a non-blocking save, and with hybrid sharding (2 x 2: the replicas' all-reduce residuals
too); before they were saved, the resumed run departed at its first step. Loaded at another
world size, the residuals start at zero, with a warning that says so, and training goes on.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_compression.py``
"""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import Compression, ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.checkpoint.files import SafetensorsWriter
from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

COMPRESSION = Compression(grads="int8")
SAVED_AT, STEPS = 3, 6

torch.manual_seed(0)
MODEL, OTHER = GPT(depth=2), GPT(depth=2)  # OTHER: weights nothing may be left of


def _wrap(model: nn.Module, group: Any) -> ShardedModule:
    return ShardedModule(
        copy.deepcopy(model), auto_wrap=Block, process_group=group, compression=COMPRESSION
    )


def _train(
    m: nn.Module, opt: torch.optim.Optimizer, pg: ProcessGroup, steps: range
) -> list[Tensor]:
    losses = []
    for step in steps:
        idx, targets = make_batch(step, 2 * pg.size())
        loss = m(idx.chunk(pg.size())[pg.rank()], targets.chunk(pg.size())[pg.rank()])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses


@pytest.mark.parametrize(
    ("world", "hybrid", "blocking"),
    [(2, False, True), (2, False, False), (4, True, True)],
    ids=["2-blocking", "2-background", "hybrid-2x2"],
)
def test_a_compressed_run_resumes_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, world: int, hybrid: bool, blocking: bool
) -> None:
    """A background save's writers are held until training has changed the residuals: what
    it writes is their state at the call."""
    trained, write = threading.Barrier(world), SafetensorsWriter.write

    def held(self: SafetensorsWriter, tensor: Tensor) -> None:
        if threading.current_thread().name.startswith("shardwrap save"):
            assert release.wait(30), "the test never released the writers"
        write(self, tensor)

    release = threading.Event()
    monkeypatch.setattr(SafetensorsWriter, "write", held)

    def fn(rank: int, pg: ProcessGroup) -> None:
        group = hybrid_mesh(pg) if hybrid else pg  # one mesh for both models: its groups
        m = _wrap(MODEL, group)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _train(m, opt, pg, range(SAVED_AT))
        reductions = m._shardwrap_root.reductions
        assert any(r is not None and r.abs().sum() > 0 for r in reductions.residuals)
        if hybrid:
            assert any(r is not None for r in reductions.replica_residuals)
        saved = save_checkpoint(tmp_path / "ckpt", m, opt, blocking=blocking)
        on = _train(m, opt, pg, range(SAVED_AT, STEPS))
        trained.wait(30)
        release.set()
        if not isinstance(saved, Path):
            saved.wait()
        resumed = _wrap(OTHER, group)
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        load_checkpoint(tmp_path / "ckpt", resumed, resumed_opt)
        again = _train(resumed, resumed_opt, pg, range(SAVED_AT, STEPS))
        assert [float(x) for x in again] == [float(x) for x in on]
        torch.testing.assert_close(resumed.full_state_dict(), m.full_state_dict(), atol=0, rtol=0)

    run_ranks(world, fn, timeout=120.0)


def test_at_another_world_size_the_residuals_start_at_zero_and_say_so(tmp_path: Path) -> None:
    def save(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(MODEL, pg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _train(m, opt, pg, range(SAVED_AT))
        save_checkpoint(tmp_path / "ckpt", m, opt)

    def resume(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(OTHER, pg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
        _train(m, opt, pg, range(1))  # residuals of this run's own, which the load drops
        load_checkpoint(tmp_path / "ckpt", m, opt)
        assert all(r is None for r in m._shardwrap_root.reductions.residuals)
        _train(m, opt, pg, range(SAVED_AT, STEPS))

    run_ranks(2, save)
    with pytest.warns(UserWarning, match=r"saved at shard size 2 x replicate 1 .* shard size 4 .*"
                      r"start at zero") as record:  # fmt: skip
        run_ranks(4, resume)
    assert len([w for w in record if "residuals" in str(w.message)]) == 1  # rank 0 says it
