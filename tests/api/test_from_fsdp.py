"""Coming from torch's FSDP: its auto-wrap policies select units unchanged.

A script moving to shardwrap keeps its ``auto_wrap_policy`` (``ModuleWrapPolicy``,
``CustomPolicy``, ``transformer_auto_wrap_policy`` or ``size_based_auto_wrap_policy`` bound with
``functools.partial``, a set of block classes) and passes it as ``auto_wrap``. Each case checks
the units it makes on ``tests.support.models.GPT`` (module names worked out by hand from each
policy's documented rule), then two of them train in parity with the plain model at 2 ranks
(SGD, every parameter within 1e-5). A policy giving a module options of its own is refused.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/api/test_from_fsdp.py -q``
"""

from __future__ import annotations

import functools

import pytest
from torch import nn
from torch.distributed.fsdp.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

from shardwrap import ShardedModule
from tests.support.models import Block, CausalSelfAttention
from tests.support.parity import GPT_BATCHES, assert_parity, build_gpt, gpt_loss, sgd

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


@pytest.mark.parametrize("name", ["transformer", "size-based"])
def test_a_model_wrapped_by_an_fsdp_policy_trains_like_the_plain_model(name: str) -> None:
    assert_parity(build_gpt(True), 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=POLICIES[name][0])


def test_a_policy_giving_a_module_options_of_its_own_is_refused_naming_it() -> None:
    policy = CustomPolicy(
        lambda m: {"reshard_after_forward": False} if isinstance(m, Block) else False
    )
    with pytest.raises(ValueError) as error:
        ShardedModule(build_gpt(False), auto_wrap=policy)
    message = str(error.value)
    assert "gives blocks.0 (Block) options of its own (reshard_after_forward)" in message
    assert "return True for the modules to wrap" in message
