"""Leaf-module and unused-parameter behaviours that DeepSpeed ZeRO's own suite asserts, ported
to shardwrap: modules chosen call by call or rank by rank, blocks returning several tensors,
inputs with and without ``requires_grad``, units chosen by class or by parameter count,
attribute delegation, and parameters forward never uses.

Upstream (``deepspeedai/DeepSpeed``, ``tests/unit/runtime/zero``): ``test_zero_leaf_module.py``,
``test_zero_hook_attribute_delegation.py`` and ``test_ignore_unused_parameters.py`` (and FSDP2's
``test_fully_shard_state.py`` for a container refused as a unit). Each test names the upstream
test it mirrors and trains a plain deep copy of its model on the whole global batch beside a
``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and 3, over several steps
(``tests/support/peers.py``): SGD with momentum, parameters equal within 1e-5; AdamW, losses
equal within 1e-5; plus each behaviour's own reads, equal to the plain model's within 1e-5.
2 ranks.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2
tests/peers/test_zero_leaf_modules.py`` (the whole tier: ``pytest tests/peers -m peers -n 3``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from shardwrap import ShardedModule
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    adamw,
    assert_peer_parity,
    full_tensor,
    make_batches,
    note_grads,
    plain_step,
    shapes_of,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
HIDDEN = 12
CLASSES = make_batches(4, (8, HIDDEN), None)


def _loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    out = model(x, y)
    return out[1] if isinstance(out, tuple) else out


# leaf modules -----------------------------------------------------------------------------------


class ChooseByCounter(nn.Module):
    """Runs one of two linear layers, the other at the next call."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2))
        self.counter = 0

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        x = torch.relu(self.linears[self.counter % 2](x))
        self.counter += 1
        return x, F.cross_entropy(x, y)


@stages
def test_module_chosen_by_a_counter(stage: int) -> None:
    """Mirrors test_zero_leaf_module.py::TestSetZ3LeafModule::test_choose_module_by_counter: the
    model runs one of two layers, alternating call by call, each layer a unit; it trains as the
    plain model."""
    torch.manual_seed(0)
    assert_peer_parity(
        ChooseByCounter(), stage=stage, batches=CLASSES, step=plain_step(_loss), auto_wrap=nn.Linear
    )


@stages
def test_container_without_forward_is_refused_as_a_unit(stage: int) -> None:
    """Mirrors FSDP2's test_fully_shard_state.py::test_fully_shard_unsupported_module_cls and
    DeepSpeed's test_zero_leaf_module.py::TestSetZ3LeafModule::test_set_unset_leaf_modules (a
    ``ModuleList`` as the leaf): a policy selecting the ``ModuleList`` whose children the model
    indexes is refused, naming it and what to select instead (DeepSpeed accepts it as a leaf,
    FSDP2 refuses it alike); selecting the layers inside, the model trains as the plain one."""
    torch.manual_seed(0)

    def prepare(side: Side) -> None:
        if side.sharded:
            with pytest.raises(ValueError, match="'linears' \\(ModuleList\\).*never called"):
                ShardedModule(ChooseByCounter(), process_group=side.pg, auto_wrap=nn.ModuleList)

    assert_peer_parity(
        ChooseByCounter(),
        stage=stage,
        batches=CLASSES,
        step=plain_step(_loss),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


class ChooseByRank(nn.Module):
    """Runs the linear layer its caller names: ranks run different layers."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(2))

    def forward(self, x: Tensor, which: int) -> Tensor:
        return torch.relu(self.linears[which](x))


@stages
def test_each_rank_runs_a_different_module(stage: int) -> None:
    """Mirrors test_zero_leaf_module.py::TestSetZ3LeafModule::test_choose_module_by_rank: each
    rank runs the layer of its own rank, so the ranks run different units in the same step;
    nothing hangs, and training matches the plain model running each rank's slice through
    that rank's layer."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        if side.sharded:
            out = side.model(side.local(batch[0]), side.rank)
            loss = F.cross_entropy(out, side.local(batch[1]))
        else:
            parts = zip(batch[0].chunk(2), batch[1].chunk(2))
            loss = sum(F.cross_entropy(side.model(x, r), y) for r, (x, y) in enumerate(parts)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(ChooseByRank(), stage=stage, batches=CLASSES, step=step, auto_wrap=nn.Linear)


class MoEBlock(nn.Module):
    """A router and experts, returning ``(output, loss, router_logits)`` (Qwen3-MoE's shape)."""

    def __init__(self, experts: int = 3) -> None:
        super().__init__()
        self.gate = nn.Linear(HIDDEN, experts, bias=False)
        self.experts = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(experts))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        router_logits = self.gate(x)
        for expert in self.experts:
            x = expert(x)
        x = torch.relu(x)
        return x, F.cross_entropy(x, y), router_logits


@stages
@pytest.mark.parametrize("leaf", [True, False], ids=["block-unit", "expert-units"])
def test_block_returning_several_tensors(stage: int, leaf: bool) -> None:
    """Mirrors test_zero_leaf_module.py::TestSetZ3LeafModule, its
    test_multi_output_leaf_module_thread_safety and test_multi_output_non_leaf_module_thread_safety:
    an MoE block returning its output, its loss and its router logits, all three in the
    loss; as one unit, or with the router and each expert a unit."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x, y = side.local(batch[0]), side.local(batch[1])
        out, loss, router = side.model(x, y)
        total = loss + 0.01 * router.mean() + 0.1 * out.mean()
        total.backward()
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(
        MoEBlock(),
        stage=stage,
        batches=CLASSES,
        step=step,
        auto_wrap=None if leaf else nn.Linear,  # None: the whole block is one unit
    )


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.second = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x)))


@stages
@pytest.mark.parametrize("requires_grad", [False, True], ids=["plain-input", "input-grad"])
def test_inputs_with_and_without_requires_grad(stage: int, requires_grad: bool) -> None:
    """Mirrors test_zero_leaf_module.py::TestSetZ3LeafModule::test_no_grad_input_error (where
    DeepSpeed refuses a leaf module's input that does not require grad) and
    ::test_choose_module_by_counter (inputs that do): both train as on the plain model, and an
    input that requires grad gets the plain model's input gradient."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, HIDDEN), (8, HIDDEN))

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x = side.local(batch[0]).clone().requires_grad_(requires_grad)
        loss = F.mse_loss(side.model(x), side.local(batch[1]))
        loss.backward()
        if requires_grad:  # the slice's mean loss: its input gradient is world-size times larger
            grad = full_tensor(side, x.grad / side.world_size, batch[0].shape)
            side.note("input gradient", grad)
        else:
            assert x.grad is None
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(TwoLayers(), stage=stage, batches=batches, step=step, auto_wrap=nn.Linear)


class BaseLeaf(nn.Module):
    """A base class a policy names; the units are instances of its subclass."""


class SubLeaf(BaseLeaf):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        return torch.tanh(self.proj(x))


class WrapperLeaf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.child = SubLeaf()

    def forward(self, x: Tensor) -> Tensor:
        return self.child(x)


@stages
def test_policy_by_base_class_selects_subclass_instances(stage: int) -> None:
    """Mirrors test_zero_leaf_module.py::TestSetZ3LeafModule::test_set_leaf_modules_with_subclass
    and ::test_set_no_match_class: ``auto_wrap`` naming a base class makes units of its
    subclasses' instances (not of their wrappers), a class the model does not contain is
    refused naming the classes it does, and the model trains as the plain one."""
    torch.manual_seed(0)
    model = nn.Sequential(WrapperLeaf(), WrapperLeaf())
    batches = make_batches(3, (8, HIDDEN), (8, HIDDEN))

    def prepare(side: Side) -> None:
        if side.sharded:
            units = [u.module for u in side.model._shardwrap_root.units[1:]]
            assert units == [side.model[0].child, side.model[1].child]
            with pytest.raises(ValueError, match="SubLeaf"):
                ShardedModule(TwoLayersWrapped(), process_group=side.pg, auto_wrap=nn.Conv2d)

    assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(lambda m, x, y: F.mse_loss(m(x), y)),
        prepare=prepare,
        auto_wrap=BaseLeaf,
    )


class TwoLayersWrapped(nn.Module):
    """A model without convolutions, whose classes the refusal names."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = SubLeaf()

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


class MLPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.up_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))


class FineGrained(nn.Module):
    """Two coarse layers and many small blocks."""

    def __init__(self, blocks: int = 6) -> None:
        super().__init__()
        self.coarse1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.coarse2 = nn.Linear(4 * HIDDEN, HIDDEN)
        self.fine = nn.Sequential(*(MLPBlock() for _ in range(blocks)))

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        x = self.fine(self.coarse2(self.coarse1(x)))
        return x, F.cross_entropy(x, y)


@stages
@pytest.mark.parametrize("threshold", [100, 400, 1500], ids=["per-layer", "per-block", "coarse"])
def test_units_chosen_by_parameter_count(stage: int, threshold: int) -> None:
    """Mirrors test_zero_leaf_module.py::TestZ3LeafOptimization::test_finegrained_optimization
    (``module_granularity_threshold``): ``auto_wrap`` as a minimum parameter count makes units
    of single layers, of whole blocks or of large modules only; the losses equal the plain
    model's at every granularity."""
    torch.manual_seed(0)
    assert_peer_parity(
        FineGrained(),
        stage=stage,
        batches=CLASSES,
        step=plain_step(_loss),
        make_optimizer=adamw,
        auto_wrap=threshold,
    )


class Delegating(nn.Module):
    """Forwards unknown attributes to the module it wraps (a common adapter pattern)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.wrapped = module

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("wrapped"), name)

    def forward(self, x: Tensor) -> Tensor:
        return self.wrapped(x)


class DelegatingModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input = nn.Linear(HIDDEN, HIDDEN)
        self.output = Delegating(nn.Linear(HIDDEN, HIDDEN))

    def forward(self, x: Tensor) -> Tensor:
        return self.output(torch.tanh(self.input(x)))


@stages
def test_unit_that_delegates_attribute_access(stage: int) -> None:
    """Mirrors test_zero_hook_attribute_delegation.py::TestHookAttributeDelegation::test: a unit
    whose ``__getattr__`` forwards unknown names to the module it wraps; its attributes still
    resolve (``in_features`` through the delegation) and it trains as on the plain model."""
    torch.manual_seed(0)
    batches = make_batches(3, (8, HIDDEN), (8, HIDDEN))

    def prepare(side: Side) -> None:
        assert side.model.output.in_features == HIDDEN

    assert_peer_parity(
        DelegatingModel(),
        stage=stage,
        batches=batches,
        step=plain_step(lambda m, x, y: F.mse_loss(m(x), y)),
        prepare=prepare,
        auto_wrap=Delegating,
    )


# unused parameters ------------------------------------------------------------------------------


class WithUnused(nn.Module):
    """DeepSpeed's ``UnusedParametersModel``: a linear layer forward never runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN)])
        self.unused_linear = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.linears[0](x), y)


@stages
@pytest.mark.parametrize("unit", ["own-unit", "shared-unit"])
def test_parameters_forward_never_uses(stage: int, unit: str) -> None:
    """Mirrors test_ignore_unused_parameters.py::TestStage2IgnoreUnusedParameters::test: a layer
    forward never runs, with no flag to declare it; its parameters keep ``grad = None`` (so
    AdamW leaves them alone, weight decay included), whether it is a unit of its own or shares
    one with used parameters, and the rest trains as on the plain model."""
    torch.manual_seed(0)
    model = WithUnused()
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _loss(side.model, side.local(batch[0]), side.local(batch[1]))
        loss.backward()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    _, runs = assert_peer_parity(
        model,
        stage=stage,
        batches=CLASSES,
        step=step,
        make_optimizer=adamw,
        compare_parameters=True,
        auto_wrap=nn.Linear if unit == "own-unit" else None,
    )
    for run in runs:
        assert torch.equal(run.state["unused_linear.weight"], model.unused_linear.weight)
