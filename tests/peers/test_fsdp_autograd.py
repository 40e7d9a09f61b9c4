"""Autograd, frozen-parameter and hook behaviours that PyTorch FSDP2's own suite asserts, ported
to shardwrap.

Upstream: ``test/distributed/_composable/fsdp/test_fully_shard_autograd.py`` (unused outputs
and modules, containers between units, post-accumulate-grad hooks), the backward orders of
``test_fully_shard_comm.py``,
``test_fully_shard_frozen.py`` (frozen parameters within and across units, frozen modules
called several times) and the module hooks of ``test_fully_shard_training.py``. Each test names
the upstream test it mirrors and trains a plain deep copy of its model on the whole global
batch beside a ``ShardedModule`` copy on each rank, at stages 1, 2 and 3, over several steps
(``tests/support/peers.py``): SGD with momentum, parameters equal within 1e-5; AdamW, losses
equal within 1e-5; plus each behaviour's own reads (full gradients, which gradients exist,
hook calls), equal to the plain model's.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/peers/test_fsdp_autograd.py
-q -n 2`` (the whole tier: ``pytest -m peers -n 3``).
"""

from __future__ import annotations

import collections
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwrap import ShardedModule
from tests.support.peer_models import MLP, DoubleLinear, FirstLinear
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    adamw,
    assert_peer_parity,
    full_tensor,
    make_batches,
    no_step,
    note_grads,
    plain_step,
    shapes_of,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
BATCHES = make_batches(4, (8, 11), (8, 11))


def _mse(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


# backward in an order forward does not predict ---------------------------------------------


@stages
@pytest.mark.parametrize("first", ["second output", "first output"])
def test_two_outputs_backward_one_after_the_other_in_either_order(stage: int, first: str) -> None:
    """Mirrors test_fully_shard_comm.py::test_backward_misprefetch and
    ::_test_backward_prefetch_unused_in_backward: one forward of two branches (each linear
    layer a unit), then each output's loss backward on its own, the first with
    ``retain_graph=True``, in either order: backward meets the units in an order forward's does
    not predict. The gradients are the plain model's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(11, 11), DoubleLinear(11))
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        out1, out2 = side.model(side.local(batch[0]))
        y = side.local(batch[1])
        loss1, loss2 = F.mse_loss(out1, y), F.mse_loss(out2, y * 0.5)
        earlier, later = (loss2, loss1) if first == "second output" else (loss1, loss2)
        earlier.backward(retain_graph=True)
        later.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss1 + loss2

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=nn.Linear)


# unused outputs and modules ---------------------------------------------------------------------


@stages
def test_forward_output_left_out_of_the_loss(stage: int) -> None:
    """Mirrors test_fully_shard_autograd.py::test_unused_forward_output: a model returning two
    outputs whose loss uses both for two steps, then only the first; the second output's
    parameters then get no gradient (``None``, or zeros after ``zero_grad(set_to_none=False)``),
    as in plain PyTorch."""
    torch.manual_seed(0)
    model = DoubleLinear(11, use_second_linear=True)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        out1, out2 = side.model(side.local(batch[0]))
        loss = (out1 * out2).mean() if side.step_index < 2 else out1.mean()
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad(set_to_none=side.step_index % 2 == 1)
        return loss

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=FirstLinear)


@stages
def test_unit_never_used_in_forward(stage: int) -> None:
    """Mirrors test_fully_shard_autograd.py::test_unused_forward_module: a unit that forward
    never runs keeps ``grad = None`` and its values; the others train as in plain PyTorch."""
    torch.manual_seed(0)
    model = DoubleLinear(11, use_second_linear=False)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        assert side.model.lin2.weight.grad is None
        opt.step()
        opt.zero_grad()
        return loss

    ref, runs = assert_peer_parity(
        model, stage=stage, batches=BATCHES, step=step, auto_wrap=nn.Linear
    )
    for run in runs:
        assert torch.equal(run.state["lin2.weight"], model.lin2.weight)


NT = collections.namedtuple("NT", "x y")


def _pack(kind: str, x: Tensor) -> Any:
    if kind == "list":
        return [x]
    if kind == "namedtuple":
        return NT(x, torch.ones_like(x))
    if kind == "tuple":
        return (x,)
    return {"x": x}


def _unpack(kind: str, packed: Any) -> Tensor:
    return packed["x"] if kind == "dict" else packed[0]


class ContainerBlock(nn.Module):
    """Takes and returns its activation inside a container of ``kind``."""

    def __init__(self, kind: str, dim: int = 11) -> None:
        super().__init__()
        self.kind = kind
        self.lin1 = nn.Linear(dim, dim)
        self.lin2 = nn.Linear(dim, dim)

    def forward(self, packed: Any) -> Any:
        x = _unpack(self.kind, packed)
        out = torch.relu(self.lin2(torch.relu(self.lin1(x))))
        if isinstance(packed, NT):
            return NT(out, packed.y)
        return _pack(self.kind, out)


class Containers(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.blocks = nn.ModuleList(ContainerBlock(kind) for _ in range(3))

    def forward(self, x: Tensor) -> Tensor:
        packed = _pack(self.kind, x)
        for block in self.blocks:
            packed = block(packed)
        return _unpack(self.kind, packed)


@stages
@pytest.mark.parametrize("kind", ["list", "namedtuple", "tuple", "dict"])
def test_activations_inside_containers_between_units(stage: int, kind: str) -> None:
    """Mirrors test_fully_shard_autograd.py::test_nontensor_activations: units that take and
    return their activation inside a list, a namedtuple, a tuple or a dict; gradients reach
    every unit through the containers."""
    torch.manual_seed(0)
    assert_peer_parity(
        Containers(kind),
        stage=stage,
        batches=BATCHES,
        step=plain_step(_mse),
        make_optimizer=adamw,
        auto_wrap=ContainerBlock,
    )


# hooks ------------------------------------------------------------------------------------------


@stages
def test_post_accumulate_grad_hook_runs_once_per_parameter(stage: int) -> None:
    """Mirrors test_fully_shard_autograd.py::test_post_acc_grad_hook_runs: a hook registered
    with ``register_post_accumulate_grad_hook`` on every parameter the optimizer sees runs once
    per parameter and backward, with the parameter's gradient in place."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        calls: dict[str, int] = collections.defaultdict(int)
        handles = []
        for name, param in side.model.named_parameters():

            def hook(p: Tensor, name: str = name) -> None:
                assert p.grad is not None
                calls[name] += 1

            handles.append(param.register_post_accumulate_grad_hook(hook))
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        for handle in handles:
            handle.remove()
        side.note("hook calls", dict(calls))
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=MLP)


@stages
def test_optimizer_steps_inside_post_accumulate_grad_hooks(stage: int) -> None:
    """Mirrors test_fully_shard_autograd.py::test_post_acc_grad_hook_optim_parity: one optimizer
    per parameter, stepped (with its LR scheduler) from the parameter's post-accumulate-grad
    hook during backward, the optimizer-in-backward pattern; the model trains as the plain model
    stepping the same way."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11))
    batches = make_batches(6, (8, 11), (8, 11))
    # by side (sharded, rank): each parameter's optimizer
    in_backward: dict[tuple[bool, int], dict[Tensor, Any]] = {}

    def attach(side: Side) -> dict[Tensor, Any]:
        steppers: dict[Tensor, Any] = {}
        for param in side.model.parameters():
            o = torch.optim.SGD([param], lr=0.05, momentum=0.9)
            steppers[param] = (o, torch.optim.lr_scheduler.StepLR(o, step_size=2))

            def hook(p: Tensor) -> None:
                o, scheduler = steppers[p]
                o.step()
                o.zero_grad()
                scheduler.step()

            param.register_post_accumulate_grad_hook(hook)
        return steppers

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if (side.sharded, side.rank) not in in_backward:  # not id(side): a side can take a
            in_backward[side.sharded, side.rank] = attach(side)  # finished one's address
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        kept = [n for n, p in side.model.named_parameters() if p.grad is not None]
        assert not kept, f"the hooks did not step (and zero) these parameters: {kept}"
        return loss

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=step,
        make_optimizer=no_step,
        compare_parameters=True,
        auto_wrap=MLP,
    )


@stages
def test_module_hooks_on_units_see_full_parameters(stage: int) -> None:
    """Mirrors test_fully_shard_training.py::test_shard_placement_fn_contiguous_params_grads
    (forward pre-hooks on units): a unit's forward pre-hook sees its full, contiguous
    parameters and may rewrite the input, its forward hook may rewrite the output, and after
    backward every gradient is contiguous; the model trains as the plain model with the same
    hooks."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11))
    full = {id(m): m.in_proj.weight.shape for m in model}

    def attach(side: Side) -> None:
        for i, mlp in enumerate(side.model):
            shape = full[id(model[i])]

            def pre(module: nn.Module, args: tuple[Tensor, ...], shape: torch.Size = shape) -> Any:
                assert module.in_proj.weight.shape == shape
                assert all(p.is_contiguous() for p in module.parameters())
                return (args[0] * 0.5,)

            def post(module: nn.Module, args: Any, output: Tensor) -> Tensor:
                return output + 0.1

            mlp.register_forward_pre_hook(pre)
            mlp.register_forward_hook(post)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if side.step_index == 0:
            attach(side)
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        assert all(p.grad.is_contiguous() for p in side.model.parameters())
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=MLP)


# frozen parameters ------------------------------------------------------------------------------


def _freeze_weights(model: nn.Module) -> None:
    """Train biases only (BitFit)."""
    for name, param in model.named_parameters():
        if "bias" not in name:
            param.requires_grad_(False)


@stages
@pytest.mark.parametrize("recompute", [False, True], ids=["stored", "recomputed"])
def test_frozen_and_trainable_parameters_in_one_unit(stage: int, recompute: bool) -> None:
    """Mirrors test_fully_shard_frozen.py::test_train_mixed_requires_grad_per_group
    (``freeze_after_init=False``): weights frozen and biases trainable in every unit, with and
    without activation checkpointing; frozen weights get no gradient and never change, and only
    the trainable parameters' gradients are reduced."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11), MLP(11))
    _freeze_weights(model)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        if side.sharded:
            units = side.model._shardwrap_root.units
            trainable = sum(
                g.layout.padded_numel * g.grad_dtype.itemsize
                for u in units
                for g in u.groups
                if g.requires_grad
            )
            reduced = side.model.comm_stats.bytes.get("reduce_scatter", 0)
            assert reduced == trainable * (side.step_index + 1)
        opt.step()
        opt.zero_grad(set_to_none=side.step_index % 2 == 0)
        return loss

    ref, runs = assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=step,
        auto_wrap=MLP,
        checkpoint_activations=recompute,
    )
    for run in runs:
        for name, param in model.named_parameters():
            if not param.requires_grad:
                assert torch.equal(run.state[name], param), f"frozen {name} changed"


@stages
@pytest.mark.parametrize("recompute", [False, True], ids=["", "recomputed"])
def test_parameters_frozen_after_wrapping(stage: int, recompute: bool) -> None:
    """Mirrors test_fully_shard_frozen.py::test_train_mixed_requires_grad_per_group
    (``freeze_after_init=True``, with and without activation checkpointing): weights frozen
    with ``requires_grad_(False)`` on the wrapped model's parameters, after wrapping; from then
    on they get no gradient and never change, as on the plain model frozen alike."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11), MLP(11))
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if side.step_index == 0:
            _freeze_weights(side.model)
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    ref, runs = assert_peer_parity(
        model,
        stage=stage,
        batches=BATCHES,
        step=step,
        auto_wrap=MLP,
        checkpoint_activations=recompute,
    )
    for run in runs:
        assert torch.equal(run.state["0.in_proj.weight"], model[0].in_proj.weight)


def _interleaved(model: nn.Module, requires_grad: bool) -> None:
    """Freeze (or unfreeze) every other linear layer, starting with the first."""
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for linear in linears[::2]:
        linear.requires_grad_(requires_grad)


@stages
def test_frozen_units_interleaved_with_trainable_ones(stage: int) -> None:
    """Mirrors test_fully_shard_frozen.py::test_train_mixed_requires_grad_across_groups
    (``unfreeze_params=False``): every other linear layer is a frozen unit, with a
    ``torch.no_grad()`` forward between training steps; the trainable units train as in plain
    PyTorch and the frozen ones never change."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(11, 11), nn.ReLU())])
    _interleaved(model, False)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = side.local(batch[0]), side.local(batch[1])
        if side.step_index == 1:
            with torch.no_grad():
                side.note("no-grad output", side.mean(side.model(x).pow(2).mean()))
        loss = _mse(side.model, x, y)
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad(set_to_none=side.step_index % 2 == 0)
        return loss

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=nn.Linear)


@stages
def test_frozen_units_unfrozen_for_the_last_step(stage: int) -> None:
    """Mirrors test_fully_shard_frozen.py::test_train_mixed_requires_grad_across_groups
    (``unfreeze_params=True``): linear layers frozen when wrapped are unfrozen with
    ``requires_grad_(True)`` for the last steps (fine-tuning that thaws layers); from then on
    they get gradients and train, as on the plain model."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(4) for m in (nn.Linear(11, 11), nn.ReLU())])
    _interleaved(model, False)
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if side.step_index == 2:
            _interleaved(side.model, True)
        loss = _mse(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=BATCHES, step=step, auto_wrap=nn.Linear)


class MixedMultiForward(nn.Module):
    """A trainable and a frozen layer, each called several times, some calls without grad."""

    def __init__(self) -> None:
        super().__init__()
        self.layer_0 = nn.Linear(5, 5)
        self.layer_no_grad = nn.Linear(5, 5)
        self.layer_with_grad = nn.Linear(5, 5)
        self.layer_no_grad.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, 5)
        x = self.layer_0(x)
        for _ in range(3):
            x = self.layer_no_grad(F.relu(self.layer_with_grad(x)))
            with torch.no_grad():  # in place, as upstream: ``x`` keeps its graph
                x += F.relu(self.layer_with_grad(x))
        return x


@stages
def test_frozen_and_trainable_units_called_several_times(stage: int) -> None:
    """Mirrors test_fully_shard_frozen.py::test_multi_forward_mixed_requires_grad: a trainable
    and a frozen unit each run three times per forward, the trainable one also under
    ``torch.no_grad()`` between; gradients sum over the calls that recorded a graph."""
    torch.manual_seed(0)
    batches = make_batches(4, (8, 5), (8, 5))
    assert_peer_parity(
        MixedMultiForward(),
        stage=stage,
        batches=batches,
        step=plain_step(_mse),
        auto_wrap=nn.Linear,
    )


# the wrapped module's identity --------------------------------------------------------------


@stages
def test_wrapped_model_keeps_its_class_and_slices_into_a_plain_one(stage: int) -> None:
    """Mirrors test_fully_shard_state.py::test_fully_shard_cls and ::test_fully_shard_reapply:
    the wrapped model is still an instance of its class, its submodules keep theirs, slicing a
    wrapped ``Sequential`` gives a plain ``Sequential`` of the same submodules (which runs as
    the plain model's slice), and wrapping the model again is refused."""
    torch.manual_seed(0)
    model = nn.Sequential(MLP(11), MLP(11), MLP(11))
    probe = torch.randn(8, 11, generator=torch.Generator().manual_seed(5))

    def finish(side: Side) -> None:
        assert isinstance(side.model, nn.Sequential)
        assert type(side.model[0]) is MLP
        sliced = side.model[:2]
        assert type(sliced) is nn.Sequential, type(sliced)
        assert sliced[1] is side.model[1]
        with torch.no_grad():
            out = sliced(side.local(probe))
        side.note("the slice's output", full_tensor(side, out, torch.Size([8, 11])))
        if side.sharded:
            with pytest.raises(ValueError, match="already wrapped"):
                ShardedModule(side.model, process_group=side.pg)

    assert_peer_parity(
        model, stage=stage, batches=BATCHES, step=plain_step(_mse), finish=finish, auto_wrap=MLP
    )
