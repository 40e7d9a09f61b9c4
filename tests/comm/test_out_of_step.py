"""Ranks at different calls or steps raise on every rank, naming what each was doing.

Every collective shardwrap issues is preceded by a handshake carrying the forward-pass count and
the call being made (training, a save, a load, an export, a full state dict, ``gathered()``, a
gradient norm, a loss scaler's inf/NaN check). Proves at 2 ranks, each case finishing well within
the run's timeout (no hang):

- a rank saving after two steps while the other runs a third: both raise, naming "calling
  save_checkpoint" and the other's gather, at their forward-pass counts;
- one more forward and backward on one rank before ``clip_grad_norm_``: both raise;
- the same pass, different calls (``full_state_dict`` against ``clip_grad_norm_``): both raise;
- a rank that skipped its batch's step begins the next pass while the other's loss scaler checks
  its gradients for inf/NaN: both raise;
- afterwards, a step begun alike on both ranks trains normally and both hold the same model;
- a rank that stops answering: the other raises ``CollectiveFailed`` once the process group's
  timeout has passed (and well before the run's own limit), naming the collective.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_out_of_step.py -q``
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwrap import CollectiveFailed, ShardedModule, save_checkpoint
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> None:
    idx, targets = make_batch(step, 4)
    model(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
    opt.step()
    opt.zero_grad()


def _out_of_step(
    diverge: Callable[[int, nn.Module, torch.optim.Optimizer], None],
) -> list[tuple[str, dict[str, torch.Tensor]]]:
    """Two steps alike, then ``diverge``; then one step begun alike on both ranks."""
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, dict[str, torch.Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            _step(m, opt, step, rank)
        with pytest.raises(RuntimeError, match="ranks are at different steps or calls") as info:
            diverge(rank, m, opt)
        opt.zero_grad()
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks stopped: begin again alike
        _step(m, opt, 5, rank)
        return str(info.value), m.full_state_dict()

    results = run_ranks(2, fn, timeout=30.0)
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
    return results


def test_a_save_against_a_third_step(tmp_path: Path) -> None:
    def diverge(rank: int, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        if rank == 1:
            save_checkpoint(tmp_path / "ckpt", m, opt)
        else:
            _step(m, opt, 2, rank)

    for message, _ in _out_of_step(diverge):
        assert "rank 0: forward pass 3, gathering unit" in message
        assert "rank 1: forward pass 2, calling save_checkpoint" in message


def test_one_more_forward_and_backward_before_clipping() -> None:
    def diverge(rank: int, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        idx, targets = make_batch(2, 4)
        m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
        if rank == 1:
            m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
        m.clip_grad_norm_(1.0)
        if rank == 1:  # rank 0 raised in its clip; rank 1 clips after its extra backward
            raise AssertionError("rank 1 should have raised in its extra pass")

    for message, _ in _out_of_step(diverge):
        assert "rank 0: forward pass 3, calling a gradient norm" in message
        assert "rank 1: forward pass 4, " in message


def test_the_same_pass_at_different_calls() -> None:
    def diverge(rank: int, m: Any, opt: torch.optim.Optimizer) -> None:
        idx, targets = make_batch(2, 4)
        m(idx.chunk(2)[rank], targets.chunk(2)[rank]).backward()
        if rank == 0:
            m.full_state_dict()
        else:
            m.clip_grad_norm_(1.0)

    for message, _ in _out_of_step(diverge):
        assert "rank 0: forward pass 3, calling full_state_dict" in message
        assert "rank 1: forward pass 3, calling a gradient norm" in message


def test_a_skipped_step_against_the_loss_scalers_check() -> None:
    def diverge(rank: int, m: nn.Module, opt: torch.optim.Optimizer) -> None:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0)
        idx, targets = make_batch(2, 4)
        scaler.scale(m(idx.chunk(2)[rank], targets.chunk(2)[rank])).backward()
        if rank == 0:  # as after an out-of-memory error caught: on to the next batch
            opt.zero_grad()
            _step(m, opt, 3, rank)
        else:
            scaler.step(opt)

    for message, _ in _out_of_step(diverge):
        assert "rank 0: forward pass 4, gathering unit" in message
        assert "rank 1: forward pass 3, calling the loss scaler's inf/NaN check" in message


@pytest.mark.stage3  # a timeout, whatever the stage
def test_a_rank_that_stops_answering_is_reported_within_the_timeout() -> None:
    torch.manual_seed(0)
    model = GPT()
    release = threading.Event()

    def fn(rank: int, pg: ProcessGroup) -> float:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        _step(m, opt, 0, rank)
        if rank == 1:
            release.wait(20)  # stalled until rank 0 has given up
            return 0.0
        start = time.monotonic()
        try:
            with pytest.raises(CollectiveFailed, match="the handshake did not complete"):
                _step(m, opt, 1, rank)
        finally:
            release.set()
        return time.monotonic() - start

    # The groups' timeout is 4 s; run_ranks itself fails a run still going after 8 s.
    took = run_ranks(2, fn, timeout=8.0)[0]
    assert took > 3.0  # it waited for the timeout rather than failing at once
