"""Gradient clipping and gradient norms as training loops write them, on Hugging Face models.

``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` is the most common line in a
training loop; on a sharded model each rank holds only pieces of the gradients, so a local norm
would clip each rank differently. Proves, on GPT-2 and BERT from tiny configs at 2 ranks, against
the unwrapped model trained on the whole global batch over several clipped SGD steps:

- torch's own ``clip_grad_norm_`` (its per-tensor path and its ``foreach`` path, norms of order
  2, 1 and inf) returns the global norm on every rank and the clipped steps keep parameter
  parity;
- per-parameter gradient norms as loggers take them (``p.grad.data.norm(2)`` on every rank) are
  each parameter's whole norm.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_hf_clipping.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.models import hf_bert_mlm, hf_gpt2_lm, hf_ids
from tests.support.ranks import run_ranks

WORLD, STEPS, GLOBAL_BATCH, LENGTH = 2, 3, 4, 12


def _batch(step: int) -> Tensor:
    return hf_ids(step, GLOBAL_BATCH, LENGTH)


def _loss(model: nn.Module, ids: Tensor) -> Tensor:
    return model(input_ids=ids, labels=ids).loss


def _train(
    model: nn.Module, ids_of: Callable[[int], Tensor], clip: Callable[[nn.Module], Tensor]
) -> tuple[list[Tensor], list[dict[str, Tensor]]]:
    """Clipped SGD steps; the total norm and every parameter's gradient norm at each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    totals, per_param = [], []
    for step in range(STEPS):
        _loss(model, ids_of(step)).backward()
        per_param.append(
            {n: p.grad.data.norm(2) for n, p in model.named_parameters() if p.grad is not None}
        )
        totals.append(clip(model))
        opt.step()
        opt.zero_grad()
    return totals, per_param


@pytest.mark.parametrize("family", [hf_gpt2_lm, hf_bert_mlm], ids=["gpt2", "bert"])
@pytest.mark.parametrize(
    ("norm_type", "foreach"), [(2.0, None), (2.0, True), (1.0, None), (float("inf"), True)]
)
def test_torch_clip_grad_norm_is_global_and_keeps_parity(
    family: Callable[[], tuple[nn.Module, type]], norm_type: float, foreach: bool | None
) -> None:
    model, layer = family()

    def clip(m: nn.Module) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(
            m.parameters(), 1e-3, norm_type=norm_type, foreach=foreach
        )

    ref = copy.deepcopy(model)
    ref_totals, ref_per_param = _train(ref, _batch, clip)
    assert all(t > 1e-3 for t in ref_totals)  # every step clips

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[Tensor], list[dict], dict[str, Tensor]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        totals, per_param = _train(m, lambda step: _batch(step).chunk(WORLD)[rank], clip)
        per_param = [{n: float(v) for n, v in norms.items()} for norms in per_param]
        return [t.detach().clone() for t in totals], per_param, m.full_state_dict()

    for totals, per_param, state in run_ranks(WORLD, fn):
        for got, expected in zip(totals, ref_totals):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)
        for got, expected in zip(per_param, ref_per_param):
            assert got.keys() == expected.keys()
            for name in got:
                assert got[name] == pytest.approx(expected[name].item(), rel=1e-5, abs=1e-7), name
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)
