"""Checkpoints of shape-aware optimizers (Muon, Adafactor) resume at another world size.

Such an optimizer steps each parameter whole on one owner rank, and keeps its state there in
the state's own shapes (Muon's momentum like the matrix, Adafactor's row and column variances).
Proves that this state saves and loads at another world size, stage and ``auto_wrap``, for
Adafactor alone and for Muon over the matrices with AdamW over the rest (a list of two
optimizers, saved and loaded together): trained 2 steps at world size 2 (stage 3, one unit per
``Block``), saved, loaded at world size 4 (stage 2, one unit per ``nn.Linear``) or 1 (stage 3,
one unit), trained 2 more steps, every parameter equals the unwrapped model trained over the
same 4 batches (1e-5; Muon 1e-4, its Newton-Schulz iteration amplifies rounding). The reference
sums each step's gradient over the slices of that step's world size, in the ranks' order, so
the only differences left are the reductions' rounding; against the disk tier the reference
steps with the kernel the tier picks (fused AdamW). Resuming with a fresh optimizer instead
misses the reference by far more: the state is what makes the resumed run exact.

Also: a list of optimizers loads only as saved (as many, each parameter in one of them); with
hybrid sharding one replica writes the state and every replica's owners read it back; after
loading each parameter's state is on its owner alone; a corrupted state tensor is refused
naming it, and a ``whole_state`` entry naming a file outside the folder is refused, before
anything changes; a checkpoint stepped whole does not load into the same class declared
elementwise; version-2 checkpoints (before whole state) still load; ``export`` is unaffected;
with the disk tier the owners' state saves, and loads at another world size into the tier's
files.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_shaped.py -q``
"""

from __future__ import annotations

import copy
import json
import struct
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import Offload, ShardedModule, export, load_checkpoint, save_checkpoint
from shardwrap.comm.mesh import Mesh
from shardwrap.tiers.offload import prefer_fused
from tests.support.hybrid import hybrid_mesh
from tests.support.parity import slice_summed_grads
from tests.support.ranks import run_ranks
from tests.support.store import in_store

Optimizers = torch.optim.Optimizer | list[torch.optim.Optimizer]
MakeOptimizer = Callable[[Iterable[nn.Parameter]], Optimizers]
WIDTH = 32


class Block(nn.Module):
    """A pre-norm residual MLP block: matrices, biases and a norm, each with a gradient."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def build() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, WIDTH), Block(), Block(), nn.Linear(WIDTH, WIDTH))


def loss_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


_data = torch.Generator().manual_seed(1)
BATCHES = [
    (torch.randn(8, WIDTH, generator=_data), torch.randn(8, WIDTH, generator=_data))
    for _ in range(4)
]


def muon(params: Iterable[nn.Parameter]) -> Optimizers:
    """Muon over the matrices, AdamW over the rest, as torch's documentation advises."""
    params = list(params)
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=5e-3),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
    ]


def adafactor(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-2)


OPTIMIZERS: dict[str, tuple[MakeOptimizer, float]] = {
    "muon": (muon, 1e-4),
    "adafactor": (adafactor, 1e-5),
}


def _each(optimizer: Optimizers) -> list[torch.optim.Optimizer]:
    return optimizer if isinstance(optimizer, list) else [optimizer]


def _reference(model: nn.Module, make: MakeOptimizer, worlds: list[int]) -> dict[str, Tensor]:
    """The unwrapped model trained on batch ``i`` whole, its gradient summed over the slices of
    world size ``worlds[i]`` in the ranks' order, then averaged (the ranks' reduction)."""
    ref = copy.deepcopy(model)
    opts = _each(make(ref.parameters()))
    for (inputs, targets), world in zip(BATCHES, worlds):
        slice_summed_grads(ref, loss_fn, inputs, targets, world)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    return {k: v.detach().clone() for k, v in ref.state_dict().items()}


def _stepped_as_on_disk(make: MakeOptimizer) -> MakeOptimizer:
    """``make``, its groups stepped with the kernel the disk tier picks (``prefer_fused``: the
    fused one where a group left the choice to torch), whose last bits differ from the
    per-tensor loop's, and Muon amplifies such bits past its tolerance."""

    def made(params: Iterable[nn.Parameter]) -> Optimizers:
        optimizers = make(params)
        for opt in _each(optimizers):
            for group in opt.param_groups:
                prefer_fused(opt, group)
        return optimizers

    return made


def _train(model: nn.Module, opt: Optimizers, rank: int, world: int, steps: range) -> None:
    for step in steps:
        inputs, targets = BATCHES[step]
        loss_fn(model, inputs.chunk(world)[rank], targets.chunk(world)[rank]).backward()
        for o in _each(opt):
            o.step()
            o.zero_grad()


def _wrap(model: nn.Module, pg: ProcessGroup | Mesh, **options: Any) -> ShardedModule:
    group = pg if isinstance(pg, Mesh) or pg.size() > 1 else None
    return ShardedModule(copy.deepcopy(model), process_group=group, **options)


def _save(
    path: Path, model: nn.Module, make: MakeOptimizer, hybrid: bool = False, **options: Any
) -> None:
    """Train 2 steps at world size 2 (4 with ``hybrid``: 2 x 2), stage 3, and save."""
    world = 4 if hybrid else 2

    def fn(rank: int, pg: ProcessGroup) -> None:
        group = hybrid_mesh(pg) if hybrid else pg
        m = _wrap(model, group, auto_wrap=Block, stage=3, **options)
        opt = make(m.parameters())
        _train(m, opt, rank, world, range(2))
        save_checkpoint(path, m, opt, step=2)

    run_ranks(world, fn)


def _resume(
    path: Path, model: nn.Module, make: MakeOptimizer, world: int, load: bool = True, **wrap: Any
) -> list[tuple[dict[str, Tensor], dict[str, list[int]]]]:
    """Load at ``world`` and train 2 more steps: per rank, the parameters and, of each parameter
    that has state of the shape-aware optimizer right after loading, the shapes of its state
    tensors."""
    other = build()  # other weights: everything must come from the checkpoint
    other.load_state_dict({k: v + 1 for k, v in other.state_dict().items()})

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], dict[str, list[int]]]:
        m = _wrap(other, pg, **wrap)
        opt = make(m.parameters())
        if load:
            assert load_checkpoint(path, m, opt) == {"step": 2}
        else:
            load_checkpoint(path, m)
        names = {id(p): n for n, p in m.named_parameters()}
        held = {
            names[id(p)]: [list(v.shape) for v in s.values() if isinstance(v, Tensor)]
            for p, s in _each(opt)[0].state.items()
        }
        _train(m, opt, rank, world, range(2, 4))
        return m.full_state_dict(), held

    return run_ranks(world, fn)


def _assert_same(ref: dict[str, Tensor], got: dict[str, Tensor], atol: float) -> None:
    assert got.keys() == ref.keys()
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)


def _owned_once(model: nn.Module, runs: list[tuple[Any, dict[str, list[int]]]], name: str) -> None:
    """Each trained parameter's state is on one rank, in the parameter's full shape (Muon) or
    factored by its rows and columns (Adafactor)."""
    shapes = {
        n: list(p.shape) for n, p in model.named_parameters() if name != "muon" or p.ndim == 2
    }
    held = [(n, s) for _, by_name in runs for n, s in by_name.items()]
    assert sorted(n for n, _ in held) == sorted(shapes)
    for n, s in held:
        r = shapes[n]
        if name == "muon":
            assert s == [r], n
        elif len(r) == 2:
            assert sorted(s) == sorted([[], [r[0], 1], [1, r[1]]]), n


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_resume_at_another_world_size_stage_and_policy(tmp_path: Path, name: str) -> None:
    make, atol = OPTIMIZERS[name]
    model = build()
    _save(tmp_path / "ckpt", model, make)
    for world, wrap in ((4, {"auto_wrap": nn.Linear, "stage": 2}), (1, {"stage": 3})):
        ref = _reference(model, make, [2, 2, world, world])
        moved = max((ref[k] - v).abs().max().item() for k, v in model.state_dict().items())
        assert moved > 1e-3, "the reference did not train; parity would prove nothing"
        runs = _resume(tmp_path / "ckpt", model, make, world, **wrap)
        for state, _ in runs:
            _assert_same(ref, state, atol)
        _owned_once(model, runs, name)
    fresh, _ = _resume(tmp_path / "ckpt", model, make, 1, load=False)[0]
    missed = max((fresh[k] - v).abs().max().item() for k, v in ref.items())
    assert missed > 10 * atol, "the optimizer state made no difference; the check proves nothing"


@pytest.mark.stage3  # the disk tier is a stage-3 feature
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_disk_tier_saves_and_loads_the_owners_state_into_its_files(
    tmp_path: Path, name: str
) -> None:
    """Saved from the disk tier at world size 2 and loaded into it at 4, where the owners
    differ: every state tensor loads into the tier's files and training resumes exactly."""
    make, atol = OPTIMIZERS[name]
    model = build()
    _save(tmp_path / "ckpt", model, make, offload=Offload(device="disk", path=tmp_path / "a"))
    other = build()
    other.load_state_dict({k: v + 1 for k, v in other.state_dict().items()})

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[bool]]:
        store = Offload(device="disk", path=tmp_path / "b")
        m = _wrap(other, pg, auto_wrap=Block, offload=store)
        opt = make(m.parameters())
        assert load_checkpoint(tmp_path / "ckpt", m, opt) == {"step": 2}
        placed = [
            in_store(m, v) for o in _each(opt) for s in o.state.values() for v in s.values()
            if isinstance(v, Tensor) and v.dim() > 0
        ]  # fmt: skip
        _train(m, opt, rank, 4, range(2, 4))
        return m.full_state_dict(), placed

    runs = run_ranks(4, fn)
    ref = _reference(model, _stepped_as_on_disk(make), [2, 2, 4, 4])
    for state, _ in runs:
        _assert_same(ref, state, atol)
    placed = [p for _, by_rank in runs for p in by_rank]
    assert placed and all(placed), placed


def test_hybrid_sharding_writes_once_and_loads_into_every_replica(tmp_path: Path) -> None:
    make, atol = OPTIMIZERS["adafactor"]
    model = build()
    _save(tmp_path / "ckpt", model, make, hybrid=True)
    files = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())["files"]
    assert sorted(f for f in files if f.startswith("rank-")) == [
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    ref = _reference(model, make, [4, 4, 2, 2])
    runs = _resume(tmp_path / "ckpt", model, make, 2, auto_wrap=Block)
    for state, _ in runs:
        _assert_same(ref, state, atol)
    _owned_once(model, runs, "adafactor")

    def hybrid(rank: int, pg: ProcessGroup) -> list[str]:
        m = _wrap(model, hybrid_mesh(pg), auto_wrap=nn.Linear)
        opt = make(m.parameters())
        load_checkpoint(tmp_path / "ckpt", m, opt)
        names = {id(p): n for n, p in m.named_parameters()}
        return [names[id(p)] for p in opt.state]

    held = run_ranks(4, hybrid)
    for replica in (held[0] + held[1], held[2] + held[3]):  # ranks 0, 1 and 2, 3 shard together
        assert sorted(replica) == sorted(n for n, _ in model.named_parameters())


def test_whole_state_metadata_is_checked_and_version_2_checkpoints_still_load(
    tmp_path: Path,
) -> None:
    """A ``whole_state`` entry naming a file outside the folder is refused before anything is
    read; a checkpoint of the format before whole state (version 2, an elementwise optimizer)
    loads as it did."""
    model = build()
    _save(tmp_path / "ckpt", model, adafactor)
    _save(tmp_path / "v2", model, lambda ps: torch.optim.AdamW(ps, lr=1e-2))
    meta_path = tmp_path / "ckpt" / "metadata.json"
    meta = json.loads(meta_path.read_text())
    meta["optimizer"]["whole_state"]["1.up.weight"]["row_var"]["file"] = "../elsewhere"
    meta_path.write_text(json.dumps(meta))
    old_path = tmp_path / "v2" / "metadata.json"
    old = json.loads(old_path.read_text())
    assert old["optimizer"].pop("stepped_whole") is False
    assert old["optimizer"].pop("whole_state") == {}
    old_path.write_text(json.dumps({**old, "version": 2}))

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap=Block)
        with pytest.raises(ValueError, match=r'"whole_state" map .* plain name inside the folder'):
            load_checkpoint(tmp_path / "ckpt", m, adafactor(m.parameters()))
        opt = torch.optim.AdamW(m.parameters(), lr=0.5)
        assert load_checkpoint(tmp_path / "v2", m, opt) == {"step": 2}
        assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == len(list(m.parameters()))

    run_ranks(2, fn)


def _flip(path: Path, key: str) -> None:
    """Flip 8 bytes in the middle of ``key``'s data in a safetensors file."""
    data = bytearray(path.read_bytes())
    (length,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + length])[key]["data_offsets"]
    at = 8 + length + (start + stop) // 2
    data[at : at + 8] = bytes(b ^ 0xFF for b in data[at : at + 8])
    path.write_bytes(bytes(data))


def test_a_corrupted_state_tensor_is_refused_and_export_is_unaffected(tmp_path: Path) -> None:
    make, _ = OPTIMIZERS["adafactor"]
    model = build()
    _save(tmp_path / "ckpt", model, make)
    meta = json.loads((tmp_path / "ckpt" / "metadata.json").read_text())
    whole = meta["optimizer"]["whole_state"]["1.up.weight"]
    assert whole["row_var"]["shape"] == [3 * 32, 1] and whole["col_var"]["shape"] == [1, 32]
    file = tmp_path / "ckpt" / whole["row_var"]["file"]
    _flip(file, "optim/row_var/1.up.weight")

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, dict[str, Tensor]]:
        m = _wrap(model, pg, auto_wrap=Block)
        opt = make(m.parameters())
        before = m.full_state_dict()
        # the owner's error naming the tensor, or its peers' naming the owner
        with pytest.raises(Exception) as refused:
            load_checkpoint(tmp_path / "ckpt", m, opt)
        _assert_same(before, m.full_state_dict(), 0.0)
        assert not opt.state
        load_checkpoint(tmp_path / "ckpt", m)  # the model alone reads no optimizer state
        export(tmp_path / "export", m)
        return str(refused.value), m.full_state_dict()

    runs = run_ranks(2, fn)
    named = [e for e, _ in runs if "'optim/row_var/1.up.weight'" in e and "checksum" in e]
    assert len(named) == 1, [e for e, _ in runs]  # its owner read it; the other rank names it
    assert any("failed on rank(s)" in e for e, _ in runs), [e for e, _ in runs]
    _assert_same(runs[0][1], load_file(tmp_path / "export" / "model.safetensors"), 0.0)


def test_a_list_of_optimizers_loads_only_as_saved(tmp_path: Path) -> None:
    model = build()
    _save(tmp_path / "ckpt", model, muon)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap=Block)
        matrices = [p for p in m.parameters() if p.ndim == 2]
        with pytest.raises(ValueError, match=r"2 optimizer\(s\) \(Muon, AdamW\), got 1 \(Muon\)"):
            load_checkpoint(tmp_path / "ckpt", m, torch.optim.Muon(matrices))
        both = [torch.optim.Muon(matrices), torch.optim.AdamW(m.parameters())]
        with pytest.raises(ValueError, match=r"'0\.weight' is in optimizers 0 \(Muon\) and 1"):
            save_checkpoint(tmp_path / "overlap", m, both)
        with pytest.raises(TypeError, match=r"list of optimizers .* got str"):
            save_checkpoint(tmp_path / "overlap", m, "adamw")  # type: ignore[arg-type]

    run_ranks(2, fn)
    assert not (tmp_path / "overlap").exists()


class Declared(torch.optim.Adafactor):
    """An Adafactor subclass whose declaration the test changes."""


def test_whole_and_elementwise_checkpoints_do_not_mix(tmp_path: Path) -> None:
    model = build()
    _save(tmp_path / "whole", model, lambda ps: Declared(ps, lr=1e-2))
    shardwrap.declare_optimizer(Declared, reads_shapes=False)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(model, pg, auto_wrap=Block)
        with pytest.raises(ValueError, match=r"stepped whole.*Declared.*steps each rank's piece"):
            load_checkpoint(tmp_path / "whole", m, Declared(m.parameters(), lr=1e-2))

    try:
        run_ranks(2, fn)
    finally:
        shardwrap.declare_optimizer(Declared, reads_shapes=True)


class _Stacked(torch.optim.Optimizer):
    """A shape-aware optimizer of the user's: each update is the momentum normalised by its
    whole norm; the momentum is kept flat, the last two gradients stacked, and a scale of
    ``copies`` times the parameter's elements (none by default)."""

    def __init__(self, params: Iterable[nn.Parameter], copies: int = 0) -> None:
        super().__init__(params, {"lr": 1e-2})
        self.copies = copies

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["flat"] = torch.zeros(p.numel())
                    state["last"] = torch.zeros(2, *p.shape)
                    if self.copies:
                        state["scale"] = torch.ones(self.copies * p.numel())
                state["last"][0].copy_(state["last"][1])
                state["last"][1].copy_(p.grad)
                flat = state["flat"].mul_(0.9).add_(p.grad.flatten())
                flat.add_(state["last"][0].flatten(), alpha=0.1)
                p.add_((flat / (flat.norm() + 1e-8)).view_as(p), alpha=-group["lr"])


def test_a_declared_optimizers_flat_and_stacked_state_resumes_and_larger_is_refused_at_save(
    tmp_path: Path,
) -> None:
    """A declared shape-aware optimizer keeping its state flat (``(numel,)``) or stacked
    (``(2, *shape)``) saved, then ``load_checkpoint`` refused what it wrote, at any world size:
    such shapes were outside the bound it checks before taking memory. The bound now also takes
    up to 8 times the parameter's elements, and the resumed run matches the unwrapped one;
    state past the bound is refused at the save, on every rank, with nothing written, where it
    was committed and could not be loaded."""
    shardwrap.declare_optimizer(_Stacked, reads_shapes=True)
    model = build()
    _save(tmp_path / "ckpt", model, _Stacked)
    for world in (4, 1):
        ref = _reference(model, _Stacked, [2, 2, world, world])
        for state, _ in _resume(tmp_path / "ckpt", model, _Stacked, world):
            _assert_same(ref, state, 1e-5)
    with pytest.raises(AssertionError, match=r"keeps state 'scale' of .*full_optimizer_state_dict"):
        _save(tmp_path / "larger", model, lambda params: _Stacked(params, copies=9))
    assert not (tmp_path / "larger").exists()
