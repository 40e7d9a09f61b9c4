"""A sharded model's and its optimizer's state dicts hold pieces, which refuse to be saved.

Proves, in process:

- ``model.state_dict()`` and ``optimizer.state_dict()`` hand out this rank's pieces as
  ``ShardPiece`` tensors that know the whole tensor's shape and their element range; saving
  one (``torch.save``, also of a ``.cpu()`` or ``.clone()`` of it) raises naming
  ``full_state_dict``, ``full_optimizer_state_dict`` and ``save_checkpoint``, for elementwise
  and shape-aware optimizers and at world size 1; in memory they load back (the optimizer's
  state plain again), and training then goes on exactly as if they had never been taken.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_from_ddp.py -q``
"""

from __future__ import annotations

import copy
import io
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from shardwrap.engine.optim.pieces import ShardPiece
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks


def _run(world_size: int, fn: Any) -> list[Any]:
    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=60.0)


def _refused(obj: object) -> str:
    with pytest.raises(TypeError) as info:
        torch.save(obj, io.BytesIO())
    return str(info.value)


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_state_dicts_hold_pieces_that_refuse_to_be_saved(world_size: int, kind: str) -> None:
    torch.manual_seed(0)
    model = GPT(tied=True)
    x, y = make_batch(0, 4)

    def optimizer(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        if kind == "adamw":
            return torch.optim.AdamW(params, lr=3e-3)
        return torch.optim.Muon([p for p in params if p.ndim == 2], lr=0.02)

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = optimizer(list(m.parameters()))
        n = 4 // world_size
        m(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).backward()
        opt.step()
        sd, osd = m.state_dict(), opt.state_dict()
        root = m._shardwrap_root
        params = nn.Module.state_dict(m, keep_vars=True)
        for key in ("wte.weight", "lm_head.weight", "ln_f.weight"):  # lm_head: tied to wte
            piece, param = sd[key], root.param_of[id(params[key])]
            assert isinstance(piece, ShardPiece) and piece.full_shape == param.shape
            layout_piece = param.group.pieces[param.index]
            assert (piece.start, piece.stop) == (layout_piece.start, layout_piece.stop)
        for obj in (sd, {"model": sd}, sd["wte.weight"].cpu(), sd["ln_f.weight"].clone()):
            message = _refused(obj)
            assert "model.full_state_dict(rank0_only=True)" in message
            assert "shardwrap.full_optimizer_state_dict" in message
            assert "shardwrap.save_checkpoint" in message
        held = [v for entry in osd["state"].values() for v in entry.values() if v.ndim > 0]
        assert held and all(isinstance(v, ShardPiece) for v in held)
        assert "full_optimizer_state_dict" in _refused({"optimizer": osd})
        # the optimizer's own state stays plain: its step pays nothing for the pieces
        assert all(type(v) is Tensor for s in opt.state.values() for v in s.values())
        # in memory, both load back (copy.deepcopy keeps them pieces)
        kept_model, kept_opt = copy.deepcopy(sd), copy.deepcopy(osd)
        assert isinstance(kept_model["wte.weight"], ShardPiece)
        m.load_state_dict(kept_model)
        opt.load_state_dict(kept_opt)
        assert all(type(v) is Tensor for s in opt.state.values() for v in s.values())

    _run(world_size, fn)


@pytest.mark.parametrize("world_size", [1, 2])
def test_state_dicts_loaded_back_train_on_as_if_never_saved(world_size: int) -> None:
    torch.manual_seed(0)
    model = GPT()
    batches = [make_batch(s, 4) for s in range(4)]

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        n = 4 // world_size

        def train(m: nn.Module, opt: torch.optim.Optimizer, part: list) -> None:
            for x, y in part:
                m(x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]).backward()
                opt.step()
                opt.zero_grad()

        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
        train(m, opt, batches[:2])
        kept = copy.deepcopy({"model": m.state_dict(), "optimizer": opt.state_dict()})
        train(m, opt, batches[2:])
        resumed = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=3e-3)
        resumed.load_state_dict(kept["model"])
        resumed_opt.load_state_dict(kept["optimizer"])  # before its first step
        train(resumed, resumed_opt, batches[2:])
        return m.full_state_dict(), resumed.full_state_dict()

    for state, resumed in _run(world_size, fn):
        torch.testing.assert_close(resumed, state, atol=0, rtol=0)
