"""The harness of the peers tier (``tests/peers``): one training loop, written once, run on a
plain reference and on every rank of a ``ShardedModule`` copy, then compared.

A case is a template model, its batches and a ``Step``: what one optimizer step does (forward,
backward, any hooks, clipping or reads the behaviour needs, then ``opt.step()``), given a
``Side`` that says where it runs. The reference is a deep copy of the template trained on each
whole global batch (``side.local(t)`` is ``t``); each rank trains its own deep copy, wrapped at
the stage the test names, on its slice (``side.local(t)`` is its chunk). Losses are means over
the slice, so the mean over ranks is the reference's loss, and gradients, averaged by
shardwrap, are the reference's gradients. ``assert_peer_parity`` then checks:

- every step's global loss equals the reference's within 1e-5 (every optimizer);
- with SGD (momentum 0.9) every parameter after the last step (``full_state_dict()``) equals the
  reference's within 1e-5;
- whatever the step wrote down with ``side.note(key, value)`` equals what the reference wrote
  down under the same key, within 1e-5 (full gradients, outputs, norms: the case's own reads).

``full_tensor`` and ``piece_range`` read a shard parameter's full value, gradient or optimizer
state from the ranks' pieces (each rank's piece is its contiguous range of the flattened
parameter, ranks in order), the way DeepSpeed's ``safe_get_full_grad`` does.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.ranks import run_ranks

__all__ = [
    "ATOL",
    "STAGES",
    "Batch",
    "Run",
    "Side",
    "Step",
    "adamw",
    "assert_peer_parity",
    "full_param",
    "full_tensor",
    "make_batches",
    "note_grads",
    "piece_range",
    "plain_step",
    "run_reference",
    "run_sharded",
    "sgd",
    "shapes_of",
]

ATOL = 1e-5
STAGES = (1, 2, 3)
Batch = tuple[Tensor, Tensor]  # (inputs, targets), the global batch
MakeOptimizer = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Exact parameter parity: SGD with momentum."""
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Loss parity: AdamW (it amplifies rounding in parameters whose gradient is about zero)."""
    return torch.optim.AdamW(params, lr=3e-3)


def no_step(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """An optimizer that moves nothing: for steps that use optimizers (or hooks) of their own."""
    return torch.optim.SGD(params, lr=0.0)


def make_batches(
    steps: int, inputs: tuple[int, ...], targets: tuple[int, ...] | None, seed: int = 0
) -> list[Batch]:
    """``steps`` random global batches of float inputs and targets (``targets=None``: class
    ids in ``[0, inputs[-1])`` of shape ``inputs[:-1]``), from a private generator."""
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(steps):
        x = torch.randn(*inputs, generator=g)
        if targets is None:
            y = torch.randint(inputs[-1], inputs[:-1], generator=g)
        else:
            y = torch.randn(*targets, generator=g)
        batches.append((x, y))
    return batches


@dataclass
class Side:
    """Where a step runs: the plain reference (rank 0 of 1) or one rank of the sharded copy."""

    model: nn.Module
    rank: int
    world_size: int
    pg: ProcessGroup | None  # None: the reference, or a sharded run at world size 1
    sharded: bool
    notes: list[tuple[str, Any]] = field(default_factory=list)  # (key, value), in order
    step_index: int = 0  # how many steps this side has taken

    def local(self, t: Tensor) -> Tensor:
        """This side's slice of a global batch (all of it on the reference)."""
        return t.chunk(self.world_size)[self.rank]

    def micro(self, t: Tensor, count: int) -> list[Tensor]:
        """This side's part of each of ``count`` micro-batches of a global batch: micro-batch
        ``i`` is the ``i``-th chunk of rows, which the ranks split again."""
        return [self.local(chunk) for chunk in t.chunk(count)]

    def mean(self, value: Tensor) -> float:
        """The mean of ``value`` over the ranks (``value`` itself on the reference)."""
        total = value.detach().float().clone()
        if self.pg is not None:
            self.pg.allreduce([total]).wait()
        return total.item() / self.world_size

    def note(self, key: str, value: Any) -> None:
        """Write down a value the reference must have written down alike (tensors are copied)."""
        if isinstance(value, Tensor):
            value = value.detach().clone()
        self.notes.append((f"step {self.step_index}, {key}", value))

    def flag_all(self, flag: bool) -> bool:
        """``flag`` on every rank (one small all-reduce; ``flag`` itself on the reference)."""
        if self.pg is None:
            return flag
        t = torch.tensor([0.0 if flag else 1.0])
        self.pg.allreduce([t]).wait()
        return t.item() == 0.0


Step = Callable[[Side, torch.optim.Optimizer, Batch], Tensor]
LossFn = Callable[[nn.Module, Tensor, Tensor], Tensor]


def plain_step(loss_fn: LossFn, set_to_none: bool = True) -> Step:
    """Forward, backward, step and zero the gradients: the usual loop."""

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = loss_fn(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        return loss

    return step


@dataclass
class Run:
    """What one side's training left behind."""

    losses: list[float]
    state: dict[str, Tensor]  # full state dict after the last step
    notes: list[tuple[str, Any]]
    finished: Any  # what ``finish(side)`` returned after the last step


def _train(
    side: Side,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    step: Step,
    prepare: Callable[[Side], None] | None,
    finish: Callable[[Side], Any] | None,
) -> Run:
    if prepare is not None:
        prepare(side)
    opt = make_optimizer(side.model.parameters())
    losses = []
    for batch in batches:
        losses.append(side.mean(step(side, opt, batch)))
        side.step_index += 1
    state = _full_state(side.model)
    finished = finish(side) if finish else None
    return Run(losses, state, side.notes, finished)


def _full_state(model: nn.Module) -> dict[str, Tensor]:
    """The plain model's state dict of ``model``: wrapped whole, wrapped child by child, or
    plain."""
    if isinstance(model, ShardedModule):
        return model.full_state_dict()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for name, child in model.named_children():
        if isinstance(child, ShardedModule):
            state = {k: v for k, v in state.items() if not k.startswith(f"{name}.")}
            state.update({f"{name}.{k}": v for k, v in child.full_state_dict().items()})
    return state


def run_reference(
    model: nn.Module,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    step: Step,
    prepare: Callable[[Side], None] | None = None,
    finish: Callable[[Side], Any] | None = None,
) -> Run:
    """Train a deep copy of ``model``, unwrapped, on every global batch whole."""
    side = Side(copy.deepcopy(model), 0, 1, None, sharded=False)
    return _train(side, make_optimizer, batches, step, prepare, finish)


def run_sharded(
    model: nn.Module,
    world_size: int,
    make_optimizer: MakeOptimizer,
    batches: list[Batch],
    step: Step,
    prepare: Callable[[Side], None] | None = None,
    finish: Callable[[Side], Any] | None = None,
    group: Callable[[ProcessGroup], Any] | None = None,
    build: Callable[[int], nn.Module] | None = None,
    children: tuple[str, ...] = (),
    **wrap: Any,
) -> list[Run]:
    """Train a ``ShardedModule`` deep copy of ``model`` on every rank, each on its slice.

    ``group(pg)`` makes the ``process_group`` argument from the rank's group: a mesh (the
    ranks still split the data over the whole world) or a subgroup (its ranks split it, and
    each subgroup trains alike). ``build(rank)`` makes the model a rank wraps instead of the
    deep copy (weights on rank 0 only, a meta-device model). ``children``: wrap these children
    of the model, each a ``ShardedModule`` of its own, instead of the model (several wrapped
    models in one loop). World size 1 runs on this thread without a process group.
    """

    def fn(rank: int, pg: ProcessGroup | None) -> Run:
        process_group = group(pg) if group and pg is not None else pg
        module = build(rank) if build else copy.deepcopy(model)
        if children:
            for name in children:
                wrapped = ShardedModule(getattr(module, name), process_group=process_group, **wrap)
                setattr(module, name, wrapped)
            sharded = module
        else:
            sharded = ShardedModule(module, process_group=process_group, **wrap)
        if isinstance(process_group, ProcessGroup) and process_group is not pg:
            side = Side(sharded, process_group.rank(), process_group.size(), process_group, True)
        else:
            side = Side(sharded, rank, world_size, pg, sharded=True)
        return _train(side, make_optimizer, batches, step, prepare, finish)

    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=30.0)


def assert_peer_parity(
    model: nn.Module,
    *,
    stage: int,
    batches: list[Batch],
    step: Step,
    world_size: int = 2,
    make_optimizer: MakeOptimizer = sgd,
    prepare: Callable[[Side], None] | None = None,
    finish: Callable[[Side], Any] | None = None,
    trains: bool = True,
    compare_parameters: bool | None = None,
    **wrap: Any,
) -> tuple[Run, list[Run]]:
    """Train the reference and the sharded copies (at ``stage``, ``wrap`` passed on) and assert
    loss parity, parameter parity with SGD and equal notes; return both for further checks.

    ``prepare(side)`` runs on each side before its optimizer is built, ``finish(side)`` after
    the last step (both may note). ``trains``: the reference must have moved its parameters,
    or parity would prove nothing. ``compare_parameters``: also compare the parameters after
    the last step (default: with ``sgd``, whose steps keep rounding small).
    """
    if compare_parameters is None:
        compare_parameters = make_optimizer is sgd
    ref = run_reference(model, make_optimizer, batches, step, prepare, finish)
    if trains:
        before = model.state_dict()
        moved = max(
            (
                (ref.state[k].double() - v.double()).abs().max().item()
                for k, v in before.items()
                if v.numel()
            ),
            default=0,
        )
        assert moved > 1e-4, "the reference did not train; parity would prove nothing"
    runs = run_sharded(
        model, world_size, make_optimizer, batches, step, prepare, finish, stage=stage, **wrap
    )
    for rank, run in enumerate(runs):
        where = f"stage {stage}, rank {rank}"
        keys = [key for key, _ in run.notes]
        assert keys == [key for key, _ in ref.notes], f"{where} noted other things: {keys}"
        for (key, got), (_, want) in zip(run.notes, ref.notes):
            _assert_same(got, want, f"{where}, {key}")
        torch.testing.assert_close(
            torch.tensor(run.losses),
            torch.tensor(ref.losses),
            atol=ATOL,
            rtol=0,
            msg=lambda m, where=where: f"{where}, losses by step: {m}",
        )
        if compare_parameters:
            assert run.state.keys() == ref.state.keys()
            torch.testing.assert_close(
                _widened(run.state),
                _widened(ref.state),
                atol=ATOL,
                rtol=0,
                msg=lambda m, where=where: f"{where}, parameters after the last step: {m}",
            )
    return ref, runs


def _widened(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` with float8 tensors in float32 (exactly): torch compares no float8 within a
    tolerance."""
    return {
        k: v.float() if v.is_floating_point() and v.element_size() == 1 else v
        for k, v in state.items()
    }


def _assert_same(got: Any, want: Any, where: str) -> None:
    """``got`` equals ``want`` within ``ATOL``: tensors, numbers, ``None`` and containers."""
    if isinstance(want, Tensor):
        assert isinstance(got, Tensor), f"{where}: {type(got).__name__}, want a tensor"
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0, msg=lambda m: f"{where}: {m}")
    elif isinstance(want, dict):
        assert isinstance(got, dict), f"{where}: {type(got).__name__}, want a dict"
        assert got.keys() == want.keys(), f"{where}: keys {sorted(got)}, want {sorted(want)}"
        for k in want:
            _assert_same(got[k], want[k], f"{where}, {k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(want), f"{where}: lengths"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same(g, w, f"{where}, #{i}")
    elif isinstance(want, float):
        assert abs(got - want) <= ATOL, f"{where}: {got} != {want}"
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


def note_grads(side: Side, shapes: dict[str, torch.Size], key: str = "full gradients") -> None:
    """Note every parameter's whole gradient (``None`` where it has none), by name; ``shapes``
    are the plain model's parameter shapes. Every rank calls it."""
    params = dict(side.model.named_parameters())
    side.note(key, {n: full_tensor(side, params[n].grad, shape) for n, shape in shapes.items()})


def shapes_of(model: nn.Module) -> dict[str, torch.Size]:
    """The plain model's parameter shapes, by name."""
    return {n: p.shape for n, p in model.named_parameters()}


# reading a shard parameter whole ------------------------------------------------------------


def full_param(model: nn.Module, name: str) -> Tensor:
    """``module.attr`` for a dotted parameter name: inside ``gathered()`` the full parameter
    (not ``get_parameter``: the full view of a gathered unit is a plain tensor, not an
    ``nn.Parameter``), elsewhere this rank's piece."""
    owner, _, attr = name.rpartition(".")
    return getattr(model.get_submodule(owner), attr)


def _sizes(side: Side, n: int) -> list[int]:
    if side.pg is None:
        return [n]
    mine = torch.tensor([n], dtype=torch.int64)
    out = [torch.zeros(1, dtype=torch.int64) for _ in range(side.world_size)]
    side.pg.allgather([out], [mine]).wait()
    return [int(t.item()) for t in out]


def piece_range(side: Side, piece: Tensor) -> tuple[int, int]:
    """The range of the flattened parameter that this rank's ``piece`` holds (every rank calls
    it; on the reference, the whole parameter)."""
    sizes = _sizes(side, piece.numel())
    start = sum(sizes[: side.rank])
    return start, start + sizes[side.rank]


def full_tensor(side: Side, piece: Tensor | None, shape: torch.Size) -> Tensor | None:
    """The whole tensor of ``shape`` whose pieces the ranks hold (a value, a gradient, an
    optimizer state), or ``None`` where no rank holds one (a rank whose piece is ``None`` holds
    none of its elements). Every rank calls it."""
    if not side.sharded or side.pg is None:
        return None if piece is None else piece.detach().reshape(shape).as_subclass(Tensor).clone()
    if side.flag_all(piece is None):
        return None
    if piece is None:
        flat = torch.zeros(0)
    else:
        flat = piece.detach().reshape(-1).as_subclass(Tensor).clone()
    sizes = _sizes(side, flat.numel())
    padded = torch.zeros(max(max(sizes), 1), dtype=torch.float64)
    padded[: flat.numel()] = flat.double()
    out = [torch.empty_like(padded) for _ in range(side.world_size)]
    side.pg.allgather([out], [padded]).wait()
    whole = torch.cat([o[:n] for o, n in zip(out, sizes)]).reshape(shape)
    return whole.to(torch.float32 if piece is None else piece.dtype)
