"""Writes inside ``gathered()`` other than edits of the full parameters: loads (the model's,
a submodule's), an optimizer step and ``load_checkpoint`` (which write the pieces), blocks
nested in one another, a whole value copied into a piece; and whole gradients
(``with_grads=True``) refused while gradients are unreduced or asked by some ranks only.

Inside the block the module's attributes are the full parameters and ``model.parameters()``
stays the pieces. A load through the module writes both, so a ``modifier_rank``'s load reaches
every rank; a write through the pieces is the weights' at once and is never undone by the
write-back; a flat group written both ways raises on every rank. Each case is checked against
the values loaded or a deep-copied plain model given the same step, at 2 ranks, stages 1-3.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_writes_inside_gathered.py -q``
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import MixedPrecision, ShardedModule
from tests.support.peers import full_param
from tests.support.ranks import run_ranks

WORLD = 2
STAGES = [1, 2, 3]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(torch.relu(self.a(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.b1 = Block()
        self.b2 = Block()
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.b2(self.b1(x)))


@functools.cache
def _net() -> Net:
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return Net()


@functools.cache
def _other() -> dict[str, Tensor]:
    """Weights to load: another draw of the same model."""
    with torch.random.fork_rng():
        torch.manual_seed(1)
        return Net().state_dict()


def _wrap(pg: ProcessGroup, stage: int) -> Any:
    return ShardedModule(copy.deepcopy(_net()), process_group=pg, auto_wrap=Block, stage=stage)


def _x(rank: int, world: int) -> Tensor:
    return torch.randn(4 * WORLD, 8, generator=torch.Generator().manual_seed(2)).chunk(world)[rank]


def _sgd_step(m: nn.Module, rank: int, world: int) -> torch.optim.Optimizer:
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m(_x(rank, world)).square().mean().backward()
    return opt


def _block(m: Any, kind: str) -> Any:
    return {
        "gathered()": m.gathered(),
        "writeback=True": m.gathered(writeback=True),
        "modifier_rank=0": m.gathered(modifier_rank=0),
    }[kind]


LOADS: dict[str, Callable[[Any], Any]] = {
    "load_state_dict": lambda m: m.load_state_dict(_other()),
    "load_full_state_dict": lambda m: m.load_full_state_dict(_other()),
    "a submodule's load_state_dict": lambda m: m.b1.load_state_dict(
        {k.removeprefix("b1."): v for k, v in _other().items() if k.startswith("b1.")}
    ),
}


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["gathered()", "writeback=True", "modifier_rank=0"])
@pytest.mark.parametrize("load", LOADS)
def test_a_load_inside_gathered_is_what_the_block_reads_and_what_stays(
    load: str, kind: str, stage: int
) -> None:
    """Every rank loads (with ``modifier_rank=0`` rank 0 alone, as DeepSpeed's loads under
    ``GatheredParameters(modifier_rank=0)``): inside the block the module's attributes hold the
    loaded values, and after it every rank holds them (before: the write-back of the unchanged
    full parameters undid the load without a word, and a submodule's load raised torch's size
    mismatch against the pieces)."""
    want = _other() if load != "a submodule's load_state_dict" else _partly_loaded()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        with _block(m, kind):
            if kind != "modifier_rank=0" or rank == 0:
                LOADS[load](m)
                torch.testing.assert_close(m.b1.a.weight, want["b1.a.weight"], atol=0, rtol=0)
                torch.testing.assert_close(m.b1.norm.bias, want["b1.norm.bias"], atol=0, rtol=0)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, want, atol=0, rtol=0)


def _partly_loaded() -> dict[str, Tensor]:
    state = dict(_net().state_dict())
    state.update({k: v for k, v in _other().items() if k.startswith("b1.")})
    return state


@pytest.mark.parametrize("stage", STAGES)
def test_a_submodules_load_outside_gathered_loads_on_every_rank_and_trains_on(stage: int) -> None:
    """``model.b1.load_state_dict(whole values)``, as on the unwrapped model: each rank cuts
    them to its pieces (before: torch's size mismatch on the ranks whose piece was not the
    whole parameter, while a rank holding a whole LayerNorm loaded it, and the ranks parted
    ways). Training then goes on exactly as the plain model's given the same load."""
    part = {k.removeprefix("b1."): v for k, v in _other().items() if k.startswith("b1.")}
    plain = copy.deepcopy(_net())
    plain.b1.load_state_dict(part)
    _sgd_step(plain, 0, 1).step()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        m.b1.load_state_dict(part)
        _sgd_step(m, rank, WORLD).step()
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-6, rtol=0)


PIECE_WRITES = ["optimizer step", "load_checkpoint", "zeroed through model.parameters()"]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("kind", ["gathered()", "writeback=True", "modifier_rank=0"])
@pytest.mark.parametrize("write", PIECE_WRITES)
def test_writes_to_the_pieces_inside_gathered_stand(
    write: str, kind: str, stage: int, tmp_path: Path
) -> None:
    """An optimizer step, ``load_checkpoint`` and ``p.zero_()`` over ``model.parameters()``
    inside the block write the pieces, which are the weights: they stand after it, whatever
    ``writeback`` (before: the write-back of the full parameters, unchanged, undid them
    without a word). The values equal the plain model's given the same write."""
    plain = copy.deepcopy(_net())
    if write == "optimizer step":
        _sgd_step(plain, 0, 1).step()
    elif write == "load_checkpoint":
        plain.load_state_dict(_other())
    else:
        with torch.no_grad():
            for p in plain.parameters():
                p.zero_()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        if write == "load_checkpoint":
            saved = _wrap(pg, stage)
            saved.load_state_dict(_other())
            shardwrap.save_checkpoint(tmp_path / f"ckpt-{stage}", saved)
        opt = _sgd_step(m, rank, WORLD) if write == "optimizer step" else None
        with _block(m, kind):
            if opt is not None:
                opt.step()
            elif write == "load_checkpoint":
                shardwrap.load_checkpoint(tmp_path / f"ckpt-{stage}", m)
            else:
                with torch.no_grad():
                    for p in m.parameters():
                        p.zero_()
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, plain.state_dict(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_a_flat_group_written_both_ways_raises_on_every_rank_writing_nothing_back(
    stage: int,
) -> None:
    """An optimizer step (the pieces) and an edit of a full parameter of the same unit in one
    ``gathered(writeback=True)`` block: writing the full parameters back would undo the step.
    Every rank raises, naming the parameters, and writes nothing back; the step stands."""
    stepped = copy.deepcopy(_net())
    _sgd_step(stepped, 0, 1).step()

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, dict[str, Tensor]]:
        m = _wrap(pg, stage)
        opt = _sgd_step(m, rank, WORLD)
        with pytest.raises(ValueError) as raised, m.gathered(writeback=True):
            opt.step()
            with torch.no_grad():
                m.b1.a.weight.fill_(3.0)
        return str(raised.value), m.full_state_dict()

    for message, state in run_ranks(WORLD, fn, timeout=30):
        assert "written both through model.parameters()" in message
        assert "Nothing was written back; the pieces' writes stand" in message
        torch.testing.assert_close(state, stepped.state_dict(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("outer", [False, True], ids=["outer gathered()", "outer writeback"])
def test_gathered_blocks_nest(outer: bool, stage: int) -> None:
    """An inner block leaves the units gathered for the rest of the outer one (before: its exit
    resharded them, so the outer block's later edits hit the pieces, and the outer write-back
    raised that a group was not gathered). The inner block's edits are written back at its
    exit with its ``writeback``; the outer block's later ones only with the outer's."""

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        with m.gathered(writeback=outer), torch.no_grad():
            with m.gathered(writeback=True):
                m.b1.a.weight.fill_(1.0)
            with m.gathered():
                assert m.b2.a.weight.shape == (8, 8)
            assert m.b1.a.weight.shape == (8, 8) and m.b1.a.weight.sum() == 64.0
            m.b2.a.weight.fill_(2.0)
        return m.full_state_dict()

    want = dict(_net().state_dict())
    want["b1.a.weight"] = torch.full((8, 8), 1.0)
    if outer:
        want["b2.a.weight"] = torch.full((8, 8), 2.0)
    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, want, atol=0, rtol=0)


@pytest.mark.parametrize("through", ["named_parameters()", "p.data", "state_dict()"])
def test_a_whole_value_copied_into_a_piece_is_refused_naming_the_load(through: str) -> None:
    """FSDP's loading idiom ``for n, p in model.named_parameters(): p.copy_(sd[n])`` inside
    ``gathered(writeback=True)``, where the parameters are the pieces (before: torch's "The
    size of tensor a (40) must match the size of tensor b (8)"), and the same through ``.data``
    and the values of ``state_dict()``: refused naming ``load_state_dict``; then the load the
    message names works."""
    sd = _other()

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, 3)
        with m.gathered(writeback=True), torch.no_grad():
            if through == "state_dict()":
                targets = list(m.state_dict().items())
            else:
                targets = [
                    (n, p.data if through == "p.data" else p) for n, p in m.named_parameters()
                ]
            name, target = next((n, t) for n, t in targets if n == "b1.a.weight")
            with pytest.raises(ValueError, match=r"load_state_dict\(state_dict\)"):
                target.copy_(sd[name])
            m.load_state_dict(sd)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, sd, atol=0, rtol=0)


def test_a_rank_raising_inside_a_nested_block_writes_nothing_back() -> None:
    """A rank raising inside an inner ``gathered(writeback=True)``: no rank writes the inner
    block's edits back, and the outer block goes on."""

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, 3)
        with m.gathered(), torch.no_grad():
            expected = RuntimeError if rank == 1 else ValueError
            with pytest.raises((RuntimeError, ValueError)) as raised:
                with m.gathered(writeback=True):
                    m.head.weight.fill_(9.0)
                    if rank == 0:
                        raise ValueError("rank 0's own error")
            assert isinstance(raised.value, expected)
            assert m.head.weight.shape == (3, 8)
        return m.full_state_dict()

    for state in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(state, _net().state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("writeback", [False, True])
def test_a_forward_inside_gathered_under_mixed_precision_never_writes_rounded_values(
    writeback: bool,
) -> None:
    """Under bfloat16 mixed precision a forward inside the block gathers its units again in
    bfloat16. Inside ``gathered(writeback=True)`` that would replace the float32 full
    parameters it writes back (before: every weight came back rounded to bfloat16, up to 8e-3
    off, without a word): refused on every rank, naming the fix, writing nothing back. Inside
    ``gathered()`` the forward runs and the weights stay as they were."""

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        m = ShardedModule(
            copy.deepcopy(_net()),
            process_group=pg,
            auto_wrap=Block,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16),
        )
        before = m.full_state_dict()
        with torch.no_grad():
            if writeback:
                with pytest.raises(RuntimeError, match="Run the forward after the block"):
                    with m.gathered(writeback=True):
                        m.head.weight.fill_(1.0)
                        m(_x(rank, WORLD))
            else:
                with m.gathered():
                    m(_x(rank, WORLD))
        return before, m.full_state_dict()

    for before, after in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(after, before, atol=0, rtol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_whole_gradients_are_refused_while_gradients_are_unreduced(stage: int) -> None:
    """``gathered(with_grads=True)`` after a backward under ``no_sync()``: each rank holds its
    own unreduced gradients and no whole gradient exists, so every rank raises naming
    ``no_sync()``, nothing changed; after the synced backward the block shows the reduced
    gradients, equal to those of the plain model given both micro-batches."""
    plain = copy.deepcopy(_net())
    for micro in range(2):
        plain(_x(0, 1)[micro * 4 : (micro + 1) * 4]).square().mean().backward()
    want = {n: p.grad for n, p in plain.named_parameters()}

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = _wrap(pg, stage)
        x = _x(rank, WORLD)
        with m.no_sync():
            m(x[:2]).square().mean().backward()
        with pytest.raises(RuntimeError, match=r"not yet reduced \(backward ran inside no_sync"):
            with m.gathered(with_grads=True):
                pass
        m(x[2:]).square().mean().backward()
        with m.gathered(with_grads=True):
            return {n: full_param(m, n).grad.clone() for n in want}

    for got in run_ranks(WORLD, fn, timeout=30):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_with_grads_on_some_ranks_only_raises_on_every_rank() -> None:
    """A rank entering ``gathered(with_grads=True)`` while another enters ``gathered()``
    would gather gradients the other never sends: every rank raises at the block's handshake,
    naming what each was doing, instead of waiting; ``with_grads`` other than a bool is a
    ``TypeError`` before any collective."""

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = _wrap(pg, 3)
        with pytest.raises(TypeError, match="with_grads"):
            with m.gathered(with_grads="yes"):  # type: ignore[arg-type]
                pass
        with pytest.raises(RuntimeError) as error:
            with m.gathered(with_grads=rank == 0):
                pass
        return str(error.value)

    for message in run_ranks(WORLD, fn, timeout=30):
        assert "gathered(with_grads=True)" in message
