"""Checkpoints of a tensor-parallel model are free of its layout.

A GPT parallelized on ``mesh["tp"]`` and wrapped over a dp=2 x tp=2 mesh (ranks as threads
with a ``DeviceMesh`` each, ``tests/support/tp.py``) trains half the steps and saves; the
checkpoint loads at dp=4 x tp=1, dp=1 x tp=4 and in one process without tensor parallelism,
with the model exactly as saved (bit for bit) and the optimizer's state, so that training
continues within 1e-5 of the plain model trained without a break (AdamW; Muon, whose
matrices' state is saved whole by their owners, within 1e-4). ``export`` of the same model
writes the whole model, which a plain ``load_state_dict`` reads and ``load_pretrained`` loads
at dp=1 x tp=4.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest
tests/checkpoint/test_checkpoint_tensor_parallel.py -q``
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from shardwrap import ShardedModule, export, load_checkpoint, load_pretrained, save_checkpoint
from tests.support.models import Block
from tests.support.optimizers import MuonAndSGD
from tests.support.parity import GPT_BATCHES, STEPS, adamw, gpt_loss, train_recipe
from tests.support.tp import data_rank, parallelize_gpt, run_mesh_ranks, tp_gpt

HALF = STEPS // 2
MODEL = tp_gpt()


def _optimizers(opt: Any) -> Any:
    return list(opt.optimizers) if isinstance(opt, MuonAndSGD) else opt


def _train(m: nn.Module, opt: Any, steps: range, index: int, count: int) -> list[float]:
    """Train on this rank's slice of each step's global batch; the global mean losses."""
    losses = []
    for step in steps:
        x, y = GPT_BATCHES[step]
        opt.zero_grad()
        loss = gpt_loss(m, x.chunk(count)[index], y.chunk(count)[index])
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        if dist.is_initialized():  # every rank of a slice holds its loss
            dist.all_reduce(total)
            total /= dist.get_world_size()
        losses.append(total.item())
    return losses


def _wrap(mesh: DeviceMesh | None) -> nn.Module:
    model = copy.deepcopy(MODEL)
    if mesh is None:
        return ShardedModule(model, auto_wrap=Block)
    return ShardedModule(parallelize_gpt(model, mesh["tp"]), process_group=mesh, auto_wrap=Block)


def _resume(
    folder: Path, make_opt: Callable[[Any], Any], mesh: DeviceMesh | None
) -> tuple[dict[str, Tensor], list[float], dict[str, Tensor]]:
    """Load at ``mesh`` (``None``: one process), train the second half; the full state right
    after the load, the losses and the full state at the end."""
    m = _wrap(mesh)
    opt = make_opt(m.parameters())
    load_checkpoint(folder, m, _optimizers(opt))
    loaded = m.full_state_dict()
    index, count = data_rank(mesh) if mesh is not None else (0, 1)
    losses = _train(m, opt, range(HALF, STEPS), index, count)
    return loaded, losses, m.full_state_dict()


@pytest.mark.parametrize("make_opt", [adamw, MuonAndSGD], ids=["adamw", "muon"])
def test_a_checkpoint_at_dp2_tp2_loads_at_any_layout(
    tmp_path: Path, make_opt: Callable[[Any], Any]
) -> None:
    want_losses, want = train_recipe(MODEL, 2, torch.float32, make_optimizer=make_opt)
    folder = tmp_path / "ckpt"

    def save(rank: int, mesh: DeviceMesh) -> dict[str, Tensor]:
        m = _wrap(mesh)
        opt = make_opt(m.parameters())
        _train(m, opt, range(HALF), *data_rank(mesh))
        save_checkpoint(folder, m, _optimizers(opt))
        return m.full_state_dict()

    saved = run_mesh_ranks((2, 2), ("dp", "tp"), save)[0]
    meta = json.loads((folder / "metadata.json").read_text())
    assert meta["params"]["blocks.0.mlp.2.weight"]["split"] == [1, 2]
    assert "split" not in meta["params"]["blocks.0.ln_1.weight"]
    resumed = [
        *run_mesh_ranks((4, 1), ("dp", "tp"), lambda r, mesh: _resume(folder, make_opt, mesh)),
        *run_mesh_ranks((1, 4), ("dp", "tp"), lambda r, mesh: _resume(folder, make_opt, mesh)),
        _resume(folder, make_opt, None),
    ]
    for loaded, losses, final in resumed:
        torch.testing.assert_close(loaded, saved, atol=0, rtol=0)
        # AdamW: the losses (Adam turns rounding in the attention key biases, whose true
        # gradient is zero, into noise); Muon (and SGD for the rest): every parameter
        torch.testing.assert_close(losses, want_losses[HALF:], atol=1e-5, rtol=0)
        if make_opt is MuonAndSGD:
            torch.testing.assert_close(final, want, atol=1e-4, rtol=0)


def test_export_writes_the_whole_model(tmp_path: Path) -> None:
    folder = tmp_path / "export"

    def save(rank: int, mesh: DeviceMesh) -> dict[str, Tensor]:
        m = _wrap(mesh)
        _train(m, adamw(m.parameters()), range(HALF), *data_rank(mesh))
        export(folder, m)
        return m.full_state_dict()

    saved = run_mesh_ranks((2, 2), ("dp", "tp"), save)[0]
    plain = copy.deepcopy(MODEL)
    plain.load_state_dict(load_file(folder / "model.safetensors"))
    torch.testing.assert_close(plain.state_dict(), saved, atol=0, rtol=0)

    def load(rank: int, mesh: DeviceMesh) -> dict[str, Tensor]:
        m = _wrap(mesh)
        load_pretrained(folder, m)
        return m.full_state_dict()

    for state in run_mesh_ranks((1, 4), ("dp", "tp"), load):
        torch.testing.assert_close(state, saved, atol=0, rtol=0)
