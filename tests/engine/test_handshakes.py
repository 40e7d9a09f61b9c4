"""Handshakes per step: a forward agrees on its gathers once, and a backward that gathers
nothing agrees once, at its end (``engine/step/schedule.py``).

Proves at 2 ranks:

- once a forward has run, each later forward makes two handshakes (its first gather, which
  carries the last pass's gathers as the plan, and its end) however many units it gathers;
- a rank that leaves a planned forward part-way (an exception caught, its loop gone on to the
  next batch) first issues what the plan still held, so the other rank, still in that pass,
  is not left waiting: both raise at their next handshake, naming the pass each is in, well
  within the run's timeout; a step begun alike afterwards trains normally;
- at stage 2 a rank whose backward raised part-way (its peer's went on, issuing reductions
  without handshakes) issues the reductions it still owed before going on: both raise at
  their next handshake, naming their passes, and a step begun alike afterwards trains
  normally, both ranks holding the same model.

How many handshakes each stage's backward makes: ``tests/engine/test_stages.py``. Training like
the plain model with these (every step after the first has a plan): the parity tests
(``tests/engine/test_parity.py``, ``test_stages.py``); modules some ranks skip, modules called
twice and recomputation: ``test_autograd_cases.py``, ``test_checkpoint_activations.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_handshakes.py -q``
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def _step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> float:
    idx, targets = make_batch(step, 4)
    loss = model(idx.chunk(2)[rank], targets.chunk(2)[rank])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


@pytest.mark.parametrize("bucket_mb", [0, 4])
def test_each_forward_after_the_first_makes_two_handshakes(bucket_mb: float) -> None:
    torch.manual_seed(0)
    model = GPT(depth=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[int], int]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, process_group=pg, bucket_mb=bucket_mb
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        forward_handshakes = []
        for step in range(4):
            idx, targets = make_batch(step, 4)
            m.comm_stats.reset()
            loss = m(idx.chunk(2)[rank], targets.chunk(2)[rank])
            forward_handshakes.append(m.comm_stats.calls.get("handshake", 0))
            loss.backward()
            opt.step()
            opt.zero_grad()
        return forward_handshakes, len(m._shardwrap_root.units)

    for handshakes, units in run_ranks(2, fn, timeout=30.0):
        # The first forward agrees on each of its gathers (every unit; with buckets, one that
        # brings the units after it, here all of them), then on its end.
        assert handshakes == [units + 1 if bucket_mb == 0 else 2, 2, 2, 2]


@pytest.mark.stage3  # what a forward issues is the same at every stage
def test_a_rank_that_leaves_a_planned_forward_part_way_does_not_hang_its_peer() -> None:
    torch.manual_seed(0)
    model = GPT(depth=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, dict[str, torch.Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):  # the second step runs with a plan
            _step(m, opt, step, rank)
        if rank == 0:

            def out_of_memory(module: nn.Module, args: object) -> None:
                raise torch.OutOfMemoryError("simulated: out of memory")

            handle = m.blocks[1].register_forward_pre_hook(out_of_memory)
            with pytest.raises(torch.OutOfMemoryError):
                _step(m, opt, 2, rank)
            handle.remove()
        with pytest.raises(RuntimeError, match="ranks are at different steps or calls") as info:
            _step(m, opt, 3, rank)
        opt.zero_grad()
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks stopped: begin again alike
        _step(m, opt, 4, rank)
        return str(info.value), m.full_state_dict()

    (msg0, state0), (msg1, state1) = run_ranks(2, fn, timeout=30.0)
    assert msg0 == msg1
    assert "rank 0: forward pass 4, " in msg0 and "rank 1: forward pass 3, " in msg0
    torch.testing.assert_close(state0, state1, atol=0, rtol=0)


@pytest.mark.stage3  # names its stage
def test_a_rank_whose_backward_raised_owes_its_peer_no_reduction() -> None:
    torch.manual_seed(0)
    model = GPT(depth=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, dict[str, torch.Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=2)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(2):
            _step(m, opt, step, rank)
        if rank == 0:

            def raise_in_backward(grad: torch.Tensor) -> None:
                raise RuntimeError("simulated: a hook failed in backward")

            def hook_output(module: nn.Module, args: object, out: torch.Tensor) -> None:
                out.register_hook(raise_in_backward)

            handle = m.blocks[1].register_forward_hook(hook_output)
            with pytest.raises(RuntimeError, match="simulated"):
                _step(m, opt, 2, rank)
            handle.remove()
            opt.zero_grad()
        with pytest.raises(RuntimeError, match="ranks are at different steps or calls") as info:
            _step(m, opt, 3 - rank, rank)  # rank 1's step 2 is still under way
        opt.zero_grad()
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks stopped: begin again alike
        _step(m, opt, 4, rank)
        return str(info.value), m.full_state_dict()

    (msg0, state0), (msg1, state1) = run_ranks(2, fn, timeout=30.0)
    assert msg0 == msg1
    assert "rank 0: forward pass 4, " in msg0 and "rank 1: forward pass 3, " in msg0
    torch.testing.assert_close(state0, state1, atol=0, rtol=0)
