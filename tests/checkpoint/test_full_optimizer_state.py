"""One-file checkpoints as DDP scripts write them: the model's and the optimizer's full state.

``{"model": model.full_state_dict(rank0_only=True), "optimizer":
shardwrap.full_optimizer_state_dict(model, optimizer, rank0_only=True)}``, saved by rank 0 with
``torch.save``. Proves, for AdamW, Muon over the matrices (AdamW over the rest, two optimizers,
each saved as one) and Adafactor, trained 2 steps at world size 2, on a model with a 0-d
parameter beside its matrices and vectors:

- the optimizer part equals the unwrapped model's ``optimizer.state_dict()`` after the same
  steps (keys, groups and every state tensor in the parameter's shape; other ranks get ``{}``);
  with ``rank0_only=False`` every rank gets it;
- the file loads into the unwrapped model and its optimizers (their own ``load_state_dict``),
  and into the model wrapped at world size 1, 3 and 4 with a DDP script's resume lines
  (``model.load_state_dict``, ``optimizer.load_state_dict``, before the optimizer's first
  step; or ``shardwrap.load_full_optimizer_state_dict``): each then trains 2 more steps to the
  unwrapped model trained over the same 4 batches (1e-5; Muon 1e-4). After such a load each
  rank holds its pieces of the elementwise state, and each owner alone the state of the
  parameters a shape-aware optimizer steps whole.

The reference sums each step's gradient over the slices of that step's world size, in the
ranks' order, as ``tests/checkpoint/test_checkpoint_shaped.py`` does.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_full_optimizer_state.py -q``
"""

from __future__ import annotations

import copy
import functools
import io
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule
from tests.support.parity import slice_summed_grads
from tests.support.ranks import run_ranks

WIDTH, ROWS = 24, 12  # 12 rows: a slice for each rank at world sizes 1 to 4
Optimizers = list[torch.optim.Optimizer]
MakeOptimizers = Callable[[Iterable[nn.Parameter]], Optimizers]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class Model(nn.Module):
    """Blocks between linear layers, the output scaled by a learned 0-d temperature (as CLIP's
    ``logit_scale``), whose per-element optimizer state one rank holds and the others none."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Linear(WIDTH, WIDTH), Block(), Block(), nn.Linear(WIDTH, WIDTH)
        )
        self.temperature = nn.Parameter(torch.tensor(0.7))

    def forward(self, x: Tensor) -> Tensor:
        return self.body(x) * self.temperature


def build() -> nn.Module:
    torch.manual_seed(0)
    return Model()


def loss_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


_data = torch.Generator().manual_seed(1)
BATCHES = [
    (torch.randn(ROWS, WIDTH, generator=_data), torch.randn(ROWS, WIDTH, generator=_data))
    for _ in range(4)
]


def adamw(params: Iterable[nn.Parameter]) -> Optimizers:
    return [torch.optim.AdamW(params, lr=3e-3)]


def muon(params: Iterable[nn.Parameter]) -> Optimizers:
    params = list(params)
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=5e-3),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
    ]


def adafactor(params: Iterable[nn.Parameter]) -> Optimizers:
    return [torch.optim.Adafactor(params, lr=1e-2)]


OPTIMIZERS: dict[str, tuple[MakeOptimizers, float]] = {
    "adamw": (adamw, 1e-5),
    "muon": (muon, 1e-4),
    "adafactor": (adafactor, 1e-5),
}


def _step(model: nn.Module, opts: Optimizers, world: int, rank: int | None, step: int) -> None:
    """One step on batch ``step``: this rank's slice, or (``rank=None``, the unwrapped model)
    the gradient summed over the slices of ``world`` ranks in their order, then averaged."""
    inputs, targets = BATCHES[step]
    if rank is not None:
        loss_fn(model, inputs.chunk(world)[rank], targets.chunk(world)[rank]).backward()
    else:
        slice_summed_grads(model, loss_fn, inputs, targets, world)
    for o in opts:
        o.step()
        o.zero_grad()


def _reference(make: MakeOptimizers, worlds: list[int]) -> tuple[nn.Module, Optimizers]:
    """The unwrapped model and optimizers after a step at each of ``worlds``' world sizes."""
    ref = build()
    opts = make(ref.parameters())
    for step, world in enumerate(worlds):
        _step(ref, opts, world, None, step)
    return ref, opts


@functools.cache
def _saved_at_2_ranks(kind: str) -> tuple[bytes, list[list[dict[str, Any]]]]:
    """The one-file checkpoint rank 0 writes after 2 steps at world size 2, and what each rank
    got of ``full_optimizer_state_dict`` with ``rank0_only=False``."""
    make, _ = OPTIMIZERS[kind]
    files: dict[int, bytes] = {}
    model = build()  # here: ranks are threads, and drawing weights in each would interleave

    def fn(rank: int, pg: ProcessGroup) -> list[dict[str, Any]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opts = make(m.parameters())
        for step in range(2):
            _step(m, opts, 2, rank, step)
        checkpoint = {
            "model": m.full_state_dict(rank0_only=True),
            "optimizer": [shardwrap.full_optimizer_state_dict(m, o, rank0_only=True) for o in opts],
        }
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(checkpoint, buffer)
            files[rank] = buffer.getvalue()
        else:
            assert checkpoint["model"] == {} and all(o == {} for o in checkpoint["optimizer"])
        return [shardwrap.full_optimizer_state_dict(m, o) for o in opts]

    everyone = run_ranks(2, fn, timeout=60.0)
    return files[0], everyone


def _read(kind: str) -> dict[str, Any]:
    """The file, read afresh: a loaded optimizer steps the tensors it was given, in place."""
    return torch.load(io.BytesIO(_saved_at_2_ranks(kind)[0]), weights_only=True)


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_full_optimizer_state_is_the_unwrapped_models(kind: str) -> None:
    make, tol = OPTIMIZERS[kind]
    _, everyone = _saved_at_2_ranks(kind)
    _, opts = _reference(make, [2, 2])
    want = [o.state_dict() for o in opts]
    for full in [_read(kind)["optimizer"], *everyone]:
        torch.testing.assert_close(full, want, atol=tol, rtol=0)


@pytest.mark.parametrize("world", [1, 3, 4])
@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_the_file_resumes_unwrapped_and_at_any_world_size(kind: str, world: int) -> None:
    make, tol = OPTIMIZERS[kind]
    ref, _ = _reference(make, [2, 2, world, world])
    want = ref.state_dict()

    # the unwrapped model and its optimizers load the file as their own
    checkpoint = _read(kind)
    plain = build()
    plain.load_state_dict(checkpoint["model"])
    plain_opts = make(plain.parameters())
    for o, state in zip(plain_opts, checkpoint["optimizer"]):
        o.load_state_dict(state)
    for step in (2, 3):
        _step(plain, plain_opts, world, None, step)
    torch.testing.assert_close(plain.state_dict(), want, atol=tol, rtol=0)

    other = build()  # other weights: everything must come from the checkpoint
    other.load_state_dict({k: v + 1 for k, v in other.state_dict().items()})

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, Tensor], list[int]]:
        m = ShardedModule(
            copy.deepcopy(other), auto_wrap=Block, process_group=pg, sync_module_states=False
        )
        loaded = _read(kind)  # each rank reads the file
        m.load_state_dict(loaded["model"])
        opts = make(m.parameters())
        for o, state in zip(opts, loaded["optimizer"]):
            if world == 3:
                shardwrap.load_full_optimizer_state_dict(m, o, state)
            else:
                o.load_state_dict(state)  # a DDP script's resume line
        _step(m, opts, world, rank, 2)
        held = [_numel(o.state.values()) for o in opts]
        _step(m, opts, world, rank, 3)
        return m.full_state_dict(), held

    results = [fn(0, None)] if world == 1 else run_ranks(world, fn, timeout=60.0)
    for state, _ in results:
        torch.testing.assert_close(state, want, atol=tol, rtol=0)
    # each rank holds its pieces of the state (stepped whole: each owner its parameters')
    for i, saved in enumerate(checkpoint["optimizer"]):
        held = [h[i] for _, h in results]
        assert sum(held) == _numel(saved["state"].values()), held
        assert world == 1 or max(held) < sum(held), held


def _numel(state: Iterable[dict[str, Any]]) -> int:
    """The elements of the state tensors (not ``step``) of an optimizer's per-parameter state
    (the 0-d temperature's moments are 0-d too)."""
    return sum(
        v.numel() for s in state for k, v in s.items() if isinstance(v, Tensor) and k != "step"
    )


def test_none_in_the_optimizer_state_is_kept(tmp_path: Path) -> None:
    """Mirrors FSDP1's test_fsdp_optim_state.py::test_state_dict_with_none_tensor_state: a
    ``None`` among a parameter's optimizer state (kept empty until needed) is in the full
    optimizer state dict as in the unwrapped optimizer's, and a checkpoint brings it back. Before,
    both refused it, and ``full_optimizer_state_dict``'s message began ``save_checkpoint:``."""
    ref, ref_opts = _reference(adamw, [2])
    for o in ref_opts:
        for state in o.state.values():
            state["held"] = None
    want = ref_opts[0].state_dict()
    model = build()

    def fn(rank: int, pg: ProcessGroup) -> list[dict[str, Any]]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opts = adamw(m.parameters())
        _step(m, opts, 2, rank, 0)
        for state in opts[0].state.values():
            state["held"] = None
        full = shardwrap.full_optimizer_state_dict(m, opts[0])
        shardwrap.save_checkpoint(tmp_path / "ckpt", m, opts[0])
        fresh = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        loaded = adamw(fresh.parameters())
        shardwrap.load_checkpoint(tmp_path / "ckpt", fresh, loaded[0])
        assert all(s["held"] is None for s in loaded[0].state.values())
        return full

    for full in run_ranks(2, fn, timeout=60.0):
        assert [s["held"] for s in full["state"].values()] == [None] * len(want["state"])
        strip = {i: {k: v for k, v in s.items() if k != "held"} for i, s in full["state"].items()}
        want_stripped = {
            i: {k: v for k, v in s.items() if k != "held"} for i, s in want["state"].items()
        }
        torch.testing.assert_close(strip, want_stripped, atol=1e-5, rtol=0)


def test_the_empty_dict_rank0_only_gives_other_ranks_is_refused_naming_it() -> None:
    """``full_optimizer_state_dict(..., rank0_only=True)`` gives ranks other than 0 ``{}``;
    handed to ``load_full_optimizer_state_dict`` there it raised a bare ``KeyError: 'state'``.
    Now it says what the dict is and how every rank gets the whole state, loading nothing."""
    model = build()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opts = adamw(m.parameters())
        _step(m, opts, 2, rank, 0)
        state = shardwrap.full_optimizer_state_dict(m, opts[0], rank0_only=True)
        fresh = adamw(m.parameters())[0]
        if rank == 0:
            shardwrap.load_full_optimizer_state_dict(m, fresh, state)
            assert len(fresh.state) == len(opts[0].state)
            return
        assert state == {}
        with pytest.raises(ValueError, match=r"no 'state' and no 'param_groups' \(empty: .*rank0"):
            shardwrap.load_full_optimizer_state_dict(m, fresh, state)
        assert fresh.state == {}

    run_ranks(2, fn, timeout=60.0)
