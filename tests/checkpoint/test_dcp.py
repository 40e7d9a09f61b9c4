"""What ``torch.distributed.checkpoint`` (DCP) is handed for a sharded model, in process.

DCP's save and load need the default process group, which ranks as threads do not have: the
saves, loads and FSDP2 checkpoints themselves are in ``tests/e2e/test_dcp.py``. Here, at 2
ranks as threads, what DCP's state-dict functions and its ``async_save`` staging are handed
(they need no default group). Proves:

- a flat range of a row-major tensor is at most ``2 * ndim - 1`` rectangles, in order, each a
  contiguous run of it (every range of tensors of 1 to 4 dimensions);
- ``get_model_state_dict`` / ``get_optimizer_state_dict`` show each piece as a ``DCPPiece`` of
  the whole tensor's shape whose rectangles, from both ranks, make up the whole model and
  optimizer state exactly (AdamW, Muon with AdamW, Adafactor: a parameter's owner alone shows
  its state, the other rank the same names, empty; SGD's momentum buffers, made from the
  gradients, and Adagrad's sums, made by its constructor and shown before any step); with
  ``full_state_dict=True`` (and ``cpu_offload``) they return the whole tensors, equal to
  ``full_state_dict()`` and ``full_optimizer_state_dict``, and ``set_*_state_dict`` loads such
  a whole state back;
- an optimizer whose state lies on some ranks only (Muon over one matrix: its owner's) is taken
  and set by DCP's functions on every rank, and nothing is stepped: stepped, or loaded fresh;
- ``async_save``'s stagers (``DefaultStager``, and ``BlockingAsyncStager``, which
  ``FileSystemWriter`` is) copy the pieces as pieces; staging ``model.state_dict()``'s pieces
  raises naming ``get_model_state_dict``;
- nothing passes for the whole tensor: a ``DCPPiece`` refuses arithmetic and ``torch.save``,
  DCP refuses ``state_dict()``'s pieces at its first look, and ``load_state_dict`` refuses
  another rank's.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_dcp.py -q``
"""

from __future__ import annotations

import copy
import io
import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.staging import (
    BlockingAsyncStager,
    DefaultStager,
    StagingOptions,
)
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.checkpoint.utils import find_tensor_shard
from torch.distributed.device_mesh import DeviceMesh

import shardwrap
from shardwrap import ShardedModule
from shardwrap.engine.optim.dcp_pieces import DCPPiece, row_major_chunks
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks
from tests.support.tp import data_rank, parallelize_gpt, run_mesh_ranks, tp_gpt

Optimizers = list[torch.optim.Optimizer]


def adamw(params: Iterable[nn.Parameter]) -> Optimizers:
    return [torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1)]


def muon_adamw(params: Iterable[nn.Parameter]) -> Optimizers:
    params = list(params)
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=2e-2),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
    ]


def adafactor(params: Iterable[nn.Parameter]) -> Optimizers:
    return [torch.optim.Adafactor(params, lr=1e-2)]


def sgd_momentum(params: Iterable[nn.Parameter]) -> Optimizers:
    return [torch.optim.SGD(params, lr=0.1, momentum=0.9)]


OPTIMIZERS = {
    "adamw": adamw,
    "muon": muon_adamw,
    "adafactor": adafactor,
    "sgd-momentum": sgd_momentum,  # its buffers start as clones of the gradients
}


torch.manual_seed(0)
BASE = GPT(width=36, depth=2)  # before any rank runs: ranks as threads share the default RNG
TP_BASE = tp_gpt()


def wrapped(pg: ProcessGroup) -> nn.Module:
    return ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)


def trained(rank: int, pg: ProcessGroup, make: Callable) -> tuple[nn.Module, Optimizers]:
    model = wrapped(pg)
    optimizers = make(model.parameters())
    for step in range(2):
        idx, targets = make_batch(seed=100 * step + rank, batch=2)
        model(idx, targets).backward()
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    return model, optimizers


def whole(model: nn.Module, optimizers: Optimizers) -> dict[str, Tensor]:
    """The whole state, flat, by DCP's names, from shardwrap's own gathers (every rank)."""
    names = {id(p): n for n, p in model.named_parameters()}
    state = {f"model.{k}": v for k, v in model.full_state_dict().items()}
    for optimizer in optimizers:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        full = shardwrap.full_optimizer_state_dict(model, optimizer)
        for index, entry in full["state"].items():
            for key, value in entry.items():
                state[f"optim.state.{names[id(params[index])]}.{key}"] = value
    return state


def flat(state: Any, prefix: str) -> dict[str, Any]:
    if isinstance(state, dict):
        return {k: v for key, val in state.items() for k, v in flat(val, f"{prefix}.{key}").items()}
    return {prefix: state} if isinstance(state, Tensor) else {}


def test_a_flat_range_is_the_rectangles_it_covers() -> None:
    for shape in [(7,), (3, 5), (1, 6), (4, 1), (2, 3, 4), (2, 1, 3, 2), ()]:
        numel = math.prod(shape)
        whole_tensor = torch.arange(numel).view(shape)
        for start in range(numel + 1):
            for stop in range(start, numel + 1):
                chunks = row_major_chunks(shape, start, stop)
                assert len(chunks) <= max(1, 2 * len(shape) - 1)
                at = start
                for offsets, sizes, first in chunks:
                    box = whole_tensor[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
                    n = math.prod(sizes)
                    assert first == at and box.reshape(-1).tolist() == list(range(at, at + n))
                    at += n
                assert at == stop
    assert row_major_chunks((0, 3), 0, 0) == [((0, 0), (0, 3), 0)]  # every rank holds it


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_dcp_is_shown_each_rank_s_rectangles_of_the_true_tensors(kind: str) -> None:
    def fn(rank: int, pg: ProcessGroup) -> tuple[dict, dict, dict, list[str]]:
        model, optimizers = trained(rank, pg, OPTIMIZERS[kind])
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizers),
        }
        rectangles = {}  # what DCP's save writes: (name, offsets) -> values
        for name, value in flat(state, "").items():
            for item in _create_write_items(name[1:], value):
                box = find_tensor_shard(value, item.index)
                rectangles[(name[1:], tuple(item.index.offset))] = box.clone()
        shown = {k[1:]: tuple(v.shape) for k, v in flat(state, "").items()}
        pieces = [k[1:] for k, v in flat(state, "").items() if isinstance(v, DCPPiece)]
        return whole(model, optimizers), rectangles, shown, pieces

    results = run_ranks(2, fn)
    expected = results[0][0]
    assert results[0][2] == results[1][2]  # the same names and whole shapes on every rank
    assert all(k.startswith("model.") or ".state." in k for k in results[0][3])
    for name, value in expected.items():
        value = torch.as_tensor(value)
        rebuilt = torch.full_like(value, float("nan"), dtype=torch.float64)
        for rectangles in (results[0][1], results[1][1]):
            for (key, offsets), box in rectangles.items():
                if key == name:
                    at = tuple(slice(o, o + s) for o, s in zip(offsets, box.shape))
                    rebuilt[at] = box.double()
        assert results[0][2][name] == tuple(value.shape), name
        torch.testing.assert_close(rebuilt, value.double(), atol=0, rtol=0, msg=name)


def test_state_made_before_the_first_step_is_shown_as_pieces_and_refuses_to_be_saved() -> None:
    """Adagrad makes its ``sum`` in its constructor, so DCP takes its state without the step
    by which it fills an empty one: each sum is still shown as a ``DCPPiece`` of the whole
    parameter's shape (before: a plain tensor of the piece's shape, written as if whole), and
    ``torch.save(optimizer.state_dict())`` is refused naming the calls that save the whole."""

    def fn(rank: int, pg: ProcessGroup) -> dict[str, tuple[int, ...]]:
        model = wrapped(pg)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
        shown = get_optimizer_state_dict(model, optimizer)["state"]
        assert all(isinstance(entry["sum"], DCPPiece) for entry in shown.values())
        with pytest.raises(TypeError, match="full_optimizer_state_dict"):
            torch.save(optimizer.state_dict(), io.BytesIO())
        return {name: tuple(entry["sum"].shape) for name, entry in shown.items()}

    want = {name: tuple(p.shape) for name, p in BASE.named_parameters()}
    assert run_ranks(2, fn) == [want, want]


def one_matrix_muon(params: Iterable[nn.Parameter]) -> Optimizers:
    """Muon over the first matrix only: its owner rank alone holds Muon's state."""
    params = list(params)
    matrix = next(p for p in params if p.ndim == 2)
    return [
        torch.optim.Muon([matrix], lr=2e-2),
        torch.optim.AdamW([p for p in params if p is not matrix], lr=3e-3),
    ]


def test_an_optimizer_with_state_on_some_ranks_only_is_taken_and_set_without_a_step() -> None:
    """DCP's state-dict functions fill an optimizer's empty state by stepping it with zero
    gradients and a learning rate of 0, on each rank where it is empty. Muon's state over one
    matrix lies on its owner alone, so the other rank stepped by itself, and its step waited
    for an exchange the owner never joined (the collective's timeout, as a hang). Now nothing is
    stepped there, as on the unwrapped model, whose state is not empty; both ranks show the
    same names, and the state after a get and a set is the state before, exactly: once
    trained, and once loaded into a fresh wrap (``load_full_optimizer_state_dict``)."""

    def taken_and_set(model: nn.Module, optimizers: Optimizers) -> list[str]:
        before = whole(model, optimizers)
        state = get_optimizer_state_dict(model, optimizers)
        set_optimizer_state_dict(model, optimizers, state)
        after = whole(model, optimizers)
        assert after.keys() == before.keys()
        for name, value in before.items():
            torch.testing.assert_close(after[name], value, atol=0, rtol=0, msg=name)
        return sorted(state["state"])

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[str], list[str], list[int]]:
        model, optimizers = trained(rank, pg, one_matrix_muon)
        held = [len(optimizers[0].state)]
        names = taken_and_set(model, optimizers)
        fresh = wrapped(pg)
        fresh_optimizers = one_matrix_muon(fresh.parameters())
        for optimizer, stepped in zip(fresh_optimizers, optimizers):
            full = shardwrap.full_optimizer_state_dict(model, stepped)
            shardwrap.load_full_optimizer_state_dict(fresh, optimizer, full)
        held.append(len(fresh_optimizers[0].state))
        return names, taken_and_set(fresh, fresh_optimizers), held

    results = run_ranks(2, fn, timeout=30)
    assert sorted(held for _, _, held in results) == [[0, 0], [1, 1]]  # the owner's alone
    names = {n for n, _ in BASE.named_parameters()}
    for trained_names, loaded_names, _ in results:
        assert set(trained_names) == set(loaded_names) == names


@pytest.mark.parametrize("kind", ["adamw", "adafactor"])
def test_full_state_dict_options_give_the_whole_tensors_and_load_them(kind: str) -> None:
    def fn(rank: int, pg: ProcessGroup) -> float:
        model, optimizers = trained(rank, pg, OPTIMIZERS[kind])
        expected = whole(model, optimizers)
        for options in (
            StateDictOptions(full_state_dict=True),
            StateDictOptions(full_state_dict=True, cpu_offload=True),
        ):
            state = {
                "model": get_model_state_dict(model, options=options),
                "optim": get_optimizer_state_dict(model, optimizers, options=options),
            }
            got = flat(state, "")
            got = {k[1:]: v for k, v in got.items() if not k.startswith(".optim.param_groups")}
            assert got.keys() == expected.keys()
            for name, value in expected.items():
                assert type(got[name]) is Tensor, name
                torch.testing.assert_close(got[name], torch.as_tensor(value), atol=0, rtol=0)
        fresh = wrapped(pg)
        fresh_optimizers = OPTIMIZERS[kind](fresh.parameters())
        set_model_state_dict(fresh, state["model"], options=options)
        set_optimizer_state_dict(fresh, fresh_optimizers, state["optim"], options=options)
        loaded = whole(fresh, fresh_optimizers)
        return max(
            (torch.as_tensor(loaded[k]) - torch.as_tensor(v)).abs().max().item()
            for k, v in expected.items()
            if torch.as_tensor(v).numel()
        )

    assert run_ranks(2, fn) == [0.0, 0.0]


def test_async_save_staging_keeps_pieces_as_pieces() -> None:
    def fn(rank: int, pg: ProcessGroup) -> str:
        model, optimizers = trained(rank, pg, adamw)
        state = {
            "model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizers),
        }
        for stager in (
            BlockingAsyncStager(),
            DefaultStager(StagingOptions(False, False, False, False)),
        ):
            staged = flat(stager.stage(state), "")
            for name, value in flat(state, "").items():
                if isinstance(value, DCPPiece):
                    copied = staged[name]
                    assert isinstance(copied, DCPPiece), (type(stager).__name__, name)
                    assert (copied.full_shape, copied.start, copied.stop) == (
                        value.full_shape,
                        value.start,
                        value.stop,
                    )
                    assert torch.equal(copied.local, value.local)
                    assert copied.local.numel() == 0 or (
                        copied.local.data_ptr() != value.local.data_ptr()
                    )
        with pytest.raises(TypeError) as refused:
            BlockingAsyncStager().stage({"model": model.state_dict()})
        return str(refused.value)

    for said in run_ranks(2, fn):
        assert "copies it into a plain tensor" in said and "get_model_state_dict" in said


def test_a_piece_never_passes_for_the_whole_tensor(tmp_path: Path) -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        model = wrapped(pg)
        piece = get_model_state_dict(model)["wte.weight"]
        assert isinstance(piece, DCPPiece) and piece.shape == BASE.wte.weight.shape
        for use in (lambda: piece + 1, lambda: piece.sum(), lambda: piece.clone()):
            with pytest.raises(RuntimeError, match="as torch.distributed.checkpoint takes it"):
                use()
        with pytest.raises(TypeError, match=r"pickling \(torch.save\)"):
            torch.save(piece, io.BytesIO())
        kept = tmp_path / f"kept-{rank}.pt"  # refused before torch.save opens the file
        kept.write_bytes(b"the previous checkpoint")
        with pytest.raises(TypeError, match=r"pickling \(torch.save\)"):
            torch.save({"model": get_model_state_dict(model)}, kept)
        assert kept.read_bytes() == b"the previous checkpoint"
        with pytest.raises(TypeError, match="get_model_state_dict"):
            _create_write_items("wte.weight", model.state_dict()["wte.weight"])
        other = get_model_state_dict(model)
        shifted = (piece.start + 1, piece.stop + 1)  # another rank's range, say
        other["wte.weight"] = DCPPiece(piece.local, piece.full_shape, *shifted)
        with pytest.raises(ValueError, match="of another rank or layout"):
            set_model_state_dict(model, other)

    run_ranks(2, fn)


def test_dcp_pieces_over_a_tensor_parallel_mesh_are_refused_by_name() -> None:
    """Over a dp=2 x tp=2 mesh a piece is a range of its tp rank's block, which a DCP piece's
    rectangles would place in the whole tensor: DCP's state-dict functions raise, naming the
    fix, before anything is handed out; the whole tensors (``full_state_dict=True``) are still
    shown, equal to ``full_state_dict()``."""

    def fn(rank: int, mesh: DeviceMesh) -> None:
        model = parallelize_gpt(copy.deepcopy(TP_BASE), mesh["tp"])
        model = ShardedModule(model, process_group=mesh, auto_wrap=Block)
        optimizers = adamw(model.parameters())
        idx, targets = make_batch(seed=data_rank(mesh)[0], batch=2, vocab=68)
        model(idx, targets).backward()
        optimizers[0].step()
        with pytest.raises(TypeError, match=r"tensor-parallel mesh .* shardwrap.save_checkpoint"):
            get_model_state_dict(model)
        with pytest.raises(TypeError, match=r"tensor-parallel mesh .*\(full_state_dict=True\)"):
            get_optimizer_state_dict(model, optimizers)
        got = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        expected = model.full_state_dict()
        assert got.keys() == expected.keys()
        for key, value in expected.items():
            assert type(got[key]) is Tensor, key
            torch.testing.assert_close(got[key], value, atol=0, rtol=0)

    run_mesh_ranks((2, 2), ("dp", "tp"), fn)
