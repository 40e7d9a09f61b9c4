"""A rank that catches an exception and skips its batch: detected, raised on every rank.

The usual recovery from running out of memory, ``except torch.OutOfMemoryError: continue``,
taken on one rank only, would leave that rank one step ahead of the others, pairing its next
step's collectives with their current ones: a hang, or worse. Proves, on Llama from a tiny
config at 2 ranks, rank 0 running out of memory in a layer's forward at step 1 and skipping:

- both ranks raise within the step, each naming what every rank was doing (forward pass and
  unit) and how to skip a batch safely;
- once both ranks begin the next step alike, training goes on in parity with the unwrapped
  model trained on the batches both ranks completed (0 and 3), so nothing of the abandoned
  steps leaked into the model.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_desync.py -q``
"""

from __future__ import annotations

import copy
import re
from typing import Any

import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from shardwrap import ShardedModule
from tests.support.models import HF_VOCAB, tiny_llama_config
from tests.support.ranks import run_ranks

WORLD, GLOBAL_BATCH, LENGTH = 2, 4, 10


def _batch(step: int) -> Tensor:
    g = torch.Generator().manual_seed(step)
    return torch.randint(2, HF_VOCAB, (GLOBAL_BATCH, LENGTH), generator=g)


def _step(model: nn.Module, opt: torch.optim.Optimizer, ids: Tensor) -> None:
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    opt.zero_grad()


def test_one_rank_skipping_its_batch_raises_on_every_rank_then_training_goes_on() -> None:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(tiny_llama_config())
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in (0, 3):
        _step(ref, ref_opt, _batch(step))

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Any], dict[str, Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=LlamaDecoderLayer, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        calls = {"n": 0}

        def run_out_of_memory(module: nn.Module, args: Any) -> None:
            calls["n"] += 1
            if rank == 0 and calls["n"] == 2:  # step 1, in its second layer
                raise torch.OutOfMemoryError("simulated: CUDA out of memory")

        m.model.layers[1].register_forward_pre_hook(run_out_of_memory)
        events: list[Any] = []
        step = 0
        while step < 3:
            try:
                _step(m, opt, _batch(step).chunk(WORLD)[rank])
                events.append(("done", step))
            except torch.OutOfMemoryError:  # the habit: skip this batch, go on
                opt.zero_grad()
                events.append(("skipped", step))
            except RuntimeError as e:
                opt.zero_grad()
                events.append(("raised", step, str(e)))
                break
            step += 1
        pg.allreduce([torch.zeros(1)]).wait()  # both ranks stopped: begin again alike
        _step(m, opt, _batch(3).chunk(WORLD)[rank])
        return events, m.full_state_dict()

    results = run_ranks(WORLD, fn, timeout=60.0)
    (events0, state0), (events1, state1) = results
    assert events0[:2] == [("done", 0), ("skipped", 1)]
    assert events1[0] == ("done", 0)
    raised = [events0[2], events1[1]]
    assert [r[:2] for r in raised] == [("raised", 2), ("raised", 1)]
    for _, _, message in raised:
        assert "ranks are at different steps or calls" in message
        assert "rank 0: forward pass 3" in message and "rank 1: forward pass 2" in message
        assert "decide it on every rank" in message
        # what rank 1 was doing: gathering a layer (stage 3), or ending forward (stages 1 and 2,
        # which gather nothing in forward)
        assert re.search(r"rank 1: forward pass 2, (gathering unit \d+ \(\w+\)|ending)", message)
    for state in (state0, state1):
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)
