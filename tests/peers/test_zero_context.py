"""Behaviours around a unit's parameters that DeepSpeed ZeRO's own suite asserts, ported to
shardwrap: parameters gathered outside forward (edits, ``modifier_rank``), a unit's weight used
outside it, a unit returning its own parameter, output types, autocast, and backward driven by
the user (non-scalar outputs, two wrapped models, several backwards, frozen bases).

Upstream (``deepspeedai/DeepSpeed``, ``tests/unit``): ``runtime/zero/test_zero_context.py``
(``GatheredParameters``), ``runtime/zero/test_zero_context_return.py``,
``v1/zero/test_zero_autocast.py``, ``runtime/zero/test_zero_autocast_mixed_dtype.py``,
``v1/zero/test_zero_user_backward.py``, ``v1/zero/test_zero2_offload_multi_backward.py``,
``runtime/zero/test_unwrap_model.py``, ``runtime/zero/test_zero_linear_direct_init.py``,
``runtime/zero/test_zero_shared_loss_gradient.py``,
``v1/zero/test_zero_coalesce_grad_reduction.py``, ``v1/zero/test_zero_torch_func.py`` and
``checkpoint/test_zero_optimizer.py``.
Each test names the upstream test it mirrors and trains a plain deep copy of its model on the
whole global batch beside a ``ShardedModule`` copy on each rank (its slice), at stages 1, 2 and
3, over several steps (``tests/support/peers.py``): SGD with momentum, parameters equal within
1e-5; plus each behaviour's own reads, equal to the plain model's within 1e-5. 2 ranks.

Run: ``PYTHONPATH=. OMP_NUM_THREADS=1 .venv/bin/python -m pytest -q -n 2
tests/peers/test_zero_context.py`` (the whole tier: ``pytest tests/peers -m peers -n 3``).
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tests.support.models import FrozenPart, LoRALinear, make_batch
from tests.support.peers import (
    STAGES,
    Batch,
    Side,
    assert_peer_parity,
    make_batches,
    note_grads,
    plain_step,
    run_sharded,
    sgd,
    shapes_of,
)

pytestmark = pytest.mark.peers

stages = pytest.mark.parametrize("stage", STAGES, ids=[f"stage{s}" for s in STAGES])
HIDDEN = 12
CLASSES = make_batches(4, (8, HIDDEN), None)


# parameters gathered outside forward ------------------------------------------------------------


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1 = nn.Linear(HIDDEN, HIDDEN)
        self.l2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        return self.l2(torch.tanh(self.l1(x)))


def _pair_loss(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
    return F.mse_loss(model(x), y)


REGRESSION = make_batches(3, (8, HIDDEN), (8, HIDDEN))


def _whole(side: Side) -> dict[str, Tensor]:
    """Every parameter as a module attribute (inside ``gathered()`` on the wrapped model)."""
    return {
        f"{m}.{k}": getattr(side.model.get_submodule(m), k).detach().clone()
        for m, k in (("l1", "weight"), ("l1", "bias"), ("l2", "weight"), ("l2", "bias"))
    }


@stages
def test_gathered_gives_full_parameters_and_releases_them(stage: int) -> None:
    """Mirrors test_zero_context.py::TestZeroGatheredParametersFree::test and
    ::TestScatterGather::test: inside ``gathered()`` every parameter is whole (the plain
    model's values, read as module attributes), after it each is a piece again, and a module
    built outside the wrapped model is untouched; training goes on as on the plain model."""
    torch.manual_seed(0)
    outside = nn.Linear(6, 3)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = plain_step(_pair_loss)(side, opt, batch)
        if side.sharded:
            pieces = [p.numel() for p in side.model.parameters()]
            with side.model.gathered():
                assert side.model.l1.weight.shape == (HIDDEN, HIDDEN)
                side.note("whole parameters", _whole(side))
            assert [p.numel() for p in side.model.parameters()] == pieces
            assert side.model.l1.weight.numel() < HIDDEN * HIDDEN
        else:
            side.note("whole parameters", _whole(side))
        assert outside.weight.shape == (3, 6)
        return loss

    assert_peer_parity(Pair(), stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear)


def _edit(model: nn.Module) -> None:
    with torch.no_grad():
        model.l1.weight.mul_(0.5)
        model.l2.bias.fill_(0.25)


@stages
@pytest.mark.parametrize("writeback", [False, True], ids=["read-only", "writeback"])
def test_edits_inside_gathered_land_only_with_writeback(stage: int, writeback: bool) -> None:
    """Mirrors test_zero_context.py::TestGatheredParametersAllRanksErrorOnModification::test
    and ::TestGatherUpdate::test (every rank editing alike): in-place edits inside
    ``gathered()`` are discarded on every rank (where DeepSpeed raises on every rank), and with
    ``writeback=True`` they land in the pieces; training then matches the plain model edited
    (or not) alike."""
    torch.manual_seed(0)

    def prepare(side: Side) -> None:
        if side.sharded:
            with side.model.gathered(writeback=writeback):
                _edit(side.model)
        elif writeback:
            _edit(side.model)

    assert_peer_parity(
        Pair(),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


@stages
def test_edit_by_the_modifier_rank_reaches_every_rank(stage: int) -> None:
    """Mirrors test_zero_context.py::TestGatherUpdate::test: inside
    ``gathered(writeback=True, modifier_rank=1)`` only rank 1 edits (weights loaded on one
    rank); on leaving, its values are every rank's, and training matches the plain model
    edited once."""
    torch.manual_seed(0)

    def prepare(side: Side) -> None:
        if side.sharded:
            with side.model.gathered(writeback=True, modifier_rank=1):
                if side.rank == 1:
                    _edit(side.model)
        else:
            _edit(side.model)

    assert_peer_parity(
        Pair(),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


def _loaded() -> dict[str, Tensor]:
    with torch.random.fork_rng():
        torch.manual_seed(5)
        return Pair().state_dict()


@stages
def test_a_load_by_the_modifier_rank_reaches_every_rank(stage: int) -> None:
    """Mirrors checkpoint/test_zero_optimizer.py::TestZeROPPLoadCheckpoint::test_load_zeropp_model:
    inside ``gathered(modifier_rank=0)`` rank 0 alone loads a state dict
    (``model.module.load_state_dict(sd)``); on leaving, its weights are every rank's, and
    training matches the plain model that loaded them."""
    weights = _loaded()

    def prepare(side: Side) -> None:
        if side.sharded:
            with side.model.gathered(modifier_rank=0):
                if side.rank == 0:
                    side.model.module.load_state_dict(weights)
        else:
            side.model.load_state_dict(weights)

    assert_peer_parity(
        Pair(),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        prepare=prepare,
        auto_wrap=nn.Linear,
    )


@stages
def test_edit_on_one_rank_without_modifier_rank_is_never_half_applied(stage: int) -> None:
    """The other side of test_zero_context.py::TestGatherUpdate::test (``modifier_rank``) and
    ::TestGatheredParametersAllRanksErrorOnModification::test: rank 0 alone edits inside
    ``gathered(writeback=True)`` without naming a modifier rank (loading weights on rank 0).
    Either every rank raises an error naming ``modifier_rank``, or the ranks end up with one
    and the same model; never a model whose pieces mix edited and unedited values."""
    torch.manual_seed(0)

    def finish(side: Side) -> None:
        if not side.sharded:
            return
        raised: BaseException | None = None
        try:
            with side.model.gathered(writeback=True):
                if side.rank == 0:
                    _edit(side.model)
        except (RuntimeError, ValueError) as error:
            raised = error
        if side.flag_all(raised is not None):
            assert "modifier_rank" in str(raised), raised
            return
        assert side.flag_all(raised is None), "some ranks raised, others did not"
        state = side.model.full_state_dict()
        for key, value in state.items():
            mine = value.clone()
            others = [torch.empty_like(mine) for _ in range(side.world_size)]
            side.pg.allgather([others], [mine]).wait()
            assert all(torch.equal(o, mine) for o in others), f"{key} differs across ranks"
        with side.model.gathered():
            assert torch.equal(side.model.l2.bias, torch.full((HIDDEN,), 0.25)), "half applied"

    assert_peer_parity(
        Pair(),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        finish=finish,
        auto_wrap=nn.Linear,
    )


class UsesWeightOutside(nn.Module):
    """The root's forward uses ``linear1.weight`` (a unit's) directly, outside that unit."""

    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, HIDDEN)
        self.linear2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        b = self.linear2(torch.tanh(self.linear1(x)))
        return F.linear(b, self.linear1.weight)


@stages
def test_unit_weight_used_outside_its_unit(stage: int) -> None:
    """Mirrors test_zero_context.py::TestSerialContext::test_ext_param_getattr: the root's
    forward applies ``F.linear(b, self.linear1.weight)``, a unit's weight outside that unit.
    Where the full parameters stay between uses (stages 1 and 2) it trains as the plain model;
    at stage 3, where outside its unit the weight is a piece, it raises a RuntimeError naming
    shardwrap and the parameter instead of a shape error from deep inside ``F.linear``."""
    torch.manual_seed(0)
    if stage == 3:

        def refused(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
            with pytest.raises(RuntimeError) as raised:
                side.model(side.local(batch[0]))
            message = str(raised.value)
            assert "linear1.weight" in message and "shardwrap" in message, message
            return torch.zeros(())

        run_sharded(
            UsesWeightOutside(), 2, sgd, REGRESSION[:1], refused, stage=3, auto_wrap=nn.Linear
        )
        return
    assert_peer_parity(
        UsesWeightOutside(),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        auto_wrap=nn.Linear,
    )


# parameters a unit returns ----------------------------------------------------------------------


class Holder:
    """A plain object (not a pytree container) carrying tensors out of a module."""

    def __init__(self, out: Tensor, bias: Tensor) -> None:
        self.out = out
        self.bias = bias


class DanglingBias(nn.Linear):
    """A linear layer that also returns its own bias, in a tuple or inside a ``Holder``."""

    def __init__(self, as_object: bool) -> None:
        super().__init__(HIDDEN, HIDDEN)
        self.as_object = as_object

    def forward(self, x: Tensor) -> Any:
        out = super().forward(x)
        return Holder(out, self.bias) if self.as_object else (out, self.bias)


class Container(nn.Module):
    """Uses the bias a unit returned after another unit of the same size ran (at stage 3 the
    first is released by then, its buffer handed on)."""

    def __init__(self, as_object: bool) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, HIDDEN)
        self.dangler = DanglingBias(as_object)
        self.linear2 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        returned = self.dangler(torch.tanh(self.linear1(x)))
        if isinstance(returned, Holder):
            out, bias = returned.out, returned.bias
        else:
            out, bias = returned
        return self.linear2(out) + 2 * bias


@stages
@pytest.mark.parametrize("how", ["tuple", "object"])
def test_unit_returning_its_own_parameter(stage: int, how: str) -> None:
    """Mirrors test_zero_context_return.py::TestReturnParam::test_ext_param_return (the unit
    returns ``(out, self.bias)``) and ::test_ext_param_returnobj (inside a plain object): the
    parent adds the returned bias after another unit ran, each unit released after its forward
    (``bucket_mb=0``); the bias it adds is the whole bias and its gradient adds up, as on the
    plain model."""
    torch.manual_seed(0)

    assert_peer_parity(
        Container(how == "object"),
        stage=stage,
        batches=REGRESSION,
        step=plain_step(_pair_loss),
        auto_wrap=nn.Linear,
        bucket_mb=0,
    )


class VariableOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor, kind: str) -> Any:
        act = self.linear1(x)
        if kind == "dict":
            return {"loss": act.pow(2).mean()}
        if kind == "tensor":
            return act.pow(2).mean()
        return None


@stages
@pytest.mark.parametrize("kind", ["tensor", "dict"])
def test_model_output_types_including_none(stage: int, kind: str) -> None:
    """Mirrors test_zero_context_return.py::TestReturnParam::test_stage_3_output_type: the model
    returns a tensor, a dict holding the loss, or ``None`` (a forward run for its side
    effects, between training forwards); all three run, and the training matches the plain
    model."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x = side.local(batch[0])
        assert side.model(x, "none") is None
        out = side.model(x, kind)
        loss = out["loss"] if kind == "dict" else out
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        VariableOutput(), stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear
    )


# autocast -------------------------------------------------------------------------------------


def _chunked_reference(forward: Any, side: Side, batch: Batch, world: int = 2) -> Tensor:
    """The plain model's loss on the global batch as the ranks compute it: each rank slice's
    mean loss (its own autocast matmuls), averaged."""
    if side.sharded:
        return forward(side.model, side.local(batch[0]), side.local(batch[1]))
    parts = zip(batch[0].chunk(world), batch[1].chunk(world))
    return sum(forward(side.model, x, y) for x, y in parts) / world


class WithNorm(nn.Module):
    """DeepSpeed's ``SimpleModelWithLayerNorm``: a linear layer (bf16 under autocast) and a
    LayerNorm (float32 under autocast)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(HIDDEN, HIDDEN)
        self.norm = nn.LayerNorm(HIDDEN)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(self.norm(self.linear(x)).float(), y)


@stages
def test_autocast_around_the_wrapped_model(stage: int) -> None:
    """Mirrors test_zero_autocast.py::TestZeroAutoCast::test and ::test_safe_modules_conf: the
    forward runs under ``torch.autocast("cpu", torch.bfloat16)``: linear layers compute in
    bf16, the LayerNorm in float32, parameters and gradients stay float32; the losses and
    parameters match the plain model under autocast, each rank slice's loss its own."""
    torch.manual_seed(0)

    def forward(model: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(x, y)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _chunked_reference(forward, side, batch)
        loss.backward()
        assert all(p.grad.dtype == torch.float32 for p in side.model.parameters())
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(WithNorm(), stage=stage, batches=CLASSES, step=step, auto_wrap=nn.Linear)


class Adapter(nn.Module):
    """A frozen bf16 base weight and float32 adapters in one unit (a quantized LoRA base)."""

    def __init__(self) -> None:
        super().__init__()
        self.base_weight = nn.Parameter(
            (torch.randn(HIDDEN, HIDDEN) / 4).to(torch.bfloat16), requires_grad=False
        )
        self.adapter_a = nn.Parameter(torch.randn(4, HIDDEN) / 4)
        self.adapter_b = nn.Parameter(torch.randn(HIDDEN, 4) / 4)

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        base = F.linear(x, self.base_weight)
        adapter = F.linear(F.linear(x, self.adapter_a), self.adapter_b) / 4
        return F.mse_loss((base + adapter).float(), y.float())


@stages
def test_float32_adapters_beside_a_bf16_frozen_base_under_autocast(stage: int) -> None:
    """Mirrors test_zero_autocast_mixed_dtype.py::TestZero3AutocastMixedDtype::
    test_fp32_adapter_with_bf16_base_params: float32 adapters beside a frozen bf16 base weight
    in one unit, under bf16 autocast; the adapters get non-zero float32 gradients and train,
    the base keeps its dtype and values, as on the plain model."""
    torch.manual_seed(0)
    model = Adapter()
    batches = make_batches(3, (8, HIDDEN), (8, HIDDEN))

    def forward(m: nn.Module, x: Tensor, y: Tensor) -> Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return m(x, y)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = _chunked_reference(forward, side, batch)
        loss.backward()
        grad = side.model.adapter_a.grad
        assert grad is not None and grad.dtype == torch.float32
        assert side.model.base_weight.grad is None
        opt.step()
        opt.zero_grad()
        return loss

    _, runs = assert_peer_parity(model, stage=stage, batches=batches, step=step)
    for run in runs:
        assert run.state["base_weight"].dtype == torch.bfloat16
        assert torch.equal(run.state["base_weight"], model.base_weight)


@stages
def test_training_goes_on_after_full_parameters_are_handed_out(stage: int) -> None:
    """Mirrors test_unwrap_model.py (DeepSpeed's ``unwrap_model_for_generation``): between
    steps the full parameters are handed out, for a no-grad evaluation with units kept
    gathered (``keep_gathered(True)``) and as module attributes (``gathered()``); both read the
    plain model's values, and training after them goes on as on the plain model."""
    torch.manual_seed(0)
    probe = torch.linspace(-1, 1, 2 * HIDDEN).view(2, HIDDEN)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        loss = plain_step(_pair_loss)(side, opt, batch)
        with torch.no_grad():
            if side.sharded:
                with side.model.keep_gathered(True):
                    side.note("evaluation", side.model(probe))
                    side.note("evaluation again", side.model(probe))
                with side.model.gathered():
                    side.note("whole parameters", _whole(side))
            else:
                side.note("evaluation", side.model(probe))
                side.note("evaluation again", side.model(probe))
                side.note("whole parameters", _whole(side))
        return loss

    assert_peer_parity(Pair(), stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear)


# backward driven by the user --------------------------------------------------------------------


@stages
def test_backward_of_a_non_scalar_output(stage: int) -> None:
    """Mirrors test_zero_user_backward.py::TestZeroUserBackwardNonScalar::test_non_scalar_backward:
    ``output.backward(gradient)`` on the model's (non-scalar) output, the gradient of a mean;
    the parameters' gradients and the step match the plain model's."""
    torch.manual_seed(0)
    model = Pair()
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        out = side.model(side.local(batch[0]))
        out.backward(torch.full_like(out, 1 / out.numel()))
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return out.detach().mean()

    assert_peer_parity(model, stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear)


@stages
@pytest.mark.parametrize("kind", ["save_on_cpu", "clone"])
def test_saved_tensor_hooks_around_forward_and_backward(stage: int, kind: str) -> None:
    """Mirrors test_zero_linear_direct_init.py: under the user's saved-tensor hooks
    (``torch.autograd.graph.save_on_cpu``, or a pack hook that clones) around forward and
    backward, what backward reads is the whole weight: gradients and steps match the plain
    model's, and ``F.linear`` is torch's own."""
    torch.manual_seed(0)
    model = Pair()
    shapes = shapes_of(model)
    linear = F.linear

    def hooks() -> Any:
        if kind == "save_on_cpu":
            return torch.autograd.graph.save_on_cpu()
        return torch.autograd.graph.saved_tensors_hooks(lambda t: t.detach().clone(), lambda t: t)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        with hooks():
            loss = _pair_loss(side.model, side.local(batch[0]), side.local(batch[1]))
            loss.backward()
        assert F.linear is linear
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(model, stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear)


@stages
@pytest.mark.parametrize("skip_sync", ["no_sync", "require_backward_grad_sync"])
def test_model_and_its_module_called_into_one_loss_over_micro_batches(
    stage: int, skip_sync: str
) -> None:
    """Mirrors test_zero_shared_loss_gradient.py: each micro-batch calls the model and
    ``model.module`` (the model itself, as DDP's habit has it) on two inputs, summed into one
    loss; eight micro-batches accumulate without reducing (``no_sync()``, or
    ``require_backward_grad_sync = False``), the last reduces. The accumulated gradients are
    the plain model's."""
    torch.manual_seed(0)
    model = Pair()
    shapes = shapes_of(model)
    count = 8

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        m, total = side.model, torch.zeros(())
        for i, x in enumerate(side.micro(batch[0], count)):
            last = i == count - 1
            inner = m.module if side.sharded else m
            skip = contextlib.nullcontext()
            if side.sharded and skip_sync == "no_sync" and not last:
                skip = m.no_sync()
            elif side.sharded and skip_sync == "require_backward_grad_sync":
                m.require_backward_grad_sync = last
            with skip:
                loss = (m(x) + inner(x * 0.5)).square().mean() / count
                loss.backward()
            total += loss.detach()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return total

    batches = make_batches(3, (32, HIDDEN), (32, HIDDEN), seed=3)
    assert_peer_parity(model, stage=stage, batches=batches, step=step, auto_wrap=nn.Linear)


class Models(nn.Module):
    """Two models trained together (an encoder and a head), each wrapped on its own."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = Pair()
        self.head = Pair()


@stages
def test_two_wrapped_models_one_combined_loss(stage: int) -> None:
    """Mirrors test_zero_user_backward.py::TestZeroUserBackwardMultipleEngines::
    test_multiple_engines_combined_loss: two models, each wrapped separately, feed one loss
    (the head's output and the encoder's own term); one backward trains both as the plain
    pair."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        h = side.model.encoder(side.local(batch[0]))
        loss = F.mse_loss(side.model.head(h), side.local(batch[1])) + 0.1 * h.pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    assert_peer_parity(
        Models(),
        stage=stage,
        batches=REGRESSION,
        step=step,
        children=("encoder", "head"),
        auto_wrap=nn.Linear,
    )


@stages
def test_several_backwards_per_step_with_recomputation(stage: int) -> None:
    """Mirrors test_zero_user_backward.py::TestZeroUserBackwardWithCheckpointing::
    test_checkpointed_multiple_backward and test_zero2_offload_multi_backward.py::
    TestZeroOffloadMultiBackward::test_multi_backward_across_multiple_steps: two forwards and
    two backwards per step, every unit recomputed in backward; the accumulated step matches the
    plain model's."""
    torch.manual_seed(0)
    model = Pair()
    shapes = shapes_of(model)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        total = torch.zeros(())
        for x, y in zip(side.micro(batch[0], 2), side.micro(batch[1], 2)):
            loss = _pair_loss(side.model, x, y) / 2
            loss.backward()
            total = total + loss.detach()
        note_grads(side, shapes)
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(
        model,
        stage=stage,
        batches=REGRESSION,
        step=step,
        auto_wrap=nn.Linear,
        checkpoint_activations=True,
    )


@stages
def test_lora_style_frozen_base_with_recomputation(stage: int) -> None:
    """Mirrors test_zero_user_backward.py::TestZeroFrozenParamCheckpointingVariants::
    test_lora_style: a frozen embedding and a LoRA layer (frozen base, trainable factors) in a
    recomputed unit; the factors and the head train as on the plain model, the frozen weights
    never change."""
    torch.manual_seed(0)
    model = FrozenPart()
    batches = [make_batch(seed=s, batch=8, context=6, vocab=29) for s in range(3)]
    _, runs = assert_peer_parity(
        model,
        stage=stage,
        batches=batches,
        step=plain_step(lambda m, x, y: m(x, y)),
        auto_wrap=LoRALinear,
        checkpoint_activations=True,
    )
    for run in runs:
        assert torch.equal(run.state["adapter.base.weight"], model.adapter.base.weight)


class FrozenFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.frozen = nn.Linear(HIDDEN, HIDDEN)
        self.frozen.requires_grad_(False)
        self.trained = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x: Tensor) -> Tensor:
        return self.trained(torch.relu(self.frozen(x)))


@stages
def test_frozen_unit_input_without_grad_accumulating(stage: int) -> None:
    """Mirrors test_zero_user_backward.py::TestZeroFrozenParamNoGradInputAccumulation::
    test_no_grad_input_accumulation: a frozen first unit whose input does not require grad (so
    nothing before the trainable unit needs a gradient), recomputed, over two backwards per
    step; the trainable unit accumulates as on the plain model."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        total = torch.zeros(())
        for x, y in zip(side.micro(batch[0], 2), side.micro(batch[1], 2)):
            loss = _pair_loss(side.model, x, y) / 2
            loss.backward()
            total = total + loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    assert_peer_parity(
        FrozenFirst(),
        stage=stage,
        batches=REGRESSION,
        step=step,
        auto_wrap=nn.Linear,
        checkpoint_activations=True,
    )


@stages
def test_a_step_inside_no_sync_raises_and_changes_nothing(stage: int) -> None:
    """Mirrors v1/zero/test_zero_coalesce_grad_reduction.py::TestCoalesceFailureModes::
    test_step_inside_context_raises: an optimizer step after a backward inside ``no_sync()``,
    before the synced one, raises (here on every rank, naming ``no_sync``) and changes nothing;
    the step after the synced backward trains as the plain model accumulating both halves."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        m, total = side.model, torch.zeros(())
        for i, (x, y) in enumerate(zip(side.micro(batch[0], 2), side.micro(batch[1], 2))):
            skip = m.no_sync() if side.sharded and i == 0 else contextlib.nullcontext()
            with skip:
                loss = _pair_loss(m, x, y) / 2
                loss.backward()
                if side.sharded and i == 0:
                    with pytest.raises(RuntimeError, match=r"step\(\) after a backward under"):
                        opt.step()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        return total

    batches = make_batches(3, (16, HIDDEN), (16, HIDDEN), seed=4)
    assert_peer_parity(Pair(), stage=stage, batches=batches, step=step, auto_wrap=nn.Linear)


@stages
def test_torch_func_grad_through_the_model_is_refused_and_training_goes_on(stage: int) -> None:
    """Mirrors v1/zero/test_zero_torch_func.py::TestEngineTorchFunc::test_grad_through_engine,
    where ``torch.func.grad`` through the engine gives the plain model's input gradient.
    shardwrap differs: it keeps what autograd saves of gathered parameters through saved-tensor
    hooks, which ``torch.func``'s transforms refuse, so the call is refused naming
    ``torch.autograd.grad(loss, inputs)``, which gives that gradient; the model is left as it
    was, and training after it is the plain model's."""
    torch.manual_seed(0)

    def step(side: Side, opt: torch.optim.Optimizer, batch: Batch) -> Tensor:
        x = side.local(batch[0])
        if side.sharded:
            with pytest.raises(RuntimeError, match=r"torch\.autograd\.grad\(loss, inputs\)"):
                torch.func.grad(lambda inp: side.model(inp).sum())(x)
        inp = x.clone().requires_grad_(True)
        (of_input,) = torch.autograd.grad(side.model(inp).sum(), inp)
        # its rows summed over the ranks: the whole batch's, as the reference's
        side.notes.append(("input gradient", side.mean(of_input.abs().sum()) * side.world_size))
        return plain_step(_pair_loss)(side, opt, batch)

    assert_peer_parity(Pair(), stage=stage, batches=REGRESSION, step=step, auto_wrap=nn.Linear)
