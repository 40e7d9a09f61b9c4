"""A ``transformers`` CLIP, built from a config with random weights: its ``logit_scale`` is a
0-d parameter, whose piece one rank holds and whose optimizer state is 0-d on the unwrapped
model as the optimizer's ``step`` is.

Proves, at 2 ranks (each on the whole batch: CLIP's contrastive loss pairs every text with
every image of the batch, so a slice would be another loss): AdamW for 2 steps, a
``save_checkpoint``, a fresh sharded model loaded from it and 2 more steps give the unwrapped
model's losses, parameters and optimizer state (``full_optimizer_state_dict``) within 1e-5;
the same state loads back with ``load_full_optimizer_state_dict`` (before: the ranks disagreed
on whether ``logit_scale``'s moments were per-element state, so ``full_optimizer_state_dict``
refused, and a resumed run failed at its first step on the rank without the element).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_clip.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule
from tests.support.models import HF_VOCAB, tiny_clip_config
from tests.support.ranks import run_ranks

_data = torch.Generator().manual_seed(0)
BATCHES = [
    (torch.randint(0, HF_VOCAB, (4, 6), generator=_data), torch.randn(4, 3, 8, 8, generator=_data))
    for _ in range(4)
]


def _steps(model: nn.Module, opt: torch.optim.Optimizer, batches: list) -> list[float]:
    losses = []
    for ids, pixels in batches:
        loss = model(input_ids=ids, pixel_values=pixels, return_loss=True).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_clip_resumes_from_a_checkpoint_as_the_plain_model_trains(tmp_path: Path) -> None:
    from transformers import CLIPModel
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer

    torch.manual_seed(0)
    model = CLIPModel(tiny_clip_config())
    assert model.logit_scale.ndim == 0
    plain = copy.deepcopy(model)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    want = _steps(plain, plain_opt, BATCHES)
    want_state = plain_opt.state_dict()["state"]

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor], Any, Any]:
        def wrapped() -> tuple[nn.Module, torch.optim.Optimizer]:
            m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=CLIPEncoderLayer)
            return m, torch.optim.AdamW(m.parameters(), lr=1e-3)

        m, opt = wrapped()
        losses = _steps(m, opt, BATCHES[:2])
        shardwrap.save_checkpoint(tmp_path / "ckpt", m, opt)
        m, opt = wrapped()
        shardwrap.load_checkpoint(tmp_path / "ckpt", m, opt)
        losses += _steps(m, opt, BATCHES[2:])
        full = shardwrap.full_optimizer_state_dict(m, opt)
        again, again_opt = wrapped()
        again.load_state_dict(m.full_state_dict())
        shardwrap.load_full_optimizer_state_dict(again, again_opt, full)
        reloaded = shardwrap.full_optimizer_state_dict(again, again_opt)
        return losses, m.full_state_dict(), full["state"], reloaded["state"]

    for losses, state, full, reloaded in run_ranks(2, fn, timeout=120):
        torch.testing.assert_close(losses, want, atol=1e-5, rtol=0)
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-5, rtol=0)
        torch.testing.assert_close(full, want_state, atol=1e-5, rtol=0)
        torch.testing.assert_close(reloaded, want_state, atol=0, rtol=0)
