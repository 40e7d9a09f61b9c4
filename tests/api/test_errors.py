"""Bad input gets a clear error, never a hang.

Each case checks the exception type and that its message names the problem and the fix.
Checks that need no communication run on rank 0 of two while rank 1 does nothing: an error
raised before any collective comes back at once, one raised after a collective would time
out instead. Models that differ across ranks make every rank raise, naming the first
differing parameter, within a short timeout.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_errors.py -q``
"""

from __future__ import annotations

import copy
import inspect
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.testing._internal.two_tensor import TwoTensor

from shardwrap import Mesh, MixedPrecision, Offload, ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.parity import fp32_grads
from tests.support.ranks import run_ranks

TIMEOUT = 6.0  # seconds: a collective that cannot complete fails after half of it

Group = ProcessGroup | None


def _gpt(width: int = 36) -> GPT:
    torch.manual_seed(0)
    return GPT(width=width)


def _error_on_rank0(
    world_size: int,
    exc: type[Exception],
    call: Callable[[Any, Group], object],
    prepare: Callable[[Group], Any],
) -> str:
    """``prepare(group)`` on every rank, then ``call(prepared, group)`` on rank 0 alone.

    Returns the message of the ``exc`` that ``call`` must raise. World size 1 runs without a
    process group.
    """

    def fn(rank: int, pg: ProcessGroup) -> str:
        group = pg if world_size > 1 else None
        prepared = prepare(group)
        if rank > 0:
            return ""
        with pytest.raises(exc) as info:
            call(prepared, group)
        return str(info.value)

    return run_ranks(world_size, fn, timeout=TIMEOUT)[0]


def _copy_of(model: nn.Module) -> Callable[[Group], nn.Module]:
    return lambda group: copy.deepcopy(model)


# wrapping twice ----------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("auto_wrap", [Block, None])
def test_wrapping_a_wrapped_model_again(world_size: int, auto_wrap: Any) -> None:
    model = _gpt()
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, auto_wrap=Block, process_group=group),
        lambda group: ShardedModule(copy.deepcopy(model), auto_wrap=auto_wrap, process_group=group),
    )
    assert "already wrapped" in message and "Wrap once" in message


@pytest.mark.parametrize("world_size", [1, 2])
def test_wrapping_a_model_whose_submodule_is_wrapped(world_size: int) -> None:
    model = _gpt()

    def wrap_block(group: Group) -> nn.Module:
        m = copy.deepcopy(model)
        ShardedModule(m.blocks[1], process_group=group)
        return m

    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, auto_wrap=Block, process_group=group),
        wrap_block,
    )
    assert "'blocks.1'" in message and "already wrapped" in message
    assert "auto_wrap" in message  # the fix: wrap once at the top, select blocks by policy


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("auto_wrap", [Block, None])
def test_wrapping_a_submodule_of_a_wrapped_model(world_size: int, auto_wrap: Any) -> None:
    """``blocks.1`` is a unit with ``auto_wrap=Block``, and plain shards of the root without."""
    model = _gpt()
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m.blocks[1], process_group=group),
        lambda group: ShardedModule(copy.deepcopy(model), auto_wrap=auto_wrap, process_group=group),
    )
    assert "already wrapped" in message and "Wrap once" in message


# parameters with a layout of their own --------------------------------------------------


def _subclassed(kind: str) -> nn.Module:
    if kind == "NF4Tensor":  # a frozen base weight quantized as QLoRA does (torchao's)
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        model = nn.Sequential(nn.Linear(128, 128, bias=False), nn.Linear(128, 128))
        model[0].weight = nn.Parameter(to_nf4(model[0].weight.detach()), requires_grad=False)
        return model
    if kind == "Params4bit":  # bitsandbytes' 4-bit layer, as QLoRA loads a base model
        import bitsandbytes

        return nn.Sequential(bitsandbytes.nn.Linear4bit(64, 64, bias=False), nn.Linear(64, 64))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    w = model[1].weight.detach()
    model[1].weight = nn.Parameter(TwoTensor(w, 2 * w))  # computes two models at once
    return model


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["TwoTensor", "NF4Tensor", "Params4bit"])
def test_a_parameter_with_a_layout_of_its_own_is_refused_naming_it(
    kind: str, world_size: int
) -> None:
    """Before, a TwoTensor weight was flattened into a plain one (the wrapped model computed
    one of its two results without a word), an NF4 weight crashed inside torchao's dispatch
    while the ranks compared weights, and a bitsandbytes 4-bit weight failed in autograd."""
    model = _subclassed(kind)
    name = "1.weight" if kind == "TwoTensor" else "0.weight"

    def fn(rank: int, pg: ProcessGroup | None) -> None:
        with pytest.raises(TypeError) as raised:
            ShardedModule(copy.deepcopy(model), process_group=pg)
        message = str(raised.value)
        assert message.startswith(f"ShardedModule: parameter '{name}' is a ")
        assert f".{kind}, a tensor with a layout of its own" in message
        assert "Give the model plain parameters before wrapping" in message

    if world_size == 1:
        fn(0, None)
    else:
        run_ranks(world_size, fn, timeout=30)


def test_a_lazy_module_not_yet_run_is_refused_naming_the_fix() -> None:
    """A lazy module's parameters have no shape before its first forward: wrapping failed in
    torch's ``numel`` of an uninitialized parameter. Now refused naming the tensor and the fix,
    before any collective; after one forward it wraps and trains."""
    m = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"'0\.weight' is uninitialized .*before wrapping"):
        ShardedModule(m)
    m(torch.randn(3, 5))
    ShardedModule(m)(torch.randn(3, 5)).sum().backward()


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", [nn.Embedding, nn.EmbeddingBag])
def test_an_embedding_that_renormalises_its_weight_in_forward_is_refused(
    kind: type[nn.Module], world_size: int
) -> None:
    """``max_norm`` makes the embedding's forward write renormalised rows into its weight: in a
    unit that is the gathered copy, which autograd refused to let change ("Output 0 of
    _FullParams is a view and its base ... has been modified inplace") at the first forward,
    naming neither the module nor a fix. Now refused before any collective."""
    torch.manual_seed(0)
    model = nn.Sequential(kind(20, 8, max_norm=1.5), nn.Linear(8, 3))
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, process_group=group),
        _copy_of(model),
    )
    assert message.startswith(f"ShardedModule: submodule '0' is an nn.{kind.__name__} with ")
    assert "max_norm=1.5" in message and "Build it with max_norm=None" in message
    assert "with model.gathered(writeback=True): w = model.get_submodule('0').weight; " in message
    assert "w.copy_(torch.renorm(w, 2.0, 0, 1.5))" in message


class _Aliased(nn.Module):
    """A linear layer with a buffer or a second parameter over its weight's memory."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        if kind == "buffer":
            self.register_buffer("weight_seen", self.lin.weight.data)
        elif kind == "parameter":
            self.first_rows = nn.Parameter(self.lin.weight.data[:2])
        else:  # the same parameter under two names, and two parameters of one flat storage
            self.tied = nn.Linear(8, 8)
            self.tied.weight = self.lin.weight
            flat = torch.zeros(16)
            self.front, self.back = nn.Parameter(flat[:8]), nn.Parameter(flat[8:])


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("kind", ["buffer", "parameter"])
def test_a_tensor_sharing_a_parameters_memory_is_refused(world_size: int, kind: str) -> None:
    """A buffer registered as ``weight.data``, or a parameter made of a slice of another's data,
    changes with the parameter on the plain model. Wrapping moved the parameter into its flat
    shard and the other stayed: the buffer kept its values and the parameters trained apart,
    silently. Now refused before any collective, naming both and the fix; a parameter tied by
    assignment, and parameters that are disjoint parts of one storage, are taken."""
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, process_group=group),
        lambda group: nn.Sequential(_Aliased(kind), nn.Linear(8, 2)),  # a copy would not alias
    )
    other = "'0.weight_seen'" if kind == "buffer" else "'0.first_rows'"
    assert " shares memory with parameter " in message and "(one views the other's data)" in message
    assert other in message and "'0.lin.weight'" in message
    assert "assigning the same nn.Parameter" in message
    taken = ShardedModule(nn.Sequential(_Aliased("tied"), nn.Linear(8, 2)))
    assert set(taken.full_state_dict()) == {
        *("0.front", "0.back", "0.lin.weight", "0.lin.bias", "0.tied.weight", "0.tied.bias"),
        *("1.weight", "1.bias"),
    }


# auto_wrap ---------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize(
    "auto_wrap",
    ["Block", True, [Block, "Block"], (Block, int), (Block, "Block"), {"blocks": Block}],
    ids=["str", "bool", "list-with-str", "tuple-with-int", "tuple-with-str", "dict"],
)
def test_auto_wrap_of_the_wrong_type(world_size: int, auto_wrap: object) -> None:
    message = _error_on_rank0(
        world_size,
        TypeError,
        lambda m, group: ShardedModule(m, auto_wrap=auto_wrap, process_group=group),
        _copy_of(_gpt()),
    )
    assert f"auto_wrap got {auto_wrap!r}" in message
    assert "a module class" in message and "a tuple of module classes" in message
    assert "auto_wrap=TransformerBlock" in message


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("value", ["yes", 8, 1])
def test_reshard_after_forward_of_another_type(world_size: int, value: object) -> None:
    """A string or an int (FSDP2's reshard to a smaller group) is refused before any collective
    (before: taken as true)."""
    message = _error_on_rank0(
        world_size,
        TypeError,
        lambda m, group: ShardedModule(
            m, auto_wrap=Block, process_group=group, reshard_after_forward=value
        ),
        _copy_of(_gpt()),
    )
    assert f"reshard_after_forward={value!r}: True, False or None" in message
    assert "no counterpart" in message


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("auto_wrap", [0, -3])
def test_auto_wrap_parameter_count_below_one(world_size: int, auto_wrap: int) -> None:
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, auto_wrap=auto_wrap, process_group=group),
        _copy_of(_gpt()),
    )
    assert "auto_wrap" in message and "parameter count" in message
    assert "at least 1" in message and f"got {auto_wrap}" in message


@pytest.mark.parametrize("world_size", [1, 2])
def test_auto_wrap_given_a_module_instance_instead_of_its_class(world_size: int) -> None:
    """Modules are callable, so an instance must not pass for a ``(module) -> bool`` policy."""
    model = _gpt()
    message = _error_on_rank0(
        world_size,
        TypeError,
        lambda m, group: ShardedModule(m, auto_wrap=m.blocks[0], process_group=group),
        _copy_of(model),
    )
    assert "auto_wrap" in message and "Block" in message and "class" in message


# devices -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
def test_parameters_on_several_devices(world_size: int) -> None:
    model = _gpt()
    model.lm_head.weight = nn.Parameter(torch.empty(67, 36, device="meta"))
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, auto_wrap=Block, process_group=group),
        _copy_of(model),
    )
    assert "several devices" in message
    assert "'wte.weight' on cpu" in message and "'lm_head.weight' on meta" in message
    assert "one device" in message and "model.to(" in message


@pytest.mark.parametrize("world_size", [1, 2])
def test_meta_buffer_with_materialised_parameters(world_size: int) -> None:
    """A model built on meta is materialised (tests/engine/test_meta_init.py); half of one is
    refused."""
    model = _gpt()
    model.register_buffer("mask", torch.empty(16, 16, device="meta"))
    message = _error_on_rank0(
        world_size,
        ValueError,
        lambda m, group: ShardedModule(m, auto_wrap=Block, process_group=group),
        _copy_of(model),
    )
    assert "buffer 'mask' is on the meta device but the parameters are not" in message
    assert "torch.device('meta')" in message


# models that differ across ranks -----------------------------------------------------


@pytest.mark.parametrize("world_size", [2, 4])
def test_parameter_shapes_differ_across_ranks(world_size: int) -> None:
    """The last rank builds a wider model: every rank names the first differing parameter."""
    narrow, wide = _gpt(width=36), _gpt(width=39)

    def fn(rank: int, pg: ProcessGroup) -> str:
        model = copy.deepcopy(wide if rank == world_size - 1 else narrow)
        with pytest.raises(ValueError) as info:
            ShardedModule(model, auto_wrap=Block, process_group=pg)
        return str(info.value)

    for rank, message in enumerate(run_ranks(world_size, fn, timeout=TIMEOUT)):
        width = 39 if rank == world_size - 1 else 36
        assert f"parameter #0 'wte.weight' with shape (67, {width})" in message
        assert "differs across ranks" in message and "same model on every rank" in message


@pytest.mark.parametrize("world_size", [2, 4])
def test_extra_parameter_on_one_rank(world_size: int) -> None:
    """Rank 0 has one parameter more, last in order: the others name its position."""
    model = _gpt()
    count = len(list(model.parameters()))
    extra = copy.deepcopy(model)
    extra.lm_head.register_parameter("scale", nn.Parameter(torch.ones(3)))

    def fn(rank: int, pg: ProcessGroup) -> str:
        with pytest.raises(ValueError) as info:
            ShardedModule(
                copy.deepcopy(extra if rank == 0 else model), auto_wrap=Block, process_group=pg
            )
        return str(info.value)

    messages = run_ranks(world_size, fn, timeout=TIMEOUT)
    assert f"parameter #{count} 'lm_head.scale'" in messages[0]
    for message in messages[1:]:
        assert f"has only {count} parameters and buffers" in message
    for message in messages:
        assert "differs across ranks" in message and "same model on every rank" in message


@pytest.mark.parametrize(
    ("change", "shown"),
    [
        ("shape", "buffer #0 'table' with shape (3,), dtype torch.float32"),
        ("dtype", "buffer #0 'table' with shape (4,), dtype torch.float64"),
        ("missing", "only"),
        ("requires_grad", "and requires_grad=False"),
    ],
)
def test_buffers_or_frozen_parameters_that_differ_across_ranks_are_named(
    change: str, shown: str
) -> None:
    """A buffer of another shape, dtype or only on one rank, or a parameter frozen on one rank
    only: every rank raises naming it, before any value is compared or copied (before, a
    buffer only one rank had aborted the process inside gloo, one of another length was left
    half overwritten with a warning saying rank 0's values were copied, and a frozen parameter
    was named by its shape and dtype, which agreed)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = copy.deepcopy(model)
        odd = rank == 1
        if change == "shape":
            m.register_buffer("table", torch.arange(4.0 if odd else 3.0))
        elif change == "dtype":
            m.register_buffer("table", torch.ones(4, dtype=torch.float64 if odd else None))
        elif change == "missing" and odd:
            m.register_buffer("table", torch.zeros(3))
        elif change == "requires_grad" and odd:
            m[0].weight.requires_grad_(False)
        with pytest.raises(ValueError, match="the model differs across ranks") as info:
            ShardedModule(m, process_group=pg)
        return str(info.value)

    messages = run_ranks(2, fn, timeout=TIMEOUT)
    assert shown in messages[0] or shown in messages[1], messages


def test_the_meta_device_as_where_shards_live_is_refused() -> None:
    with pytest.raises(ValueError, match=r"device='meta' would keep the shards on no device"):
        ShardedModule(_gpt(), auto_wrap=Block, device="meta")


# arguments that differ across ranks --------------------------------------------------


def _messages_when_ranks_pass(world_size: int, arguments: Callable[[int], dict]) -> list[str]:
    """Every rank wraps a copy of one model with ``arguments(rank)``; each must raise."""
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> str:
        with pytest.raises(ValueError) as info:
            ShardedModule(copy.deepcopy(model), process_group=pg, **arguments(rank))
        return str(info.value)

    return run_ranks(world_size, fn, timeout=TIMEOUT)


BF16 = MixedPrecision(param_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("option", "values", "shown"),
    [
        ("auto_wrap", (Block, None), ("tests.support.models.Block", "None")),
        (
            "mixed_precision",
            (BF16, None),
            ("MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32", "None"),
        ),
        ("checkpoint_activations", (True, False), ("True", "False")),
        ("compile", ({"mode": "max-autotune"}, False), ("{mode: max-autotune}", "None")),
        ("sync_module_states", (True, None), ("True", "None")),
        ("offload", (Offload(device="cpu"), None), ("Offload(device='cpu')", "None")),
        ("bucket_mb", (4, 0), ("4", "0")),
    ],
)
def test_an_argument_that_differs_across_ranks_is_named_on_every_rank(
    option: str, values: tuple, shown: tuple[str, str]
) -> None:
    """Named with each rank's value at wrap time, before any flat buffer is communicated
    (auto_wrap and mixed_precision ended in a gloo abort in the first forward before)."""
    arguments = {"auto_wrap": Block}
    messages = _messages_when_ranks_pass(2, lambda rank: {**arguments, option: values[rank]})
    for rank, message in enumerate(messages):
        assert f"ranks passed different arguments (this is rank {rank} of 2)" in message
        line = next(x for x in message.splitlines() if x.startswith(f"  {option}: "))
        assert f"{shown[0]}" in line and line.endswith(f"{shown[1]} on rank 1"), line
        assert "Pass the same arguments on every rank." in message


def test_reshard_after_forward_that_differs_across_ranks_is_named() -> None:
    messages = _messages_when_ranks_pass(
        2, lambda rank: {"auto_wrap": Block, "stage": 3, "reshard_after_forward": rank == 0}
    )
    for message in messages:
        assert "\n  reshard_after_forward: True on rank 0; False on rank 1\n" in message


def test_auto_wrap_that_differs_names_the_units_each_rank_makes() -> None:
    messages = _messages_when_ranks_pass(2, lambda rank: {"auto_wrap": Block if rank else None})
    for message in messages:
        assert "\n  auto_wrap: None on rank 0; tests.support.models.Block on rank 1\n" in message
        assert (
            "\n  auto_wrap (the units it makes): 1 unit, first differing none on rank 0; "
            "4 units, first differing #1 blocks.0: float32 trainable " in message
        )


def test_a_grad_dtype_set_on_one_rank_only_is_named_by_the_units_each_rank_makes() -> None:
    """Rank 1's parameters keep float32 gradients (``grad_dtype``), rank 0's their own dtype:
    their gradient buffers would differ, so wrapping refuses on both, before any collective."""
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> str:
        local = copy.deepcopy(model).to(torch.bfloat16)
        if rank == 1:
            fp32_grads(local)
        with pytest.raises(ValueError) as info:
            ShardedModule(local, process_group=pg, auto_wrap=Block)
        return str(info.value)

    for message in run_ranks(2, fn, timeout=TIMEOUT):
        line = next(x for x in message.splitlines() if "(the units it makes)" in x)
        assert re.search(
            r"#0 \(root\): bfloat16 trainable (\d+) on rank 0; .*"
            r"#0 \(root\): bfloat16 trainable \(float32 gradients\) \1 on rank 1$",
            line,
        ), line


@pytest.mark.parametrize("change", ["scaled", "replaced"])
def test_a_grad_changed_between_no_sync_backwards_is_refused_naming_it(change: str) -> None:
    """After a backward under ``no_sync()`` this rank's accumulated gradients are unreduced,
    outside ``.grad``: a ``.grad`` scaled in place or replaced then cannot be followed, so the
    next backward raises on every rank, naming the parameter, instead of training on what the
    change missed (``zero_grad()`` is followed: tests/peers/test_fsdp_training.py)."""
    model = _gpt()
    x, y = make_batch(0, 4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[str, str]:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block)
        with m.no_sync():
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        name, p = next(iter(m.named_parameters()))
        if change == "scaled":
            p.grad.mul_(0.5)
        else:
            p.grad = torch.ones_like(p)
        with pytest.raises(RuntimeError) as info:
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
        return name, str(info.value)

    for name, message in run_ranks(2, fn, timeout=TIMEOUT):
        assert f"the .grad of {name} was replaced or changed in place between a backward " in (
            message
        )
        assert "only zero_grad() reaches them" in message


def test_a_policy_that_selects_differently_on_each_rank_is_caught_by_its_units() -> None:
    """Same function name on every rank, different choices: the unit plan tells them apart."""

    def arguments(rank: int) -> dict:
        def blocks(m: nn.Module) -> bool:
            return isinstance(m, Block) and (rank == 0 or m is not model_blocks[rank][-1])

        return {"auto_wrap": blocks}

    model_blocks: dict[int, list[nn.Module]] = {}
    model = _gpt()

    def fn(rank: int, pg: ProcessGroup) -> str:
        local = copy.deepcopy(model)
        model_blocks[rank] = list(local.blocks)
        with pytest.raises(ValueError) as info:
            ShardedModule(local, process_group=pg, **arguments(rank))
        return str(info.value)

    for message in run_ranks(2, fn, timeout=TIMEOUT):
        assert "\n  auto_wrap: " not in message  # the same function, by name
        line = next(x for x in message.splitlines() if "auto_wrap (the units it makes)" in x)
        assert "4 units, first differing #3 blocks.2: float32" in line
        assert "3 units, first differing none on rank 1" in line


def test_an_argument_that_differs_on_one_of_four_ranks_names_the_ranks_alike() -> None:
    messages = _messages_when_ranks_pass(
        4, lambda rank: {"auto_wrap": Block, "mixed_precision": BF16 if rank == 3 else None}
    )
    for message in messages:
        assert "\n  mixed_precision: None on ranks 0-2; MixedPrecision(param_dtype=" in message
        assert message.count(" on rank 3") == 1


# launched processes without a process group --------------------------------------------


@pytest.mark.parametrize("group", ["no group", "a default group of one"])
@pytest.mark.parametrize("variable", ["WORLD_SIZE", "LOCAL_WORLD_SIZE"])
def test_several_launched_processes_without_a_group_of_them_are_refused(
    variable: str, group: str, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Under torchrun with no init_process_group, or with init_process_group(world_size=1),
    each rank would train alone: refuse it."""
    if group != "no group":
        request.getfixturevalue("default_group_of_one")
    monkeypatch.setenv(variable, "2")
    with pytest.raises(RuntimeError) as raised:
        ShardedModule(_gpt(), auto_wrap=Block)
    message = str(raised.value)
    assert f"{variable}=2: this is one of 2 processes" in message
    assert "train its own copy" in message
    assert "dist.init_process_group(" in message and "timeout=datetime.timedelta(" in message
    assert "TrainingArguments(..., ddp_timeout=600) before wrapping" in message
    assert "process_group=shardwrap.Mesh()" in message
    if group == "no group":
        assert "torch.distributed has no process group" in message
    else:
        assert "default group holds this process alone" in message
        assert "leaving world_size and rank to the launcher's environment" in message


@pytest.mark.parametrize("size", ["1", "", "auto"])
def test_one_launched_process_without_a_process_group_is_world_size_1(
    size: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WORLD_SIZE", size)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", size)
    model = ShardedModule(_gpt(), auto_wrap=Block)
    assert model._shardwrap_root.mesh.world_size == 1


def test_one_copy_per_process_on_purpose_under_a_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = ShardedModule(_gpt(), auto_wrap=Block, process_group=Mesh())
    assert model._shardwrap_root.mesh.world_size == 1


@pytest.fixture
def default_group_of_one() -> Iterator[None]:
    """torch.distributed initialised with this process alone (``world_size=1``)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("size", ["1", "", "auto", None])
def test_one_launched_process_with_a_default_group_of_one_is_world_size_1(
    size: str | None, monkeypatch: pytest.MonkeyPatch, default_group_of_one: None
) -> None:
    for variable in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        if size is None:
            monkeypatch.delenv(variable, raising=False)
        else:
            monkeypatch.setenv(variable, size)
    model = ShardedModule(_gpt(), auto_wrap=Block)
    assert model._shardwrap_root.mesh.world_size == 1


def test_a_group_of_one_given_on_purpose_under_a_launcher(
    monkeypatch: pytest.MonkeyPatch, default_group_of_one: None
) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    model = ShardedModule(_gpt(), auto_wrap=Block, process_group=dist.new_group([0]))
    assert model._shardwrap_root.mesh.world_size == 1


# optimizer built too early -----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("optimizer", [torch.optim.AdamW, torch.optim.SGD])
def test_optimizer_built_before_wrapping(world_size: int, optimizer: type) -> None:
    model = _gpt()
    idx, targets = make_batch(0, 8)

    def fn(rank: int, pg: ProcessGroup) -> None:
        local = copy.deepcopy(model)
        too_early = optimizer(local.parameters(), lr=1e-2)
        m = ShardedModule(local, auto_wrap=Block, process_group=pg if world_size > 1 else None)
        inputs, labels = idx.chunk(world_size)[rank], targets.chunk(world_size)[rank]
        m(inputs, labels).backward()
        with pytest.raises(RuntimeError) as info:
            too_early.step()
        message = str(info.value)
        assert "'wte.weight'" in message and "from before the model was wrapped" in message
        assert "optimizer after wrapping" in message

        before = m.full_state_dict()
        optimizer(m.parameters(), lr=1e-2).step()
        after = m.full_state_dict()
        for name, value in before.items():
            assert not torch.equal(after[name], value), name

    run_ranks(world_size, fn, timeout=TIMEOUT * 5)


class _TiedAcross(nn.Module):
    """A head outside the part that gets wrapped, tied to an embedding inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 8))
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.encoder[0].weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.encoder(ids)))


def test_a_parameter_tied_across_the_wrapped_modules_boundary_is_refused_where_used() -> None:
    """Wrapping only the encoder retires the embedding the head outside still holds: the head's
    forward, its state dict and wrapping it elsewhere each raise naming the parameter and the
    fix (before: a raw size mismatch at the forward, a state dict silently holding an empty
    tensor, and a second wrap of it accepted, its weight an empty one)."""
    torch.manual_seed(0)
    model = _TiedAcross()
    ids = torch.randint(0, 16, (4, 5))

    def fn(rank: int, pg: ProcessGroup) -> None:
        lm = copy.deepcopy(model)
        lm.encoder = ShardedModule(lm.encoder, process_group=pg)
        for use, func in ((lambda: lm(ids), "linear"), (lm.state_dict, "detach")):
            with pytest.raises(RuntimeError) as info:
                use()
            message = str(info.value)
            assert "parameter '0.weight' was moved into a ShardedModule" in message
            assert f"{func} used it here" in message and "holds every use of it" in message
        assert "Linear" in repr(lm.head)  # reading what it is still works
        with pytest.raises(ValueError, match=r"'0\.weight' was moved into another ShardedModule"):
            ShardedModule(nn.Sequential(lm.head), process_group=pg)

    run_ranks(2, fn, timeout=TIMEOUT)


def test_auto_wrap_selecting_a_container_that_is_never_called() -> None:
    """A ModuleList is iterated, never called: as a unit it could never be gathered."""
    with pytest.raises(ValueError, match=r"'blocks' \(ModuleList\).*never called.*block class"):
        ShardedModule(GPT(), auto_wrap=nn.ModuleList)


def test_parameter_count_policy_skips_containers() -> None:
    """A threshold that the block list reaches but no single block does selects no container."""
    model = GPT()
    reference = copy.deepcopy(model)
    sharded = ShardedModule(model, auto_wrap=3000)
    assert all(not isinstance(u.module, nn.ModuleList) for u in sharded._shardwrap_root.units)
    idx, targets = make_batch(0, 2)
    assert sharded(idx, targets).item() == pytest.approx(reference(idx, targets).item(), abs=1e-6)


@pytest.mark.parametrize(
    "auto_wrap",
    [nn.Conv2d, (nn.Conv1d, nn.GRU), lambda m: False, 10**9, set(), ()],
    ids=["class", "classes", "callable", "count", "empty-set", "empty-tuple"],
)
def test_auto_wrap_that_selects_nothing_names_the_classes_the_model_has(auto_wrap: Any) -> None:
    """Wrapping the whole model as one unit by accident would save no memory: refuse it. An
    empty set of classes (a ``transformers`` model's ``_no_split_modules`` that lists none) is
    such a policy too: before, a ``TypeError`` said sets are taken, not that this one is empty."""
    with pytest.raises(ValueError, match="selects no submodule of GPT") as raised:
        ShardedModule(GPT(), auto_wrap=auto_wrap)
    message = str(raised.value)
    assert "Block (x3)" in message and "Linear (x13)" in message
    assert "auto_wrap=None to make it one unit on purpose" in message
    ShardedModule(GPT(), auto_wrap=None)  # on purpose: fine


def test_tracing_scripting_and_exporting_are_refused_and_introspection_works() -> None:
    """``torch.jit.trace`` and ``torch.jit.script`` raised the error meant for
    ``DistributedDataParallel(model)`` (their scan of the model's attributes, as
    ``inspect.getmembers``, read the attribute DDP reads), and ``torch.export`` failed inside
    the forward's handshake. Each is now refused on every rank before any collective, naming
    what to trace instead; attribute scans find no DDP attribute, and the model trains on."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    x = torch.randn(4, 4)

    def fn(rank: int, pg: ProcessGroup) -> list[str]:
        m = ShardedModule(copy.deepcopy(base), process_group=pg)
        assert not hasattr(m, "_ddp_params_and_buffers_to_ignore")
        assert any(name == "forward" for name, _ in inspect.getmembers(m))
        said = []
        for call in (lambda: torch.jit.trace(m, (x,)), lambda: torch.jit.script(m)):
            with pytest.raises(TypeError, match="full_state_dict") as refused:
                call()
            said.append(str(refused.value).split(":")[0])
        m(x.chunk(2)[rank]).sum().backward()
        return said

    refused = "torch.jit.trace, torch.jit.script and torch.export of a sharded model are not "
    for said in run_ranks(2, fn, timeout=30):
        assert said == [refused + "supported"] * 2
    # export's tracing state is the process's, so one rank (world size 1, the same code path)
    m = ShardedModule(copy.deepcopy(base))
    with pytest.raises(TypeError, match="torch.export of a sharded model .*full_state_dict"):
        torch.export.export(m, (x,))
    m(x).sum().backward()


def test_a_cast_that_would_change_only_buffers_is_refused_with_nothing_changed() -> None:
    """``model.float()`` of a float32 model holding float64 and bfloat16 buffers: the
    parameters need no cast, so it was taken as a no-op, and the buffers stayed float64 and
    bfloat16 where the plain model casts them (its output float64 where the plain model's is
    float32). It now raises naming the buffer, before anything changes; a cast that changes
    nothing (``.float()`` of an all-float32 model, ``.to("cpu")``) is still a no-op."""

    class WithBuffers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("scale", torch.ones(4, dtype=torch.float64))

        def forward(self, x: Tensor) -> Tensor:
            return self.lin(x) * self.scale

    m = ShardedModule(WithBuffers())
    with pytest.raises(ValueError, match=r"buffer 'scale' \(torch.float64, cpu\) to torch.float32"):
        m.float()
    assert m.scale.dtype == torch.float64
    plain = ShardedModule(nn.Linear(4, 4))
    assert plain.float() is plain and plain.to("cpu") is plain
