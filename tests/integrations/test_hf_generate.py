"""``generate()`` on a sharded model when ranks finish decoding at different steps.

Sequences that meet their end-of-sequence token at different steps are the normal case; each
decoding step gathers parameters, so a rank that stops early would leave the others waiting
for good. A sharded ``transformers`` model keeps every rank stepping until all are done (one
small all-reduce over the model's own ranks per step). Proves, on GPT-2 and T5 from tiny
configs at 2 ranks, each rank with its own prompt whose greedy continuation ends at a different
step:

- every rank's output equals the unwrapped model's ``generate`` on that prompt, both as is and
  inside ``gathered()``, with lengths that differ between the ranks (so the case is exercised);
- ``synced_gpus=False`` is refused on every rank before any collective, naming the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_generate.py -q``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import transformers
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from transformers.models.gpt2.modeling_gpt2 import GPT2Block
from transformers.models.t5.modeling_t5 import T5Block

from shardwrap import ShardedModule
from tests.support.models import HF_VOCAB, tiny_gpt2_config, tiny_t5_config
from tests.support.ranks import run_ranks

WORLD, NEW_TOKENS = 2, 8


def _gpt2() -> tuple[nn.Module, type]:
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(tiny_gpt2_config()).eval(), GPT2Block


def _t5() -> tuple[nn.Module, type]:
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(tiny_t5_config()).eval(), T5Block


def _generate(model: nn.Module, prompt: Tensor, **kwargs: Any) -> Tensor:
    with torch.no_grad():
        return model.generate(
            prompt, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0, **kwargs
        )


def _uneven(model: nn.Module) -> tuple[list[Tensor], int]:
    """Two prompts and an end token that the first one's greedy continuation meets early and
    the second one's never does."""
    for seed in range(100):
        g = torch.Generator().manual_seed(seed)
        prompts = [torch.randint(2, HF_VOCAB, (1, 5), generator=g) for _ in range(WORLD)]
        first, second = (_generate(model, p)[0, -NEW_TOKENS:].tolist() for p in prompts)
        early = [t for t in first[: NEW_TOKENS // 2] if t not in second and t > 1]
        if early:
            return prompts, early[0]
    raise AssertionError("no pair of prompts ends at different steps")


@pytest.mark.parametrize("family", [_gpt2, _t5], ids=["gpt2", "t5"])
def test_ranks_finishing_at_different_steps_all_match_the_plain_model(family: Any) -> None:
    model, layer = family()
    prompts, eos = _uneven(model)
    want = [_generate(model, p, eos_token_id=eos) for p in prompts]
    assert want[0].shape[1] < want[1].shape[1]

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, Tensor]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        out = _generate(m, prompts[rank], eos_token_id=eos)
        with m.gathered():
            inside = _generate(m, prompts[rank], eos_token_id=eos)
        return out, inside

    for rank, (out, inside) in enumerate(run_ranks(WORLD, fn, timeout=30.0)):
        assert torch.equal(out, want[rank])
        assert torch.equal(inside, want[rank])


def test_unsynced_generate_is_refused() -> None:
    model, layer = _gpt2()

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        before = sum(m.comm_stats.calls.values())
        with pytest.raises(ValueError, match="Leave synced_gpus unset"):
            _generate(m, torch.ones(1, 3, dtype=torch.long), synced_gpus=False)
        return sum(m.comm_stats.calls.values()) - before

    assert run_ranks(WORLD, fn) == [0, 0]
