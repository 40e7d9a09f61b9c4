"""Coming from torch's FSDP: its auto-wrap policies and option objects work unchanged.

A script moving to shardwrap keeps its ``auto_wrap_policy`` (``ModuleWrapPolicy``,
``CustomPolicy``, ``transformer_auto_wrap_policy`` or ``size_based_auto_wrap_policy`` bound with
``functools.partial``, a set of block classes) and passes it as ``auto_wrap``. Each case checks
the units it makes on ``tests.support.models.GPT`` (module names worked out by hand from each
policy's documented rule), then two of them train in parity with the plain model at 2 ranks
(SGD, every parameter within 1e-5). A policy giving a module options of its own is refused.

``MixedPrecisionPolicy`` and ``MixedPrecision`` train bit for bit as the
``shardwrap.MixedPrecision`` of the same dtypes (2 ranks, 3 AdamW steps, losses and every
parameter); ``CPUOffloadPolicy`` and ``CPUOffload`` are the host tier. Settings with no
counterpart are refused, naming the line to write.

Torch's ``apply_activation_checkpointing`` applied before wrapping trains like the plain model;
applied after, in FSDP's order, it is refused before it swaps anything, naming both fixes.
FSDP2's gradient accumulation switch, ``model.set_requires_gradient_sync(False)``, accumulates
without communication and ends in parity with the plain model; FSDP2's other methods
(``unshard()``, ``set_reshard_after_forward``, ...) raise naming what to do instead. FSDP's own
arguments (``sharding_strategy``, ``device_id``, ``mp_policy``, ...) are refused naming
shardwrap's. Optimizers applied in backward (``_apply_optimizer_in_backward``) step as on the
plain model.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_from_fsdp.py -q``
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup, fsdp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
)
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from shardwrap import MixedPrecision, Offload, ShardedModule
from tests.support.models import GPT, Block, CausalSelfAttention, make_batch
from tests.support.parity import (
    GPT_BATCHES,
    adamw,
    assert_parity,
    build_gpt,
    gpt_loss,
    sgd,
    train_reference,
    train_sharded,
)
from tests.support.ranks import run_ranks

BLOCKS = {f"blocks.{i}" for i in range(3)}
# 5000 parameters: each block (16020) and its MLP (10548) are descended into; what they hold
# beside their selected children (144 and 0) stays below 5000, as does the ModuleList's rest.
# Selected: each attention (5328 in two Linears under 5000 each) and the two big MLP Linears.
BIG_ENOUGH = {f"blocks.{i}.{m}" for i in range(3) for m in ("attn", "mlp.0", "mlp.2")}

POLICIES = {
    "set": ({Block}, BLOCKS),
    "list": ([Block, nn.Embedding], BLOCKS | {"wte", "wpe"}),
    "module-wrap-policy": (ModuleWrapPolicy({Block}), BLOCKS),
    "custom-policy": (
        CustomPolicy(lambda m: isinstance(m, CausalSelfAttention)),
        {f"blocks.{i}.attn" for i in range(3)},
    ),
    "transformer": (
        functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block}),
        BLOCKS,
    ),
    "size-based": (
        functools.partial(size_based_auto_wrap_policy, min_num_params=5000),
        BIG_ENOUGH,
    ),
    # Never descended into below 20000: only the ModuleList is, which the policy never selects.
    "size-based-20000": (
        functools.partial(size_based_auto_wrap_policy, min_num_params=20000),
        None,
    ),
    "lambda": (
        functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, Block)),
        BLOCKS,
    ),
    # Every module but the ModuleList of blocks (its blocks are units; it is iterated, never
    # called, and would hold nothing): each a unit, as under FSDP.
    "always": (
        always_wrap_policy,
        {n for n, _ in build_gpt(False).named_modules() if n and n != "blocks"},
    ),
}


def _unit_names(model: ShardedModule) -> set[str]:
    names = {id(m): n for n, m in model.named_modules()}
    return {names[id(u.module)] for u in model._shardwrap_root.units if u.module is not model}


@pytest.mark.parametrize("name", POLICIES)
def test_an_fsdp_auto_wrap_policy_selects_the_units_it_selects_there(name: str) -> None:
    policy, want = POLICIES[name]
    if want is None:
        with pytest.raises(ValueError, match="selects no submodule of GPT"):
            ShardedModule(build_gpt(False), auto_wrap=policy)
        return
    assert _unit_names(ShardedModule(build_gpt(False), auto_wrap=policy)) == want


@pytest.mark.parametrize("name", ["transformer", "size-based", "always"])
def test_a_model_wrapped_by_an_fsdp_policy_trains_like_the_plain_model(name: str) -> None:
    assert_parity(build_gpt(True), 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=POLICIES[name][0])


class _Buffers(nn.Module):
    """Buffers only, read by the parent: no forward, no parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.shift = nn.Buffer(torch.full((5,), 0.5))


class _WithBuffers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)])
        self.consts = _Buffers()

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x + self.consts.shift


def test_a_policy_selecting_containers_that_would_hold_nothing_leaves_them_out() -> None:
    """``always_wrap_policy`` also selects an ``nn.ModuleList`` whose layers it selects, and a
    module of buffers without a forward: neither would hold a parameter, so neither is made a
    unit (before, both were refused as containers whose forward is never called); a container
    that would hold parameters of its own is still refused, naming the modules inside it."""
    torch.manual_seed(0)
    model = _WithBuffers()
    x = torch.randn(3, 5)
    sharded = ShardedModule(copy.deepcopy(model), auto_wrap=always_wrap_policy)
    assert _unit_names(sharded) == {"layers.0", "layers.1"}
    torch.testing.assert_close(sharded(x), model(x), atol=0, rtol=0)
    with pytest.raises(ValueError, match="'layers' \\(ModuleList\\), a container whose forward"):
        ShardedModule(copy.deepcopy(model), auto_wrap=lambda m: isinstance(m, nn.ModuleList))


def test_a_policy_giving_a_module_options_of_its_own_is_refused_naming_it() -> None:
    policy = CustomPolicy(
        lambda m: {"reshard_after_forward": False} if isinstance(m, Block) else False
    )
    with pytest.raises(ValueError) as error:
        ShardedModule(build_gpt(False), auto_wrap=policy)
    message = str(error.value)
    assert "gives blocks.0 (Block) options of its own (reshard_after_forward)" in message
    assert "return True for the modules to wrap" in message


BF16, F32 = torch.bfloat16, torch.float32
PRECISIONS = {
    "policy": (
        fsdp.MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=F32, output_dtype=F32),
        MixedPrecision(param_dtype=BF16, reduce_dtype=F32, output_dtype=F32),
    ),
    "policy-reduce-in-bf16": (
        fsdp.MixedPrecisionPolicy(param_dtype=BF16),
        MixedPrecision(param_dtype=BF16, reduce_dtype=None),
    ),
    "fsdp1": (
        fsdp.MixedPrecision(param_dtype=BF16, reduce_dtype=F32, buffer_dtype=BF16),
        MixedPrecision(param_dtype=BF16, reduce_dtype=F32, buffer_dtype=BF16),
    ),
}


@pytest.mark.parametrize("name", PRECISIONS)
def test_fsdps_mixed_precision_trains_bit_for_bit_as_shardwraps_own(name: str) -> None:
    theirs, own = PRECISIONS[name]
    model = build_gpt(False)
    runs = {
        label: train_sharded(
            model, 2, adamw, GPT_BATCHES, gpt_loss, auto_wrap=Block, mixed_precision=precision
        )
        for label, precision in (("theirs", theirs), ("own", own), ("fp32", None))
    }
    for rank in range(2):
        got, want = runs["theirs"][rank], runs["own"][rank]
        assert got.losses == want.losses, rank
        for key, value in want.state.items():
            assert torch.equal(got.state[key], value), (rank, key)
    assert runs["own"][0].losses != runs["fp32"][0].losses  # bf16 did change the numbers


REFUSED = {
    "uncast-inputs": (
        fsdp.MixedPrecisionPolicy(param_dtype=BF16, cast_forward_inputs=False),
        "MixedPrecisionPolicy with cast_forward_inputs=False",
        "shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None)",
    ),
    "low-precision-grads": (
        fsdp.MixedPrecision(param_dtype=BF16, reduce_dtype=F32, keep_low_precision_grads=True),
        "MixedPrecision with keep_low_precision_grads=True",
        "shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)",
    ),
    "batchnorm-in-fp32": (
        fsdp.MixedPrecision(param_dtype=BF16),
        "its _BatchNorm modules (here: 1) kept in full precision",
        "shardwrap.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None)",
    ),
}


@pytest.mark.parametrize("name", REFUSED)
def test_a_setting_with_no_counterpart_is_refused_naming_the_line_to_write(name: str) -> None:
    precision, setting, line = REFUSED[name]
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Sequential(nn.Linear(4, 4)))
    with pytest.raises(ValueError) as error:
        ShardedModule(model, auto_wrap=nn.Sequential, mixed_precision=precision)
    assert f"{setting} has no counterpart in shardwrap" in str(error.value)
    assert f"Pass {line} to train with shardwrap's own" in str(error.value)


@pytest.mark.parametrize(
    "offload",
    [fsdp.CPUOffloadPolicy(), fsdp.CPUOffload(offload_params=True), Offload(device="cpu")],
    ids=["policy", "fsdp1", "own"],
)
def test_fsdps_cpu_offload_is_the_host_tier(offload: object) -> None:
    """On a CPU compute device the host tier changes nothing and says so: the words show which
    tier each became."""
    with pytest.warns(UserWarning, match=r'Offload\(device="cpu"\) with a CPU compute device'):
        ShardedModule(build_gpt(False), auto_wrap=Block, offload=offload)


@pytest.mark.parametrize("offload", [fsdp.OffloadPolicy(), fsdp.CPUOffload(), None])
def test_fsdps_no_offload_is_none(offload: object) -> None:
    """``OffloadPolicy()`` and ``CPUOffload()`` offload nothing, and say nothing."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ShardedModule(build_gpt(False), auto_wrap=Block, offload=offload)


def test_cpu_offload_without_pinned_memory_is_refused_naming_the_line_to_write() -> None:
    with pytest.raises(ValueError) as error:
        ShardedModule(build_gpt(False), auto_wrap=Block, offload=fsdp.CPUOffloadPolicy(False))
    assert "CPUOffloadPolicy with pin_memory=False has no counterpart" in str(error.value)
    assert "Pass shardwrap.Offload(device='cpu')" in str(error.value)


def _checkpoint_blocks(model: nn.Module) -> nn.Module:
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def test_activation_checkpointing_applied_before_wrapping_trains_like_the_plain_model() -> None:
    model = build_gpt(False)
    want = train_reference(model, sgd, GPT_BATCHES, gpt_loss)
    checkpointed = _checkpoint_blocks(copy.deepcopy(model))
    for rank, run in enumerate(
        train_sharded(checkpointed, 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block)
    ):
        torch.testing.assert_close(run.losses, want.losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(
            run.state, want.state, atol=1e-5, rtol=0, msg=lambda m, r=rank: f"{r}: {m}"
        )


def test_activation_checkpointing_applied_after_wrapping_is_refused_naming_the_fix() -> None:
    """FSDP scripts wrap first and apply torch's checkpointing after; here the order is named."""
    model = ShardedModule(build_gpt(False), auto_wrap=Block)
    with pytest.raises(TypeError) as error:
        _checkpoint_blocks(model)
    message = str(error.value)
    assert "blocks.0 = CheckpointWrapper(blocks.0) puts a wrapper around a module" in message
    assert "apply_activation_checkpointing(model, ...), then ShardedModule" in message
    assert "checkpoint_activations=Block" in message
    assert all(type(b) is Block for b in model.blocks)  # nothing swapped


def test_set_requires_gradient_sync_accumulates_without_communication_as_fsdp2_does() -> None:
    """FSDP2's accumulation loop: sync off for all micro-batches but the last. No reduction runs
    until the last, and the parameters end as the plain model's trained on the whole batches."""
    model = build_gpt(False)
    want = train_reference(model, sgd, GPT_BATCHES, gpt_loss)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = sgd(m.parameters())
        for inputs, targets in GPT_BATCHES:
            micro = list(zip(inputs.chunk(2)[rank].chunk(2), targets.chunk(2)[rank].chunk(2)))
            for i, (x, y) in enumerate(micro):
                m.set_requires_gradient_sync(i == len(micro) - 1)
                before = m.comm_stats.bytes.get("reduce_scatter", 0)
                (gpt_loss(m, x, y) / len(micro)).backward()
                synced = m.comm_stats.bytes.get("reduce_scatter", 0) > before
                assert synced == (i == len(micro) - 1), (rank, i)
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    for rank, state in enumerate(run_ranks(2, fn, timeout=30)):
        torch.testing.assert_close(
            state, want.state, atol=1e-5, rtol=0, msg=lambda m, r=rank: f"{r}: {m}"
        )


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_optimizers_applied_in_backward_step_as_on_the_plain_model(stage: int) -> None:
    """``torch.distributed.optim._apply_optimizer_in_backward`` (FSDP's optimizer overlap, as
    torchrec uses it): each parameter's own optimizer steps once its gradient is reduced, and
    its ``.grad`` is ``None`` after, as on the plain model (before: it hooked the pieces'
    gradient accumulators, which never run, so the model never trained). With
    ``register_hook=False`` the caller steps them: backward leaves them alone."""
    from torch.distributed.optim import _apply_optimizer_in_backward

    model = build_gpt(False)

    def train(m: nn.Module, rank: int, world: int, hooked: bool) -> dict[str, Tensor]:
        params = list(m.parameters())
        _apply_optimizer_in_backward(torch.optim.SGD, params[:5], {"lr": 0.1}, register_hook=hooked)
        _apply_optimizer_in_backward(
            torch.optim.SGD, params[5:], {"lr": 0.1, "momentum": 0.9}, register_hook=hooked
        )
        for inputs, targets in GPT_BATCHES:
            gpt_loss(m, inputs.chunk(world)[rank], targets.chunk(world)[rank]).backward()
            assert all((p.grad is None) == hooked for p in params)
            if not hooked:
                for p in params:
                    for optimizer in p._in_backward_optimizers:
                        optimizer.step()
                    p.grad = None
        return {k: v.detach().clone() for k, v in m.state_dict().items()}

    for hooked in (True, False):
        want = train(copy.deepcopy(model), 0, 1, hooked)

        def fn(rank: int, pg: ProcessGroup, hooked: bool = hooked) -> dict[str, Tensor]:
            m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=stage)
            train(m, rank, 2, hooked)
            return m.full_state_dict()

        for state in run_ranks(2, fn, timeout=30):
            torch.testing.assert_close(state, want, atol=1e-5, rtol=0)


def test_set_requires_gradient_sync_for_part_of_the_model_is_refused() -> None:
    model = ShardedModule(build_gpt(False), auto_wrap=Block)
    with pytest.raises(ValueError, match=r"recurse=False\) has no counterpart in shardwrap"):
        model.set_requires_gradient_sync(False, recurse=False)
    assert model.require_backward_grad_sync


FSDP_ARGUMENTS = {
    "shard-grad-op": (
        {"sharding_strategy": fsdp.ShardingStrategy.SHARD_GRAD_OP},
        "sharding_strategy=SHARD_GRAD_OP is FSDP's; write stage=3, reshard_after_forward=False",
    ),
    "hybrid": (
        {"sharding_strategy": fsdp.ShardingStrategy.HYBRID_SHARD},
        'write process_group= a DeviceMesh with dimensions ("replicate", "shard")',
    ),
    "device-id": ({"device_id": 0}, "device_id is FSDP's; write device="),
    "two": (
        {"mp_policy": fsdp.MixedPrecisionPolicy(), "use_orig_params": True},
        "mp_policy is FSDP's; write mixed_precision= (the same MixedPrecisionPolicy works); "
        "use_orig_params is FSDP's; drop it",
    ),
    "ignored-states": (
        {"ignored_states": []},
        "ignored_states is FSDP's; no counterpart: keep what must stay unsharded outside",
    ),
    "device-mesh": ({"device_mesh": None}, "device_mesh is FSDP's; write process_group="),
    "shard-placement-fn": (
        {"shard_placement_fn": None},
        "shard_placement_fn is FSDP's; no counterpart: each unit's parameters are sharded",
    ),
    "unknown": ({"autowrap": Block}, "autowrap is not an argument of ShardedModule"),
}


@pytest.mark.parametrize("name", FSDP_ARGUMENTS)
def test_an_argument_of_fsdps_is_refused_naming_the_one_to_write(name: str) -> None:
    arguments, said = FSDP_ARGUMENTS[name]
    with pytest.raises(TypeError) as error:
        ShardedModule(build_gpt(False), auto_wrap=Block, **arguments)
    assert said in str(error.value)
    assert "Its arguments: auto_wrap, process_group, device, stage," in str(error.value)


def test_every_other_fsdp2_method_raises_naming_what_to_do_instead() -> None:
    """Each public method of FSDP2's ``FSDPModule`` (read from the installed torch) but
    ``set_requires_gradient_sync`` called on a sharded model raises an ``AttributeError``
    naming shardwrap's counterpart or that there is none (before: "'GPT' object has no
    attribute 'unshard'"); ``hasattr`` stays ``False``, and the model's own attributes and
    submodules are found as before."""
    from torch.distributed.fsdp import FSDPModule

    names = sorted(n for n, v in vars(FSDPModule).items() if not n.startswith("_") and callable(v))
    assert "unshard" in names and "set_modules_to_forward_prefetch" in names
    model = ShardedModule(GPT(), auto_wrap=Block)
    for name in names:
        if name == "set_requires_gradient_sync":
            assert callable(getattr(model, name))
            continue
        assert not hasattr(model, name), name
        said = f"GPT.{name}: FSDP2's {name}\\(\\) has no namesake"
        with pytest.raises(AttributeError, match=said):
            getattr(model, name)
    assert model.blocks[0] is model.get_submodule("blocks.0")
    with pytest.raises(AttributeError, match="'GPT' object has no attribute 'nothing'"):
        model.nothing  # noqa: B018


def test_a_dtensors_own_calls_on_pieces_name_what_gives_whole_values() -> None:
    """FSDP2's parameters, gradients and state dict values are DTensors: a script (torchtune's
    ``gather_cpu_state_dict``) calls ``.full_tensor()`` on them. Here they are this rank's
    pieces, and each such call raises an ``AttributeError`` naming ``full_state_dict`` and
    ``gathered`` (before: only that the attribute was missing); ``hasattr`` stays false."""
    model = ShardedModule(GPT(), auto_wrap=Block)
    model(*make_batch(seed=0, batch=2)).backward()
    p = next(model.parameters())
    pieces = {
        "parameter": p,
        "data": p.data,
        "grad": p.grad,
        "state_dict": next(iter(model.state_dict().values())),
    }
    for where, piece in pieces.items():
        for name in ("full_tensor", "to_local", "placements"):
            assert not hasattr(piece, name), where
            with pytest.raises(AttributeError, match=r"not DTensors.*full_state_dict\(\)"):
                getattr(piece, name)
    with pytest.raises(AttributeError, match=r"no attribute 'nothing_such'$"):
        p.nothing_such  # noqa: B018
