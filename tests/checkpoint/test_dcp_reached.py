"""A sharded model that DCP and shardwrap's checkpoints reach through another module:
``torch.compile(model)``, a module holding it (however deep), and full state dicts that lack
keys or carry a module's extra state.

At 2 ranks as threads, each against what the plain model gives or loads (DCP's own
``dcp.save``/``dcp.load`` are in ``tests/e2e/test_dcp.py``). Proves:

- on ``torch.compile(model)``, ``save_checkpoint``, ``load_checkpoint`` and
  ``full_optimizer_state_dict`` work as on the model (before: a load raised a ``KeyError`` for
  ``_orig_mod.``-prefixed names, and the full optimizer state held ``step`` alone);
- ``get_optimizer_state_dict(..., full_state_dict=True)`` of a compiled or held model is the
  plain model's whole state, moments included, and ``set_model_state_dict`` of its pieces
  loads them (before: the moments were missing, and the load raised naming the pieces);
- a model held 8 modules deep is still shown to DCP as pieces;
- a full state lacking keys (a pretrained backbone under a new head) loads as into the plain
  model, and one holding a key the model lacks raises torch's ``RuntimeError`` with ``strict``;
- a module's ``get_extra_state()`` comes back in the full state, as the plain model gives it.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_dcp_reached.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
)

import shardwrap
from shardwrap import ShardedModule
from shardwrap.engine.optim.dcp_pieces import DCPPiece
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

FULL = StateDictOptions(full_state_dict=True)

torch.manual_seed(0)
BASE = GPT(width=36, depth=2)  # before any rank runs: ranks as threads share the default RNG


class Holder(nn.Module):
    """A module holding the model ``depth`` modules deep."""

    def __init__(self, inner: nn.Module, depth: int = 1) -> None:
        super().__init__()
        self.body = inner if depth == 1 else Holder(inner, depth - 1)

    def forward(self, *args: Any) -> Any:
        return self.body(*args)


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, rank: int, world: int) -> None:
    idx, targets = make_batch(seed=7, batch=4)
    model(idx.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    optimizer.step()
    optimizer.zero_grad()


def _plain() -> tuple[nn.Module, dict[str, Any]]:
    """The plain model after one AdamW step, and its full optimizer state by DCP's names."""
    model = copy.deepcopy(BASE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optimizer, 0, 1)
    return model, get_optimizer_state_dict(model, optimizer, options=FULL)


@pytest.mark.parametrize("reach", ["compiled", "held"])
def test_the_whole_optimizer_state_of_a_model_reached_through_another(reach: str) -> None:
    plain, want = _plain()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Any]:
        m = ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)
        outer = torch.compile(m, backend="eager") if reach == "compiled" else Holder(m)
        optimizer = torch.optim.AdamW(outer.parameters(), lr=1e-2)
        _step(outer, optimizer, 0, 1)  # the whole batch on each rank: the plain gradients
        shown = get_model_state_dict(outer)
        assert all(isinstance(v, DCPPiece) for v in shown.values())
        set_model_state_dict(outer, shown)  # DCP's load of its pieces, module by module
        return get_optimizer_state_dict(outer, optimizer, options=FULL)

    prefix = "body." if reach == "held" else ""
    for got in run_ranks(2, fn, timeout=60):
        assert got["state"].keys() == {prefix + k for k in want["state"]}
        for name, entry in want["state"].items():
            assert entry.keys() == {"step", "exp_avg", "exp_avg_sq"}
            torch.testing.assert_close(got["state"][prefix + name], entry, atol=1e-6, rtol=0)


def test_checkpoints_of_a_compiled_model(tmp_path: Path) -> None:
    plain, want = _plain()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Any]]:
        m = ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)
        compiled = torch.compile(m, backend="eager")
        optimizer = torch.optim.AdamW(compiled.parameters(), lr=1e-2)
        _step(compiled, optimizer, 0, 1)
        shardwrap.save_checkpoint(tmp_path / "ckpt", compiled, optimizer)
        fresh = torch.compile(
            ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg),
            backend="eager",
        )
        fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        shardwrap.load_checkpoint(tmp_path / "ckpt", fresh, fresh_optimizer)
        full = shardwrap.full_optimizer_state_dict(fresh, fresh_optimizer)
        return m.full_state_dict(), full

    names = [n for n, _ in plain.named_parameters()]
    for state, full in run_ranks(2, fn, timeout=60):
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-6, rtol=0)
        for index, entry in full["state"].items():
            assert entry.keys() == {"step", "exp_avg", "exp_avg_sq"}
            torch.testing.assert_close(entry, want["state"][names[index]], atol=1e-6, rtol=0)


def test_a_model_held_eight_modules_deep_is_shown_to_dcp_as_pieces() -> None:
    def fn(rank: int, pg: ProcessGroup) -> tuple[bool, bool]:
        m = ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)
        outer = Holder(m, depth=8)
        pieces = all(isinstance(v, DCPPiece) for v in get_model_state_dict(outer).values())
        full = get_model_state_dict(outer, options=FULL)
        return pieces, all(
            type(v) is Tensor and v.shape == BASE.wte.weight.shape
            for k, v in full.items()
            if k.endswith("wte.weight")
        )

    assert run_ranks(2, fn, timeout=60) == [(True, True), (True, True)]


@pytest.mark.parametrize("strict", [False, True])
def test_a_full_state_lacking_keys_loads_as_into_the_plain_model(strict: bool) -> None:
    """A pretrained body under a new head: DCP stands the model's own values in for the keys
    the full state lacks, with ``strict`` or not, and loads the rest, as into the plain model
    (before: "both kinds mixed"). A key the model lacks raises torch's ``RuntimeError`` with
    ``strict``, naming it."""
    torch.manual_seed(1)
    other = GPT(width=36, depth=2).state_dict()
    body = {k: v for k, v in other.items() if not k.startswith("lm_head")}
    options = StateDictOptions(full_state_dict=True, strict=strict)
    plain = copy.deepcopy(BASE)
    set_model_state_dict(plain, body, options=options)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)
        set_model_state_dict(m, body, options=options)
        if strict:
            with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "x"'):
                set_model_state_dict(m, {**body, "x": torch.zeros(1)}, options=options)
        return m.full_state_dict()

    for state in run_ranks(2, fn, timeout=60):
        torch.testing.assert_close(state, plain.state_dict(), atol=0, rtol=0)


class WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 4)

    def get_extra_state(self) -> Any:
        return {"version": "MyState"}

    def set_extra_state(self, state: Any) -> None:
        self.seen = state

    def forward(self, x: Tensor) -> Tensor:
        return self.layer(x)


def test_extra_state_comes_back_in_the_full_state() -> None:
    """``get_extra_state()`` in ``full_state_dict()`` and DCP's full state, as the plain
    model's ``state_dict()`` holds it (before: ``'dict' object has no attribute 'detach'``)."""
    torch.manual_seed(0)
    model = nn.Sequential(WithExtraState(), WithExtraState())
    want = model.state_dict()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Any], dict[str, Any]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=WithExtraState, process_group=pg)
        return m.full_state_dict(), get_model_state_dict(m, options=FULL)

    for own, dcp in run_ranks(2, fn, timeout=60):
        for got in (own, dcp):
            assert got.keys() == want.keys()
            assert got["0._extra_state"] == {"version": "MyState"}
            torch.testing.assert_close(
                {k: v for k, v in got.items() if isinstance(v, Tensor)},
                {k: v for k, v in want.items() if isinstance(v, Tensor)},
                atol=0,
                rtol=0,
            )
