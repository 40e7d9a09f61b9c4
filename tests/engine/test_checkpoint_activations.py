"""Activation checkpointing and ``torch.compile`` of units, and of the wrapped model.

Checkpointed units recompute their forward in backward; the recomputation must reuse the
all-gather backward already did (no second gather of a gathered unit), with training parity;
so must a part of a unit checkpointed by hand (a block's MLP; selectively too), whose recomputation
runs outside the unit's forward.
Compiled units run their ``forward`` as compiled graphs with no sharding hook inside, without
recompiling from step to step although every gather makes new parameter tensors.
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from shardwrap import MixedPrecision, ShardedModule
from tests.support.models import GPT, Block, make_batch
from tests.support.parity import (
    GPT_BATCHES,
    assert_parity,
    gpt_loss,
    sgd,
    train_recipe,
    train_reference,
    train_steps,
)
from tests.support.ranks import run_ranks

STEPS = len(GPT_BATCHES)


def _gpt() -> GPT:
    torch.manual_seed(0)
    return GPT(tied=True)


class CheckpointingGPT(GPT):
    """A GPT whose forward checkpoints each block call itself, as users do by hand."""

    def forward(self, idx: Tensor, targets: Tensor | None = None) -> Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.lm_head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective checkpoint's policy: keep matmul outputs, recompute the rest."""
    return (
        CheckpointPolicy.MUST_SAVE
        if op == torch.ops.aten.mm.default
        else CheckpointPolicy.PREFER_RECOMPUTE
    )


class MLPCheckpointingBlock(Block):
    """A block that checkpoints only its MLP, by hand: a part of a unit recomputed in backward."""

    how = "non-reentrant"

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        h = self.ln_2(x)
        if self.how == "selective":
            contexts = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
            return x + checkpoint(self.mlp, h, use_reentrant=False, context_fn=contexts)
        return x + checkpoint(self.mlp, h, use_reentrant=self.how == "reentrant")


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    module.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def _gathers_and_block_runs(
    model: nn.Module, world_size: int, **wrap: Any
) -> list[tuple[int, float]]:
    """Per rank: all-gathers in the last step, and runs of block 0's first MLP layer per step.

    (Recomputation stops once it has what backward needs, so only the block's early layers
    are sure to run again.)
    """

    def fn(rank: int, pg: ProcessGroup) -> tuple[int, float]:
        sharded = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block, **wrap)
        calls = _count_calls(sharded.blocks[0].mlp[0])
        optimizer = sgd(sharded.parameters())
        for inputs, targets in GPT_BATCHES:
            sharded.comm_stats.reset()
            x, y = inputs.chunk(world_size)[rank], targets.chunk(world_size)[rank]
            gpt_loss(sharded, x, y).backward()
            optimizer.step()
            optimizer.zero_grad()
        return sharded.comm_stats.calls["all_gather"], calls[0] / STEPS

    return run_ranks(world_size, fn)


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("policy", [True, Block, lambda m: isinstance(m, Block)])
def test_checkpointed_units_train_like_the_plain_model(world_size: int, policy: Any) -> None:
    assert_parity(
        _gpt(),
        world_size,
        sgd,
        GPT_BATCHES,
        gpt_loss,
        auto_wrap=Block,
        checkpoint_activations=policy,
    )


def test_recomputation_reuses_the_backward_gather() -> None:
    model = _gpt()
    plain = _gathers_and_block_runs(model, 2)
    checkpointed = _gathers_and_block_runs(model, 2, checkpoint_activations=True)
    for (gathers, runs), (ck_gathers, ck_runs) in zip(plain, checkpointed):
        assert (runs, ck_runs) == (1, 2)  # forward, and forward plus recomputation
        assert ck_gathers == gathers


def test_checkpointing_by_hand_inside_the_model_reuses_the_backward_gather() -> None:
    torch.manual_seed(0)
    model = CheckpointingGPT(tied=True)
    assert_parity(model, 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block)
    plain = GPT(tied=True)
    plain.load_state_dict(model.state_dict())
    for (gathers, runs), (ck_gathers, ck_runs) in zip(
        _gathers_and_block_runs(plain, 2), _gathers_and_block_runs(model, 2)
    ):
        assert (runs, ck_runs) == (1, 2)
        assert ck_gathers == gathers


@pytest.mark.parametrize("how", ["non-reentrant", "reentrant", "selective"])
def test_checkpointing_a_part_of_a_unit_by_hand_trains_like_the_plain_model(how: str) -> None:
    """The recomputed MLP reads its unit's parameters in backward, outside the unit's forward:
    a non-reentrant checkpoint finds the same tensors saved as in forward (it counts them), a
    selective one replays the same ops (it refuses any other), and both reuse the backward
    gather."""
    torch.manual_seed(0)
    model = GPT(tied=True)
    plain = copy.deepcopy(model)
    for block in model.blocks:
        block.__class__ = MLPCheckpointingBlock
        block.how = how
    assert_parity(model, 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block)
    if how == "reentrant":  # its own backward over the recomputed MLP releases the unit
        return
    for (gathers, runs), (ck_gathers, ck_runs) in zip(
        _gathers_and_block_runs(plain, 2), _gathers_and_block_runs(model, 2)
    ):
        assert (runs, ck_runs) == (1, 2)
        assert ck_gathers == gathers


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` given one tensor as query, key and value: its packed
    projection, which it takes only where the three are one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        y = self.embed(x)  # requires grad, as every activation
        return self.head(self.attn(y, y, y, need_weights=False)[0])


def _attention_batches() -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 5, 6, generator=g), torch.randn(4, 5, 3, generator=g)) for _ in range(3)
    ]


def test_a_checkpointed_unit_given_one_tensor_thrice_trains_like_the_plain_model() -> None:
    """``checkpoint_activations`` on a ``MultiheadAttention`` unit called as ``attn(y, y, y)``:
    the checkpoint gets ``y`` back as three tensors in the recomputation (torch does so under
    any saved-tensor hooks, and shardwrap's are entered around every forward), so attention
    took its separate projections instead of the packed one and torch's checkpoint raised
    ``CheckpointError`` in backward, at every stage. Each tensor now goes into the checkpoint
    once."""
    torch.manual_seed(0)
    assert_parity(
        SelfAttention(),
        2,
        sgd,
        _attention_batches(),
        lambda m, x, y: (m(x) - y).pow(2).mean(),
        auto_wrap=nn.MultiheadAttention,
        checkpoint_activations=True,
    )


@pytest.mark.parametrize(
    "wrap",
    [{"checkpoint_activations": True}, {"compile": {"backend": "aot_eager"}}],
    ids=["checkpointed", "compiled"],
)
def test_bf16_follows_the_mixed_precision_recipe(wrap: dict[str, Any]) -> None:
    torch._dynamo.reset()
    model = _gpt()
    ref_losses, ref_state = train_recipe(model, 2, torch.bfloat16)

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        sharded = ShardedModule(
            copy.deepcopy(model),
            process_group=pg,
            auto_wrap=Block,
            mixed_precision=MixedPrecision(),
            **wrap,
        )
        optimizer = sgd(sharded.parameters())
        for inputs, targets in [make_batch(seed=step, batch=8) for step in range(4)]:
            sharded(inputs.chunk(2)[rank], targets.chunk(2)[rank]).backward()
            optimizer.step()
            optimizer.zero_grad()
        return sharded.full_state_dict()

    for state in run_ranks(2, fn):
        torch.testing.assert_close(state, ref_state, atol=1e-5, rtol=0)


def test_checkpoint_policy_errors() -> None:
    with pytest.raises(ValueError, match="selects none of the units"):
        ShardedModule(_gpt(), auto_wrap=Block, checkpoint_activations=nn.LayerNorm)
    with pytest.raises(TypeError, match=r"checkpoint_activations got 'yes'.*\(or True, to"):
        ShardedModule(_gpt(), auto_wrap=Block, checkpoint_activations="yes")
    with pytest.raises(TypeError, match="compile takes True, False or a dict"):
        ShardedModule(_gpt(), auto_wrap=Block, compile="max-autotune")


# torch.compile -----------------------------------------------------------------------


class GraphRecorder:
    """A torch.compile backend that runs each graph eagerly and keeps it for inspection."""

    def __init__(self) -> None:
        self.graphs: list[torch.fx.GraphModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Tensor]) -> Any:
        self.graphs.append(gm)
        return gm.forward


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "checkpointed"])
def test_compiled_units_train_like_the_plain_model_with_hooks_outside_the_graphs(
    checkpoint: bool,
) -> None:
    torch._dynamo.reset()
    recorder = GraphRecorder()
    compiled_after: list[int] = []  # graphs compiled so far, after each step's forward

    def loss_fn(model: nn.Module, inputs: Tensor, targets: Tensor) -> Tensor:
        loss = gpt_loss(model, inputs, targets)
        compiled_after.append(len(recorder.graphs))
        return loss

    assert_parity(
        _gpt(),
        1,
        sgd,
        GPT_BATCHES,
        loss_fn,
        auto_wrap=Block,
        compile={"backend": recorder},
        checkpoint_activations=checkpoint,
    )
    sharded_steps = compiled_after[STEPS:]  # the reference ran first
    assert sharded_steps[0] >= 1 and set(sharded_steps) == {sharded_steps[0]}  # no recompiles
    for gm in recorder.graphs:
        calls = {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
        assert not any("shardwrap" in t or "distributed" in t for t in calls), calls
        assert any("linear" in t for t in calls)


def test_compiled_units_at_world_size_2() -> None:
    torch._dynamo.reset()
    assert_parity(
        _gpt(), 2, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block, compile={"backend": "eager"}
    )


def test_torch_compile_of_the_wrapped_model_trains_like_the_plain_model() -> None:
    """``model = torch.compile(model)`` after wrapping: dynamo skips every sharding hook (the
    graph breaks there and the hook runs eagerly) and compiles the code between them; four
    steps match the plain model's (before: an internal dynamo error naming
    ``ProcessGroup.allreduce``). No graph holds a collective or a shardwrap call. At world size
    1: dynamo is not thread-safe, so ranks as threads cannot compile side by side (2 ranks:
    ``tests/e2e/test_torchrun.py``, case ``2-torch-compile``)."""
    torch._dynamo.reset()
    recorder = GraphRecorder()
    ref = train_reference(_gpt(), sgd, GPT_BATCHES, gpt_loss)
    m = ShardedModule(_gpt(), auto_wrap=Block)
    losses = train_steps(torch.compile(m, backend=recorder), 0, 1, None, sgd, GPT_BATCHES, gpt_loss)
    torch.testing.assert_close(losses, ref.losses, atol=1e-5, rtol=0)
    torch.testing.assert_close(m.full_state_dict(), ref.state, atol=1e-5, rtol=0)
    calls = [
        {str(n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")}
        for gm in recorder.graphs
    ]
    assert any("linear" in t for c in calls for t in c)
    assert not any("shardwrap" in t or "distributed" in t for c in calls for t in c)
