"""Every torch optimizer trains a wrapped model exactly, those that read a parameter's shape
(Muon, Adafactor) included.

Each is trained on the unwrapped model over each whole global batch (its gradient accumulated
over the ranks' slices; Adafactor also in one pass), and on a ``ShardedModule`` copy on every
rank over its slice; after several steps every parameter must match (within 1e-5;
Muon within 1e-4, its Newton-Schulz iteration amplifies rounding). Muon steps the matrices and
AdamW the rest, as torch's documentation advises. Stages follow ``pytest --stage N`` (the suite
runs at 1, 2 and 3); world sizes 1, 2 and 4, hybrid sharding 2 x 2, tied parameters, bf16 and the
disk tier (where every state tensor an owner's optimizer makes, Muon's, Adafactor's and a
declared one's, is in the tier's files) are covered here, and every stage at 1 to 4 ranks on a
model whose matrices an owner gathers from 3 and 4 ranks' pieces. Also: each optimizer's state is
sharded by owner (about 1/N per rank), LBFGS is refused before it changes anything, an
undeclared optimizer of a user's own warns at its first step until declared, and a declared
one reads each whole gradient's own norm. An optimizer stepping whole parameters on some ranks
and elementwise on others makes every rank raise at once naming what each does (before, the
owners' exchange waited for the others until the group's timeout).
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import MixedPrecision, Offload, ShardedModule
from shardwrap.engine.optim import whole_params
from shardwrap.engine.optim.pieces import piece_of
from tests.support.parity import (
    GLOBAL_BATCH,
    STEPS,
    Trained,
    fp32_grads,
    train_recipe,
    train_reference,
    train_sharded,
)
from tests.support.ranks import run_ranks
from tests.support.store import in_store

WIDTH = 32


class Block(nn.Module):
    """A pre-norm residual MLP block: every parameter has a gradient of its own (no parameter
    whose gradient is zero but for rounding, which Adam-like steps would blow up to noise)."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 3 * WIDTH)
        self.down = nn.Linear(3 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


class MLP(nn.Module):
    """Two blocks between an input and an output projection; ``tied``: they share one weight."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.out = nn.Linear(WIDTH, WIDTH)
        if tied:
            self.out.weight = self.inp.weight

    def forward(self, x: Tensor) -> Tensor:
        x = self.inp(x.to(self.inp.weight.dtype))  # the dtype it computes in
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def build(tied: bool = False) -> MLP:
    torch.manual_seed(0)
    return MLP(tied)


def loss_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
    return nn.functional.mse_loss(model(inputs).float(), targets)


_data = torch.Generator().manual_seed(1)
BATCHES = [
    (
        torch.randn(GLOBAL_BATCH, WIDTH, generator=_data),
        torch.randn(GLOBAL_BATCH, WIDTH, generator=_data),
    )
    for _ in range(STEPS)
]


class Both:
    """Two optimizers stepped as one: the matrices' and the rest's."""

    def __init__(self, *optimizers: torch.optim.Optimizer) -> None:
        self.optimizers = optimizers

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad()


def muon(params: Iterable[nn.Parameter], lr: float = 1e-3) -> Any:
    params = list(params)
    return Both(
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=lr),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=3e-3),
    )


def adafactor(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(params, lr=1e-2)


OPTIMIZERS = {"muon": (muon, 1e-4), "adafactor": (adafactor, 1e-5)}


def _assert_same(ref: dict[str, Tensor], got: dict[str, Tensor], atol: float, rank: int) -> None:
    assert got.keys() == ref.keys()
    torch.testing.assert_close(
        got, ref, atol=atol, rtol=0, msg=lambda m: f"rank {rank}, parameters after the steps: {m}"
    )


def _parity(
    name: str,
    world_size: int,
    tied: bool = False,
    dtype: torch.dtype = torch.float32,
    model: nn.Module | None = None,
    batches: list[tuple[Tensor, Tensor]] = BATCHES,
    make: Callable[[Iterable[nn.Parameter]], Any] | None = None,
    **wrap: Any,
) -> list[Trained]:
    """Parameters after the steps against the unwrapped model trained on each global batch
    (its gradient accumulated over the ranks' slices, in ``dtype`` with fp32 masters); the
    model is ``build(tied)`` wrapped by ``Block``, the optimizer ``OPTIMIZERS[name]``'s, unless
    given."""
    default, atol = OPTIMIZERS[name]
    make = default if make is None else make
    model = build(tied) if model is None else model
    wrap.setdefault("auto_wrap", Block)
    _, ref = train_recipe(model, world_size, dtype, batches, make, loss_fn)
    moved = max((ref[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert moved > 1e-3, "the reference did not train; parity would prove nothing"
    runs = train_sharded(model, world_size, make, batches, loss_fn, **wrap)
    for rank, run in enumerate(runs):
        _assert_same(ref, run.state, atol, rank)
    if name != "muon" and dtype == torch.float32:  # also the whole batch in one pass
        one_pass = train_reference(model, make, batches, loss_fn).state
        for rank, run in enumerate(runs):
            _assert_same(one_pass, run.state, atol, rank)
    return runs


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_shape_aware_optimizers_train_like_the_plain_model(name: str, world_size: int) -> None:
    _parity(name, world_size)


def hf_adafactor(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    import transformers.optimization

    return transformers.optimization.Adafactor(params)  # relative steps, scaled by the RMS


@pytest.mark.parametrize("world_size", [2, 4])
def test_transformers_adafactor_is_stepped_whole_like_the_plain_model(world_size: int) -> None:
    """``TrainingArguments(optim="adafactor")``'s optimizer reads shapes as torch's does, and is
    known as such. Its step also makes state with ``torch.zeros(...).to(grad)``, a plain tensor
    converted like a gradient, which had raised ``AttributeError``."""
    import transformers.optimization

    assert whole_params.steps_whole(transformers.optimization.Adafactor)
    _parity("adafactor", world_size, make=hf_adafactor)


class Pair(nn.Module):
    """Two linears, 16 -> 48 -> 16, with biases."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(16, 48)
        self.down = nn.Linear(48, 16)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.up(x))


class PairMLP(nn.Module):
    """Two ``Pair`` units and a 16 x 16 head: the root holds the head alone, 272 elements, so
    at 3 and 4 ranks its matrix lies across every rank's shard."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Pair() for _ in range(2))
        self.head = nn.Linear(16, 16)

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


_split = torch.Generator().manual_seed(2)
SPLIT_BATCHES = [  # 12 rows: equal slices at 1, 2, 3 and 4 ranks
    (torch.randn(12, 16, generator=_split), torch.randn(12, 16, generator=_split))
    for _ in range(STEPS)
]


def _exchange_extent(
    model: nn.Module, make: Callable[[Iterable[nn.Parameter]], Any]
) -> tuple[int, int]:
    """For the optimizers ``make`` builds over ``model``'s shard parameters, as the whole step
    plans them: the most ranks any parameter is gathered from, and how many parameters are
    owned by a rank that holds none of them."""
    made = make(model.parameters())
    spread, strangers = 1, 0
    for opt in made.optimizers if isinstance(made, Both) else [made]:
        whole = whole_params.stepped_whole(opt)
        for e in whole.entries().values() if whole is not None else ():
            holders = [q for q, (a, b) in enumerate(e.pieces) if b > a]
            spread = max(spread, len(holders))
            strangers += e.owner not in holders
    return spread, strangers


@pytest.mark.stage3  # names its stages itself: once is enough
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_gathered_from_many_ranks_train_like_the_plain_model(
    name: str, world_size: int, stage: int
) -> None:
    """Every stage at 1 to 4 ranks, where at 3 and 4 ranks an owner gathers the head's matrix
    from 3 and 4 ranks' pieces and at 3 ranks Adafactor's owners step vectors they hold none
    of (both asserted, so the test keeps covering them). Muon at ``lr=0.02``, the rate it
    trains at, where a step on wrong values shows most."""
    torch.manual_seed(0)
    model = PairMLP()
    make = functools.partial(muon, lr=0.02) if name == "muon" else OPTIMIZERS[name][0]
    runs = _parity(
        name,
        world_size,
        model=model,
        batches=SPLIT_BATCHES,
        make=make,
        auto_wrap=Pair,
        stage=stage,
        finish=lambda m: _exchange_extent(m, make),
    )
    spread, strangers = runs[0].finished
    assert spread >= min(world_size, 3), "no parameter lies across 3 ranks' shards"
    if (name, world_size) == ("adafactor", 3):
        assert strangers > 0, "every owner holds a piece of what it steps"


ELEMENTWISE = {
    "SGD": dict(lr=0.05, momentum=0.9),
    "Adam": dict(lr=3e-3),
    "AdamW": dict(lr=3e-3),
    "Adagrad": dict(lr=0.05),
    "RMSprop": dict(lr=3e-3),
    "NAdam": dict(lr=3e-3),
    "RAdam": dict(lr=3e-3),
    "Adamax": dict(lr=3e-3),
    "Adadelta": dict(lr=1.0),
    "ASGD": dict(lr=0.05),
    "Rprop": dict(lr=3e-3),
}


@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_optimizers_step_pieces_exactly(name: str) -> None:
    def make(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return getattr(torch.optim, name)(params, **ELEMENTWISE[name])

    model = build()
    _, ref = train_recipe(model, 2, torch.float32, BATCHES, make, loss_fn)
    for rank, run in enumerate(train_sharded(model, 2, make, BATCHES, loss_fn, auto_wrap=Block)):
        _assert_same(ref, run.state, 1e-5, rank)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_tied_parameters_and_hybrid_sharding(name: str) -> None:
    _parity(name, 2, tied=True)
    _parity(name, 4, hybrid=True)


def test_unwrapped_filters_pick_the_same_parameters() -> None:
    model = build()
    matrices = [n for n, p in model.named_parameters() if p.ndim == 2]

    def fn(rank: int, pg: ProcessGroup) -> list[str]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        return [n for n, p in m.named_parameters() if p.ndim == 2]

    assert run_ranks(2, fn) == [matrices, matrices]


def test_state_is_sharded_by_owner() -> None:
    """Each rank holds the state of the parameters it owns: about 1/N of all, none twice."""
    model = build()
    world = 4
    numels = {n: p.numel() for n, p in model.named_parameters()}
    total = sum(numels.values())

    def fn(rank: int, pg: ProcessGroup) -> dict[str, int]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.Adafactor(m.parameters(), lr=1e-2)
        inputs, targets = BATCHES[0]
        loss_fn(m, inputs.chunk(world)[rank], targets.chunk(world)[rank]).backward()
        m.comm_stats.reset()
        opt.step()
        assert m.comm_stats.calls["all_to_all"] == 2  # in and out, counted with the model's
        assert m.comm_stats.bytes["all_to_all"] > 0
        names = {id(p): n for n, p in m.named_parameters()}
        held = {names[id(p)]: numels[names[id(p)]] for p in opt.state}
        for p in m.parameters():  # every parameter is its piece again
            assert p.ndim == 0 or p.shape[:-1] == (1,) * (p.ndim - 1)
        return held

    held = run_ranks(world, fn)
    owned = [sum(h.values()) for h in held]
    names = [n for h in held for n in h]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once
    assert sum(owned) == total
    assert max(owned) <= 1.25 * total / world, owned


def test_bf16_mixed_precision() -> None:
    bf16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    _parity("adafactor", 2, dtype=torch.bfloat16, mixed_precision=bf16)
    _parity("muon", 2, dtype=torch.bfloat16, mixed_precision=bf16)


@pytest.mark.stage3
def test_disk_tier(tmp_path: Path) -> None:
    _parity("muon", 2, offload=Offload(device="disk", path=tmp_path))


class NormalizedMomentum(torch.optim.Optimizer):
    """A user's optimizer that steps each parameter by a momentum of its gradient divided by
    the gradient's whole norm; the momentum is made like the gradient."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum" not in self.state[p]:
                    self.state[p]["momentum"] = torch.zeros_like(p.grad)
                momentum = self.state[p]["momentum"]
                momentum.mul_(0.9).add_(p.grad / p.grad.norm().clamp_min(1e-12))
                p.sub_(group["lr"] * momentum)


shardwrap.declare_optimizer(NormalizedMomentum, reads_shapes=True)


def test_a_declared_optimizer_reads_each_parameters_whole_gradient_norm() -> None:
    """The owner's whole gradient (held whole or gathered) is whole: its norm is its own."""
    model = build()
    for world in (2, 4):
        _, ref = train_recipe(model, world, torch.float32, BATCHES, NormalizedMomentum, loss_fn)
        runs = train_sharded(model, world, NormalizedMomentum, BATCHES, loss_fn, auto_wrap=Block)
        for rank, run in enumerate(runs):
            _assert_same(ref, run.state, 1e-5, rank)


class RowMomentum(torch.optim.Optimizer):
    """A user's optimizer that steps each matrix by a momentum of its gradient normalised per
    row; the momentum is made like the gradient."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.05) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if "momentum" not in self.state[p]:
                    self.state[p]["momentum"] = torch.zeros_like(p.grad)
                momentum = self.state[p]["momentum"].mul_(0.9).add_(p.grad)
                rows = momentum if p.ndim > 1 else momentum.unsqueeze(0)
                update = rows / rows.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                p.sub_(group["lr"] * update.view_as(p))


shardwrap.declare_optimizer(RowMomentum, reads_shapes=True)

STATE_KEYS = {  # per optimizer: the state tensors a parameter of this shape has
    "muon": lambda shape: ["momentum_buffer"] if len(shape) == 2 else [],
    "adafactor": lambda shape: ["row_var", "col_var"] if len(shape) == 2 else ["variance"],
    "declared": lambda shape: ["momentum"],
}
MAKERS = {"muon": muon, "adafactor": adafactor, "declared": RowMomentum}


@pytest.mark.stage3
@pytest.mark.parametrize("name", list(STATE_KEYS))
def test_disk_tier_keeps_the_owners_state_in_its_files(tmp_path: Path, name: str) -> None:
    """With the disk tier the state an optimizer stepping whole parameters makes on the owner
    is in the tier's files, as elementwise state is: every state tensor of every parameter,
    once over the ranks, also where the owner held only a piece of it (its whole gradient came
    from the exchange)."""
    model = build()
    world = 4  # at 2, Muon's owners hold each matrix whole
    shapes = {n: p.shape for n, p in model.named_parameters()}

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, bool], int]:
        offload = Offload(device="disk", path=tmp_path)
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, offload=offload)
        made = MAKERS[name](m.parameters())
        opts = list(made.optimizers) if isinstance(made, Both) else [made]
        for inputs, targets in BATCHES[:2]:
            loss_fn(m, inputs.chunk(world)[rank], targets.chunk(world)[rank]).backward()
            made.step()
            made.zero_grad()
        names = {id(p): n for n, p in m.named_parameters()}
        placed, gathered = {}, 0
        for opt in opts:
            whole = whole_params.stepped_whole(opt)
            if whole is None:
                continue
            entries = whole.entries()
            for p, state in opt.state.items():
                entry = entries[id(p)]
                a, b = entry.pieces[rank]
                gathered += b - a < entry.numel  # the owner held a piece of it
                for key, value in state.items():
                    if value.dim() > 0:
                        placed[f"{names[id(p)]}.{key}"] = in_store(m, value)
        return placed, gathered

    runs = run_ranks(world, fn)
    expected = {f"{n}.{k}" for n, shape in shapes.items() for k in STATE_KEYS[name](shape)}
    placed = [k for held, _ in runs for k in held]
    assert sorted(placed) == sorted(expected)  # each once, on its owner
    assert sum(gathered for _, gathered in runs) > 0, "no owner gathered a parameter"
    in_memory = [k for held, _ in runs for k, in_files in held.items() if not in_files]
    assert not in_memory, f"state in anonymous memory: {in_memory}"


@pytest.mark.stage3
def test_disk_tier_with_the_owners_state_in_files_trains_exactly(tmp_path: Path) -> None:
    """At 4 ranks owners gather most parameters: their state, in files, steps them exactly."""
    for name in OPTIMIZERS:
        _parity(name, 4, offload=Offload(device="disk", path=tmp_path / name))


def test_lbfgs_and_sparse_adam_are_refused_before_they_change_anything() -> None:
    model = build()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        before = {k: v.clone() for k, v in m.state_dict().items()}
        opt = torch.optim.LBFGS(m.parameters())
        inputs, targets = BATCHES[0]

        def closure() -> Tensor:
            opt.zero_grad()
            loss = loss_fn(m, inputs.chunk(2)[rank], targets.chunk(2)[rank])
            loss.backward()
            return loss

        with pytest.raises(ValueError, match="LBFGS cannot train a sharded model.*line search"):
            opt.step(closure)
        sparse = torch.optim.SparseAdam(m.parameters())
        with pytest.raises(ValueError, match="SparseAdam cannot train a sharded model.*dense"):
            sparse.step()
        for k, v in m.state_dict().items():
            assert torch.equal(v, before[k]), k

    run_ranks(2, fn)


class RowNormalized(torch.optim.Optimizer):
    """A user's optimizer that scales each row of a matrix's update to unit norm."""

    def __init__(self, params: Iterable[nn.Parameter], lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad if p.ndim > 1 else p.grad.unsqueeze(0)
                update = g / g.norm(dim=-1, keepdim=True).clamp_min(1e-12)
                p.sub_(group["lr"] * update.view_as(p))


def test_an_undeclared_optimizer_warns_and_a_declared_one_trains_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What a process remembers of the class (declared, warned), left as before the test
    monkeypatch.setattr(whole_params, "_declared", dict(whole_params._declared))
    monkeypatch.setattr(whole_params, "_warned", set())
    model = build()
    _, ref = train_recipe(model, 2, torch.float32, BATCHES, RowNormalized, loss_fn)
    with pytest.warns(UserWarning, match=r"declare_optimizer\(RowNormalized, reads_shapes=True\)"):
        train_sharded(model, 2, RowNormalized, BATCHES[:1], loss_fn, auto_wrap=Block)
    shardwrap.declare_optimizer(RowNormalized, reads_shapes=True)
    runs = train_sharded(model, 2, RowNormalized, BATCHES, loss_fn, auto_wrap=Block)
    for rank, run in enumerate(runs):
        _assert_same(ref, run.state, 1e-5, rank)
    with pytest.raises(TypeError, match="optimizer class"):
        shardwrap.declare_optimizer(RowNormalized(model.parameters()), reads_shapes=True)  # type: ignore[arg-type]


def test_declaring_takes_a_bool_only() -> None:
    """``reads_shapes="False"`` is a truthy string: refused, not read as True."""
    for value in ("False", 0, None):
        with pytest.raises(TypeError, match=rf"reads_shapes must be True or False, got {value!r}"):
            shardwrap.declare_optimizer(RowNormalized, reads_shapes=value)  # type: ignore[arg-type]


def test_a_param_group_added_after_steps_keeps_each_parameters_owner_and_state() -> None:
    """Muon over two matrices for 2 steps, then ``add_param_group`` with two more, 2 steps: at
    2 ranks every parameter equals the unwrapped model's trained alike. Owners are chosen for
    the new parameters; one stepped so far stays with its owner and its momentum (chosen anew,
    ``0.weight`` moved to rank 0, which started a fresh momentum, while rank 1 kept the old)."""
    torch.manual_seed(0)
    base = nn.Sequential(
        nn.Linear(WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, 3 * WIDTH), nn.Tanh(),
        nn.Linear(3 * WIDTH, WIDTH), nn.Tanh(), nn.Linear(WIDTH, WIDTH),
    )  # fmt: skip
    steps = 4

    ref = copy.deepcopy(base)
    matrices = [p for p in ref.parameters() if p.ndim == 2]
    opt = torch.optim.Muon(matrices[:2], lr=1e-2)
    for step, (inputs, targets) in enumerate(BATCHES[:steps]):
        if step == 2:
            opt.add_param_group({"params": matrices[2:]})
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            loss_fn(ref, x, y).backward()
        for p in ref.parameters():
            p.grad /= 2  # the ranks' gradients are averaged
        opt.step()
        ref.zero_grad()  # the matrices not stepped yet too

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(base), process_group=pg)
        matrices = [p for p in m.parameters() if p.ndim == 2]
        opt = torch.optim.Muon(matrices[:2], lr=1e-2)
        for step, (inputs, targets) in enumerate(BATCHES[:steps]):
            if step == 2:
                opt.add_param_group({"params": matrices[2:]})
            loss_fn(m, inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            opt.step()
            m.zero_grad()
        return m.full_state_dict()

    for state in run_ranks(2, fn):
        torch.testing.assert_close(state, ref.state_dict(), atol=1e-4, rtol=0)


def muon_and_sgd(params: Iterable[nn.Parameter]) -> Both:
    """Muon for the matrices, SGD for the rest (torch's AdamW refuses a gradient in another
    dtype than its parameter)."""
    params = list(params)
    return Both(
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2),
        torch.optim.SGD([p for p in params if p.ndim != 2], lr=1e-2, momentum=0.9),
    )


@pytest.mark.parametrize("make", [muon_and_sgd, adafactor], ids=["muon", "adafactor"])
def test_bf16_parameters_with_fp32_gradients_are_stepped_whole_like_the_plain_model(
    make: Callable[[Iterable[nn.Parameter]], Any],
) -> None:
    """bfloat16 parameters whose ``grad_dtype`` is float32 (set before wrapping): each owner
    gathers the whole float32 gradient beside the bfloat16 values, and every parameter after 4
    steps at 2 ranks equals the plain model's (its ranks' slices' bfloat16 gradients added into
    float32 ``.grad``, then averaged), to the bit: a gradient rounded to bfloat16 on its way
    to the owner would not be."""
    model = build().to(torch.bfloat16)
    ref = fp32_grads(copy.deepcopy(model))
    opt = make(ref.parameters())
    for inputs, targets in BATCHES:
        for x, y in zip(inputs.chunk(2), targets.chunk(2)):
            loss_fn(ref, x, y).backward()
        for p in ref.parameters():
            p.grad /= 2  # the ranks' gradients are averaged
        opt.step()
        opt.zero_grad()
    moved = max((ref.state_dict()[k] - v).abs().max().item() for k, v in model.state_dict().items())
    assert moved > 1e-3, "the reference did not train; parity would prove nothing"

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(fp32_grads(copy.deepcopy(model)), process_group=pg, auto_wrap=Block)
        opt = make(m.parameters())
        for inputs, targets in BATCHES:
            loss_fn(m, inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            assert all(p.grad.dtype == torch.float32 for p in m.parameters())
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for state in run_ranks(2, fn):
        torch.testing.assert_close(state, ref.state_dict(), atol=0, rtol=0)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_the_optimizers_own_step_hooks_see_the_pieces_as_every_other_call(name: str) -> None:
    """Step hooks of the user's own (``opt.register_step_pre_hook``, ``register_step_post_hook``)
    ran while the exchange had made each owner's parameter whole (torch runs process-wide
    pre-hooks first and post-hooks last, and the exchange was such a pair): clipping in a
    pre-hook took each rank's own part of the norm and clipped the ranks differently; an
    average kept per parameter in a post-hook failed on the whole parameter's shape; and
    ``zero_grad()`` in a post-hook was undone, the gradients summed into the next step. Now the
    exchange is the optimizer's innermost pair of hooks, and each of these trains as on the
    plain model: the same norms, averages (sliced as the pieces), and parameters."""
    make, atol = OPTIMIZERS[name]
    model = build()

    def train(m: nn.Module, rank: int, world: int) -> tuple[list[float], dict[str, Tensor]]:
        opt = make(m.parameters())
        optimizers = opt.optimizers if isinstance(opt, Both) else (opt,)
        norms: list[float] = []
        average = {n: p.detach().clone() for n, p in m.named_parameters()}
        params = dict(m.named_parameters())

        def clip(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05).item())

        def keep(o: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
            with torch.no_grad():
                for n, a in average.items():
                    a.lerp_(params[n], 0.5)

        optimizers[0].register_step_pre_hook(clip)
        optimizers[-1].register_step_post_hook(keep)
        for o in optimizers:
            o.register_step_post_hook(lambda o, args, kwargs: o.zero_grad())
        for x, y in BATCHES:
            loss_fn(m, x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            opt.step()  # no zero_grad here: the post-hooks clear the gradients
        assert all(p.grad is None for p in m.parameters())
        return norms, average

    plain = copy.deepcopy(model)
    plain_norms, plain_average = train(plain, 0, 1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[list[float], dict[str, Tensor], Any]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        norms, average = train(m, rank, 2)
        pieces = {n: piece_of(p) for n, p in m.named_parameters()}
        return norms, average, pieces, m.full_state_dict()

    for rank, (norms, average, pieces, state) in enumerate(run_ranks(2, fn, timeout=30.0)):
        assert norms == pytest.approx(plain_norms, rel=1e-5)
        for n, (_, start, stop, shape) in pieces.items():
            want = plain_average[n].flatten()[start:stop].reshape(shape)
            torch.testing.assert_close(average[n], want, atol=atol, rtol=0, msg=n)
        _assert_same(plain.state_dict(), state, atol, rank)


def test_a_whole_parameter_step_on_some_ranks_only_is_named_at_once() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    x = torch.randn(8, 8)

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(model), process_group=pg)
        kind = torch.optim.AdamW if rank == 0 else torch.optim.Adafactor
        opt = kind(m.parameters(), lr=0.01)
        with pytest.raises(RuntimeError) as info:
            for _ in range(2):
                m(x.chunk(2)[rank]).sum().backward()
                opt.step()
                opt.zero_grad()
        return str(info.value)

    for message in run_ranks(2, fn, timeout=20):  # gloo's own timeout: 10 s
        assert "ranks are at different steps or calls" in message
        assert "rank 1: forward pass 1, calling an optimizer's step of whole parameters" in message
