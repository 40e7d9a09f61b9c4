"""``generate()`` on a sharded model when ranks finish decoding at different steps.

Sequences that meet their end-of-sequence token at different steps are the normal case. Where
its units are kept gathered for the call, each rank decodes on its own, issuing no collective
per token; otherwise each decoding step gathers parameters, so a rank that stopped early would
leave the others waiting for good, and a sharded ``transformers`` model keeps every rank
stepping until all are done (one small all-reduce over the model's own ranks per step).
Proves, on GPT-2 and T5 from tiny configs at 2 ranks, each rank with its own prompt whose
greedy continuation ends at a different step:

- every rank's output equals the unwrapped model's ``generate`` on that prompt, as is (its
  units gathered once for the whole call: at most the bytes of the model gathered, and no
  collective per token, only the decision and a handshake per bucket of units), inside
  ``gathered()`` (no gather at all) and with ``keep_gathered(False)`` (gathered per decoding
  step, as training does), with lengths that differ between the ranks (so the case is
  exercised);
- ``synced_gpus=False`` is refused on every rank before any collective, naming the fix.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_generate.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
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
def test_ranks_finishing_at_different_steps_all_match_the_plain_model(
    family: Any, default_stage: int
) -> None:
    model, layer = family()
    prompts, eos = _uneven(model)
    want = [_generate(model, p, eos_token_id=eos) for p in prompts]
    assert want[0].shape[1] < want[1].shape[1]

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Tensor], list[int], int, int, int]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        model_bytes = sum(u.gather_nbytes for u in m._shardwrap_root.units)
        outs, gathers = [], []
        for keep in (None, "gathered", False):
            m.comm_stats.reset()
            if keep == "gathered":
                with m.gathered():
                    m.comm_stats.reset()
                    outs.append(_generate(m, prompts[rank], eos_token_id=eos))
                    gathers.append(m.comm_stats.bytes.get("all_gather", 0))
                continue
            with m.keep_gathered(keep):
                outs.append(_generate(m, prompts[rank], eos_token_id=eos))
            gathers.append(m.comm_stats.bytes.get("all_gather", 0))
            if keep is None:
                calls = m.comm_stats.calls
                others = sum(calls.values()) - calls.get("all_gather", 0)
        return outs, gathers, model_bytes, others, len(m._shardwrap_root.units)

    results = run_ranks(WORLD, fn, timeout=30.0)
    for rank, (outs, gathers, model_bytes, others, units) in enumerate(results):
        for out in outs:  # kept gathered, inside gathered(), gathered per forward
            assert torch.equal(out, want[rank])
        kept, inside, per_forward = gathers  # bytes
        assert kept <= model_bytes and inside == 0, gathers  # each unit at most once a call
        # kept: one all-reduce deciding, one handshake per unit gathered up front, and
        # nothing per token (before: a handshake and an all-reduce at every token)
        assert others <= 1 + units < NEW_TOKENS, others
        if default_stage == 3:  # stages 1 and 2 keep their parameters anyway
            assert per_forward > 2 * model_bytes, gathers  # what generate() did before


def test_unsynced_generate_is_refused() -> None:
    model, layer = _gpt2()

    def fn(rank: int, pg: ProcessGroup) -> int:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        before = sum(m.comm_stats.calls.values())
        with pytest.raises(ValueError, match="Leave synced_gpus unset"):
            _generate(m, torch.ones(1, 3, dtype=torch.long), synced_gpus=False)
        return sum(m.comm_stats.calls.values()) - before

    assert run_ranks(WORLD, fn) == [0, 0]


def test_trainer_evaluate_gathers_each_unit_once_and_matches_the_plain_model(
    tmp_path: Path, default_stage: int
) -> None:
    import shardwrap.hf

    model, layer = _gpt2()
    g = torch.Generator().manual_seed(0)
    rows = [torch.randint(2, HF_VOCAB, (12,), generator=g) for _ in range(8)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_eval_batch_size=2
    )
    want = transformers.Trainer(model=copy.deepcopy(model), args=args).evaluate(data)
    m = ShardedModule(copy.deepcopy(model), auto_wrap=layer)
    groups = sum(len(u.groups) for u in m._shardwrap_root.units)
    m.comm_stats.reset()
    got = shardwrap.hf.Trainer(model=m, args=args).evaluate(data)
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], abs=1e-6)
    assert m.comm_stats.calls.get("all_gather", 0) <= groups  # 4 batches, one gather per group
    if default_stage == 3:  # released after; stages 1 and 2 keep them
        assert all(u.state.name == "SHARDED" for u in m._shardwrap_root.units)
