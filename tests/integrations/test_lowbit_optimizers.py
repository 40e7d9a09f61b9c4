"""Low-bit optimizers train a wrapped model exactly, with state that does not depend on the
world size: torchao's ``AdamW8bit``, ``AdamW4bit`` and ``AdamWFp8`` (whose step torchao
compiles) and bitsandbytes' ``AdamW8bit`` (its CPU kernels).

Each is trained on the unwrapped model over each global batch, its gradient accumulated over
the ranks' slices in rank order, and on a ``ShardedModule`` copy at 1, 2 and 4 ranks, each on
its slice (stages follow ``pytest --stage N``; the suite runs 1, 2 and 3): after four steps
every parameter must be bit for bit the unwrapped model's. Block-wise quantized state turns a
last-bit difference of a gradient into a different code, so the reference adds the slices'
gradients in the order shardwrap's reductions do, not one pass over the batch (that differs
from it by up to 3e-4 at 4 ranks, as DDP's would). The model's matrices have 6144 and 4096
elements: quantized whole, left in float32 as any rank's piece of them would be. The state each
parameter gets, counted in bytes over every rank, must equal the unwrapped model's optimizer's
at every world size. Also: the state saved at 2 ranks, blocking or not, loads at 4 and training
goes on exactly, in the same low-bit form.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_lowbit_optimizers.py``
"""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import bitsandbytes
import pytest
import torch
import torchao.optim
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule
from shardwrap.checkpoint.optimizer_state import check_whole_state
from tests.support.parity import slice_summed_grads
from tests.support.ranks import run_ranks

MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class SerialAdamW8bit(bitsandbytes.optim.AdamW8bit):
    """bitsandbytes' ``AdamW8bit``, one parameter's update at a time in this process.

    HACK: its CPU kernels are not safe to run from several threads at once, and the ranks here
    are threads: at 4 ranks, with three such processes on the 2-core machine, 8 of 75 runs ended
    with a parameter far off without this lock, 0 of 75 with it. Real ranks are processes.
    (Its ``step`` is the base's, so it is stepped whole like the base.)
    """

    _lock = threading.Lock()

    def update_step(self, *args: object) -> None:
        with self._lock:
            super().update_step(*args)


OPTIMIZERS: dict[str, MakeOptimizer] = {
    "torchao.AdamW8bit": lambda ps: torchao.optim.AdamW8bit(ps, lr=1e-2),
    "torchao.AdamW4bit": lambda ps: torchao.optim.AdamW4bit(ps, lr=1e-2),
    "torchao.AdamWFp8": lambda ps: torchao.optim.AdamWFp8(ps, lr=1e-2),
    "bitsandbytes.AdamW8bit": lambda ps: SerialAdamW8bit(ps, lr=1e-2),
}
STEPS = 4
TIMEOUT = 300.0  # a rank may wait while another compiles its first step (torchao's)


class Block(nn.Module):
    """A residual MLP of 64 -> 96 -> 64: two matrices of 6144 elements, two biases."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(64, 96)
        self.down = nn.Linear(96, 64)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Model(nn.Module):
    """Two blocks and a 64 x 64 head (4096 elements) the root holds."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(64, 64)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> Model:
    torch.manual_seed(0)
    return Model()


_data = torch.Generator().manual_seed(1)
BATCHES = [
    (torch.randn(8, 64, generator=_data), torch.randn(8, 64, generator=_data)) for _ in range(STEPS)
]


def loss_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(inputs), targets)


def state_bytes(optimizer: torch.optim.Optimizer, model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter's optimizer state on this rank, by name: every tensor it holds
    (a subclass's parts: codes, scales, lookup table), scalars (the step count) left out."""
    names = {id(p): n for n, p in model.named_parameters()}
    held = {}
    for p, state in optimizer.state.items():
        tensors = [t for v in state.values() if isinstance(v, Tensor) for t in _parts(v)]
        held[names[id(p)]] = sum(t.numel() * t.element_size() for t in tensors if t.ndim)
    return held


def _parts(t: Tensor) -> list[Tensor]:
    if type(t) is Tensor:
        return [t]
    names, _ = t.__tensor_flatten__()
    return [getattr(t, n) for n in names]


def train_reference(
    make: MakeOptimizer, world_sizes: list[int]
) -> tuple[dict[str, Tensor], dict[str, int]]:
    """The unwrapped model trained on ``BATCHES``, step ``i``'s gradient accumulated over
    ``world_sizes[i]`` slices in order; its parameters and its optimizer's bytes per name."""
    model = build()
    optimizer = make(model.parameters())
    for batch, world in zip(BATCHES, world_sizes):
        step_unwrapped(model, optimizer, batch, world)
    return copy.deepcopy(model.state_dict()), state_bytes(optimizer, model)


def step_unwrapped(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[Tensor, Tensor], world: int
) -> None:
    """One step of the unwrapped model: the gradient summed over ``world`` slices of
    ``batch`` in rank order, then averaged, as shardwrap's reductions add them."""
    slice_summed_grads(model, loss_fn, *batch, world)
    optimizer.step()
    optimizer.zero_grad()


def train_sharded(
    make: MakeOptimizer,
    world_size: int,
    steps: range,
    load: Path | None = None,
    save: Path | None = None,
    blocking: bool = True,
) -> list[tuple[dict[str, Tensor], dict[str, int]]]:
    """A ``ShardedModule`` copy on every rank, trained on ``BATCHES[steps]`` (after loading the
    checkpoint ``load``; saving to ``save`` after, ``blocking`` or not); each rank's full
    parameters and state bytes."""

    built = build()  # once: ranks drawing weights from torch's one generator draw differently

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[dict[str, Tensor], dict[str, int]]:
        model = ShardedModule(copy.deepcopy(built), auto_wrap=Block, process_group=pg)
        optimizer = make(model.parameters())
        if load is not None:
            shardwrap.load_checkpoint(load, model, optimizer)
        for inputs, targets in (BATCHES[i] for i in steps):
            x, y = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
            loss_fn(model, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if save is not None:
            saved = shardwrap.save_checkpoint(save, model, optimizer, blocking=blocking)
            if not blocking:  # a pending save: the state is held as of the call, written now
                saved.wait()
        return model.full_state_dict(), state_bytes(optimizer, model)

    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=TIMEOUT)


def _assert_exact(ref: dict[str, Tensor], got: dict[str, Tensor], rank: int) -> None:
    assert got.keys() == ref.keys()
    torch.testing.assert_close(
        got, ref, atol=0, rtol=0, msg=lambda m: f"rank {rank}, parameters after the steps: {m}"
    )


def _summed(runs: list[tuple[dict[str, Tensor], dict[str, int]]]) -> dict[str, int]:
    """Each parameter's state bytes over every rank."""
    total: dict[str, int] = {}
    for _, held in runs:
        for name, n in held.items():
            total[name] = total.get(name, 0) + n
    return total


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_low_bit_optimizers_train_like_the_plain_model(name: str, world_size: int) -> None:
    make = OPTIMIZERS[name]
    ref, ref_bytes = train_reference(make, [world_size] * STEPS)
    moved = max((ref[k] - v).abs().max().item() for k, v in build().state_dict().items())
    assert moved > 1e-3, "the reference did not train; parity would prove nothing"
    runs = train_sharded(make, world_size, range(STEPS))
    for rank, (state, _) in enumerate(runs):
        _assert_exact(ref, state, rank)
    assert _summed(runs) == ref_bytes
    matrices = {n: p.numel() for n, p in build().named_parameters() if p.ndim == 2}
    assert all(ref_bytes[n] < 3 * numel for n, numel in matrices.items()), ref_bytes  # low-bit


@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "non-blocking"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_low_bit_state_saved_at_two_ranks_loads_at_four(
    name: str, blocking: bool, tmp_path: Path
) -> None:
    make = OPTIMIZERS[name]
    half = STEPS // 2
    train_sharded(make, 2, range(half), save=tmp_path / "ckpt", blocking=blocking)
    runs = train_sharded(make, 4, range(half, STEPS), load=tmp_path / "ckpt")
    ref, ref_bytes = train_reference(make, [2] * half + [4] * (STEPS - half))
    for rank, (state, _) in enumerate(runs):
        _assert_exact(ref, state, rank)
    assert _summed(runs) == ref_bytes


def test_packed_state_parts_larger_than_their_parameter_are_refused() -> None:
    """A checkpoint's low-bit state is checked before a load reads it: the lookup table (256
    codes) and the codes and scales of a (96, 64) weight pass; a part, or the tensor a record
    rebuilds, larger than the weight's state can be is refused by name."""
    weight = nn.Parameter(torch.zeros(96, 64))
    optimizer = torchao.optim.AdamW8bit([weight])
    record = {"exp_avg": {"parts": ["codes", "scale", "qmap"], "shape": [96, 64]}}
    parts = {"exp_avg.codes": (96, 64), "exp_avg.scale": (24,), "exp_avg.qmap": (256,)}
    check_whole_state(optimizer, "w", (96, 64), parts, "metadata.json", record)
    with pytest.raises(ValueError, match=r"'exp_avg.codes' of 'w' with shape \(96, 6400\)"):
        crafted = {**parts, "exp_avg.codes": (96, 6400)}
        check_whole_state(optimizer, "w", (96, 64), crafted, "metadata.json", record)
    with pytest.raises(ValueError, match=r"'exp_avg' of 'w' with shape \(96, 6400\)"):
        rebuilt = {"exp_avg": {**record["exp_avg"], "shape": [96, 6400]}}
        check_whole_state(optimizer, "w", (96, 64), parts, "metadata.json", rebuilt)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_full_optimizer_state_is_the_unwrapped_optimizers_and_resumes_both(name: str) -> None:
    """``full_optimizer_state_dict`` of a low-bit optimizer holds each state tensor in the
    unwrapped optimizer's own form (torchao's ``OptimState8bit`` and kin, whole), so it loads
    into the unwrapped model's optimizer and, by ``load_full_optimizer_state_dict``, into a
    sharded one, and each trains on exactly (before: torchao's moments came out as their parts,
    ``exp_avg.codes``, ..., which both loads took and the next step failed on, ``KeyError:
    'exp_avg'``). bitsandbytes' own ``state_dict()`` nests its quantized state under one key,
    which its ``load_state_dict`` also takes unnested, as the full state holds it."""
    make = OPTIMIZERS[name]
    half = STEPS // 2
    built = build()

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Any], dict[str, Tensor], dict]:
        model = ShardedModule(copy.deepcopy(built), auto_wrap=Block, process_group=pg)
        optimizer = make(model.parameters())
        for inputs, targets in BATCHES[:half]:
            loss_fn(model, inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            optimizer.step()
            optimizer.zero_grad()
        full = shardwrap.full_optimizer_state_dict(model, optimizer)
        weights = model.full_state_dict()
        resumed = ShardedModule(copy.deepcopy(built), auto_wrap=Block, process_group=pg)
        resumed.load_state_dict(weights)
        again = make(resumed.parameters())  # a load steps what it is given: a state of its own
        loaded = shardwrap.full_optimizer_state_dict(model, optimizer)
        shardwrap.load_full_optimizer_state_dict(resumed, again, loaded)
        for inputs, targets in BATCHES[half:]:
            loss_fn(resumed, inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            again.step()
            again.zero_grad()
        return full, weights, resumed.full_state_dict()

    runs = run_ranks(2, fn, timeout=TIMEOUT)
    unwrapped = build()
    reference = make(unwrapped.parameters())
    for batch in BATCHES[:half]:
        step_unwrapped(unwrapped, reference, batch, 2)
    want = reference.state_dict()["state"]
    ref, _ = train_reference(make, [2] * STEPS)
    for rank, (full, weights, resumed) in enumerate(runs):
        assert full["state"].keys() == want.keys()
        for i, state in want.items() if name.startswith("torchao") else ():
            got = {k: type(v) for k, v in full["state"][i].items()}
            assert got == {k: type(v) for k, v in state.items()}, (rank, i, got)
        _assert_exact(ref, resumed, rank)
        plain = build()
        plain.load_state_dict(weights)
        plain_opt = make(plain.parameters())
        plain_opt.load_state_dict(full)
        for batch in BATCHES[half:]:
            step_unwrapped(plain, plain_opt, batch, 2)
        _assert_exact(ref, dict(plain.state_dict()), rank)


def test_a_bitsandbytes_setting_made_before_wrapping_holds() -> None:
    """bitsandbytes keeps a per-parameter setting (``GlobalOptimManager.override_config(p,
    "optim_bits", 32)``, made before the model is wrapped, as its documentation shows) by the
    parameter object: wrapping carries it to the shard parameter, so that weight's state is
    32-bit as on the unwrapped model and training matches it exactly (before: 8-bit state, the
    weights 0.0146 off after four steps, without a word)."""
    manager = bitsandbytes.optim.GlobalOptimManager.get_instance()
    make = OPTIMIZERS["bitsandbytes.AdamW8bit"]
    built = build()

    def with_setting(model: nn.Module) -> nn.Module:
        manager.override_config(model.blocks[0].up.weight, "optim_bits", 32)
        return model

    reference = with_setting(copy.deepcopy(built))
    optimizer = make(reference.parameters())
    for batch in BATCHES:
        step_unwrapped(reference, optimizer, batch, 2)
    want = optimizer.state[reference.blocks[0].up.weight]["state1"].dtype
    assert want == torch.float32

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, Tensor], list[torch.dtype]]:
        model = ShardedModule(with_setting(copy.deepcopy(built)), auto_wrap=Block, process_group=pg)
        sharded = make(model.parameters())
        for inputs, targets in BATCHES:
            loss_fn(model, inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            sharded.step()
            sharded.zero_grad()
        state = sharded.state.get(model.blocks[0].up.weight, {})
        return model.full_state_dict(), [state["state1"].dtype] if state else []

    try:
        runs = run_ranks(2, fn, timeout=TIMEOUT)
    finally:
        manager.initialize()  # the manager is process-wide: leave it as it was
    assert [d for _, dtypes in runs for d in dtypes] == [want]  # on its owner alone
    for rank, (state, _) in enumerate(runs):
        _assert_exact(dict(reference.state_dict()), state, rank)
