"""Meta-device initialisation: a model built on ``meta`` is materialised unit by unit, correctly.

What it proves, each at world sizes 1, 2 or 4 with ranks as threads:

- one seed gives the same full parameters on every rank and at every world size;
- constant initialisations (LayerNorm, BatchNorm statistics, the biases that
  ``nn.MultiheadAttention`` zeroes in its children, also across units) equal plain
  construction exactly, and random ones follow the same distributions;
- ``param_init_fn`` replaces ``reset_parameters()`` and runs children first;
- a meta-initialised model trains exactly like a plain model loaded with its weights (SGD,
  parameters within 1e-5);
- while materialising, a rank holds its shards plus one unit's full parameters, never the
  whole model (every allocation tracked);
- a tensor no initialiser writes raises ``ValueError`` on every rank, naming it;
- Hugging Face GPT-2 and Llama initialise through ``param_init_fn=model._init_weights``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_meta_init.py -q``
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from tests.support.memory import StorageTracker
from tests.support.models import GPT, Block, tiny_gpt2_config, tiny_llama_config
from tests.support.parity import (
    GPT_BATCHES,
    HF_BATCHES,
    STEPS,
    fp32_grads,
    gpt_loss,
    hf_loss,
    sgd,
    train_reference,
    train_steps,
)
from tests.support.ranks import run_ranks

SEED = 1234
TIMEOUT = 20.0


class Mixed(nn.Module):
    """Linear layers, ``nn.MultiheadAttention`` (its ``_reset_parameters`` zeroes a child's bias),
    LayerNorm and BatchNorm (integer buffer ``num_batches_tracked``).

    ``forward(x)`` maps ``(B, T, 7)`` floats to ``(B, classes)`` logits.
    """

    def __init__(self, width: int = 12, heads: int = 3, classes: int = 5) -> None:
        super().__init__()
        self.proj_in = nn.Linear(7, width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm = nn.LayerNorm(width)
        self.bn = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, 7)
        h = self.proj_in(x)
        h = h + self.attn(h, h, h, need_weights=False)[0]
        return self.head(self.bn(self.norm(h).mean(1)))


class Scale(nn.Module):
    """A learned per-channel gain with no ``reset_parameters()``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gain


class Positions(nn.Module):
    """An integer buffer computed in ``__init__``, which the meta device cannot hold."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.register_buffer("order", torch.arange(n), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.order


def on_meta(build: Callable[[], nn.Module]) -> nn.Module:
    with torch.device("meta"):
        return build()


def full_state(model: nn.Module, rank: int, pg: ProcessGroup | None) -> dict[str, Tensor]:
    return model.full_state_dict()


def wrap_on_ranks(
    meta_model: nn.Module,
    world_size: int,
    then: Callable[[nn.Module, int, ProcessGroup | None], Any] = full_state,
    **wrap: Any,
) -> list[Any]:
    """Wrap a deep copy of ``meta_model`` on every rank, seeded ``SEED``; ``then``'s results."""
    torch.manual_seed(SEED)

    def fn(rank: int, pg: ProcessGroup | None) -> Any:
        sharded = ShardedModule(copy.deepcopy(meta_model), process_group=pg, **wrap)
        return then(sharded, rank, pg)

    return [fn(0, None)] if world_size == 1 else run_ranks(world_size, fn, timeout=TIMEOUT)


def assert_all_finite(state: dict[str, Tensor]) -> None:
    bad = [k for k, v in state.items() if v.is_floating_point() and not v.isfinite().all()]
    assert not bad, f"not finite after materialisation: {bad}"


# determinism -------------------------------------------------------------------------

MODELS = {  # name: (build, auto_wrap, a randomly initialised parameter)
    "gpt": (lambda: GPT(tied=True), Block, "wte.weight"),
    "mixed": (Mixed, nn.MultiheadAttention, "head.weight"),
}


@pytest.mark.parametrize("name", MODELS)
def test_same_seed_same_parameters_on_every_rank_and_world_size(name: str) -> None:
    build, unit, random_param = MODELS[name]
    meta_model = on_meta(build)
    single = wrap_on_ranks(meta_model, 1, auto_wrap=unit)[0]
    assert_all_finite(single)
    assert single.keys() == build().state_dict().keys()
    for world_size in (2, 4):
        for rank, state in enumerate(wrap_on_ranks(meta_model, world_size, auto_wrap=unit)):
            assert state.keys() == single.keys()
            for k in single:
                assert torch.equal(state[k], single[k]), f"world {world_size} rank {rank}: {k}"
    other_seed = ShardedModule(copy.deepcopy(meta_model), auto_wrap=unit).full_state_dict()
    assert not torch.equal(other_seed[random_param], single[random_param])


# values ------------------------------------------------------------------------------

CONSTANTS = [
    "attn.in_proj_bias",
    "attn.out_proj.bias",
    "norm.weight",
    "norm.bias",
    "bn.weight",
    "bn.bias",
    "bn.running_mean",
    "bn.running_var",
    "bn.num_batches_tracked",
]
# name -> bound b of its uniform initialisation U(-b, b) in plain construction
RANDOM = {
    "proj_in.weight": 1 / math.sqrt(7),
    "attn.in_proj_weight": math.sqrt(6 / (12 + 36)),  # xavier_uniform_ on (36, 12)
    "attn.out_proj.weight": 1 / math.sqrt(12),
    "head.weight": 1 / math.sqrt(12),
}

MIXED_POLICIES = {
    "attention": nn.MultiheadAttention,
    # out_proj becomes a unit of its own: MultiheadAttention must still zero its bias
    "every-linear": lambda m: isinstance(m, nn.Linear),
    "none": None,
}


@pytest.mark.parametrize("policy", MIXED_POLICIES)
def test_constants_exact_and_random_parts_distributed_as_plain_construction(policy: str) -> None:
    torch.manual_seed(0)
    plain = Mixed().state_dict()
    for rank, state in enumerate(
        wrap_on_ranks(on_meta(Mixed), 2, auto_wrap=MIXED_POLICIES[policy])
    ):
        assert_all_finite(state)
        for k in CONSTANTS:
            assert state[k].dtype == plain[k].dtype and torch.equal(state[k], plain[k]), (
                f"rank {rank}: {k} is {state[k]}, plain construction gives {plain[k]}"
            )
        for k, bound in RANDOM.items():
            assert 0.8 * bound < state[k].abs().max() <= bound, f"rank {rank}: {k} not U(±{bound})"
            ratio = state[k].std() / (bound / math.sqrt(3))
            assert 0.75 < ratio < 1.25, f"rank {rank}: {k} std is {ratio:.2f}x U(±{bound})'s"


def test_tied_parameter_initialised_by_its_canonical_module() -> None:
    """GPT ties lm_head to wte: plain construction keeps the Embedding's N(0, 1) weight."""
    for policy in (Block, (Block, nn.Embedding)):
        state = wrap_on_ranks(on_meta(lambda: GPT(tied=True)), 2, auto_wrap=policy)[0]
        assert torch.equal(state["wte.weight"], state["lm_head.weight"])
        assert 0.9 < state["wte.weight"].std() < 1.1, f"{policy}: not Embedding's init"


def test_param_init_fn_replaces_reset_parameters_children_first() -> None:
    called: list[str] = []

    def init(module: nn.Module) -> None:
        # Children first: every real tensor below this module is written already, its own not.
        for name, p in module.named_parameters():
            if not p.is_meta:
                assert p.isnan().any() == ("." not in name), f"{type(module).__name__}.{name}"
        called.append(type(module).__name__)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    states = wrap_on_ranks(on_meta(GPT), 2, auto_wrap=Block, param_init_fn=init)
    assert {"GPT", "Block", "CausalSelfAttention", "Sequential", "GELU"} <= set(called)
    for state in states:
        assert_all_finite(state)
        for k, v in state.items():
            if k.endswith("bias") and "ln" not in k:
                assert torch.equal(v, torch.zeros_like(v)), k
            elif "ln" in k:
                assert torch.equal(v, torch.full_like(v, float(k.endswith("weight")))), k
            else:
                assert 0.015 < v.std() < 0.025, f"{k}: std {v.std():.3f}, not param_init_fn's"


# training ----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_meta_initialised_model_trains_like_plain_model_with_its_weights(
    world_size: int, tied: bool
) -> None:
    def train(model: nn.Module, rank: int, pg: ProcessGroup | None) -> tuple:
        start = model.full_state_dict()
        losses = train_steps(model, rank, world_size, pg, sgd, GPT_BATCHES, gpt_loss)
        return start, losses, model.full_state_dict()

    runs = wrap_on_ranks(on_meta(lambda: GPT(tied=tied)), world_size, train, auto_wrap=Block)
    plain = GPT(tied=tied)
    plain.load_state_dict(runs[0][0])
    ref = train_reference(plain, sgd, GPT_BATCHES, gpt_loss)
    moved = max((ref.state[k] - v).abs().max().item() for k, v in runs[0][0].items())
    assert moved > 1e-3, "the reference did not train; parity would prove nothing"
    for rank, (_, losses, state) in enumerate(runs):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref.losses), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(
            state,
            ref.state,
            atol=1e-5,
            rtol=0,
            msg=lambda m, r=rank: f"rank {r}, {STEPS} steps: {m}",
        )


def test_a_grad_dtype_set_on_meta_parameters_survives_materialisation() -> None:
    """A bfloat16 GPT built on the meta device with float32 as its parameters' ``grad_dtype``:
    the materialised model keeps float32 ``.grad`` and trains at 2 ranks bit for bit as the
    same weights wrapped from real tensors with the same ``grad_dtype``."""

    def train(model: nn.Module, rank: int, pg: ProcessGroup | None) -> tuple:
        start = model.full_state_dict()
        losses = train_steps(model, rank, 2, pg, sgd, GPT_BATCHES, gpt_loss)
        assert all(p.grad_dtype == torch.float32 for p in model.parameters())
        gpt_loss(model, *(t.chunk(2)[rank] for t in GPT_BATCHES[0])).backward()
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        return start, losses, model.full_state_dict()

    meta = on_meta(lambda: GPT().to(torch.bfloat16))
    torch.manual_seed(SEED)

    def from_meta(rank: int, pg: ProcessGroup) -> tuple:
        wrapped = ShardedModule(fp32_grads(copy.deepcopy(meta)), process_group=pg, auto_wrap=Block)
        return train(wrapped, rank, pg)

    runs = run_ranks(2, from_meta, timeout=TIMEOUT)
    plain = GPT().to(torch.bfloat16)
    plain.load_state_dict(runs[0][0])

    def from_real(rank: int, pg: ProcessGroup) -> tuple:
        wrapped = ShardedModule(fp32_grads(copy.deepcopy(plain)), process_group=pg, auto_wrap=Block)
        return train(wrapped, rank, pg)

    for (_, losses, state), (_, want_losses, want) in zip(runs, run_ranks(2, from_real)):
        assert losses == want_losses
        torch.testing.assert_close(state, want, atol=0, rtol=0)


def _tagged(model: nn.Module) -> nn.Module:
    """Tags on parameters (Mamba's ``_no_weight_decay``, a per-parameter ``lr_scale``) and a
    gradient hook halving one, set in the model's own code, before wrapping."""
    for block in model.blocks:
        block.ln_1.weight._no_weight_decay = True
    model.lm_head.weight.lr_scale = 0.5
    model.wpe.weight.register_hook(lambda g: g * 0.5)
    return model


def _decay_groups(model: nn.Module) -> list[dict[str, Any]]:
    params = list(model.parameters())
    return [
        {"params": [p for p in params if not getattr(p, "_no_weight_decay", False)]},
        {"params": [p for p in params if getattr(p, "_no_weight_decay", False)], "weight_decay": 0},
    ]


def test_tags_and_hooks_on_meta_parameters_survive_materialisation() -> None:
    """A model built on the meta device whose code tags parameters and hooks one: the wrapped
    model's parameters carry the tags and the hook (before: materialisation made new
    parameters without them, so weight-decay groups built from the tags took every parameter
    and the hook never ran), and it trains at 2 ranks bit for bit as the same weights wrapped
    from real tensors."""

    def train(model: nn.Module, rank: int, pg: ProcessGroup | None) -> tuple:
        start = model.full_state_dict()
        assert sum(getattr(p, "_no_weight_decay", False) for p in model.parameters()) == 3
        assert model.lm_head.weight.lr_scale == 0.5
        losses = train_steps(
            model,
            rank,
            2,
            pg,
            lambda _: torch.optim.AdamW(_decay_groups(model), lr=1e-2, weight_decay=0.5),
            GPT_BATCHES,
            gpt_loss,
        )
        return start, losses, model.full_state_dict()

    meta = on_meta(GPT)
    torch.manual_seed(SEED)

    def from_meta(rank: int, pg: ProcessGroup) -> tuple:  # a deep copy drops the tags: after
        model = _tagged(copy.deepcopy(meta))
        return train(ShardedModule(model, process_group=pg, auto_wrap=Block), rank, pg)

    runs = run_ranks(2, from_meta, timeout=TIMEOUT)
    plain = GPT()
    plain.load_state_dict(runs[0][0])

    def from_real(rank: int, pg: ProcessGroup) -> tuple:
        model = _tagged(copy.deepcopy(plain))
        return train(ShardedModule(model, process_group=pg, auto_wrap=Block), rank, pg)

    for (_, losses, state), (_, want_losses, want) in zip(runs, run_ranks(2, from_real)):
        assert losses == want_losses
        torch.testing.assert_close(state, want, atol=0, rtol=0)


# memory ------------------------------------------------------------------------------


@pytest.mark.stage3
def test_materialisation_holds_about_one_unit_at_a_time() -> None:
    """Every tensor allocated while wrapping is tracked: at its peak, a rank holds the shards
    kept so far plus one unit's full parameters, never the whole model."""
    world_size, depth = 4, 8
    plain = GPT(width=48, depth=depth)
    block = sum(p.nbytes for p in plain.blocks[0].parameters())
    total = sum(p.nbytes for p in plain.parameters())
    largest_unit = max(block, total - depth * block)
    assert total > 8 * largest_unit

    torch.manual_seed(SEED)
    meta_model = on_meta(lambda: GPT(width=48, depth=depth))

    def fn(rank: int, pg: ProcessGroup | None) -> tuple[int, int]:
        model = copy.deepcopy(meta_model)
        with StorageTracker() as tracker:
            ShardedModule(model, auto_wrap=Block, process_group=pg)
        return tracker.peak, tracker.live()

    for rank, (peak, kept) in enumerate(run_ranks(world_size, fn, timeout=TIMEOUT)):
        assert kept <= total / world_size + 256, f"rank {rank} keeps {kept} bytes, not a shard"
        assert peak <= kept + 1.1 * largest_unit, (
            f"rank {rank}: peak {peak} bytes, shards {kept} + one unit {largest_unit}"
        )


# errors ------------------------------------------------------------------------------


def test_uninitialised_parameter_raises_on_every_rank_naming_it() -> None:
    meta_model = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Scale(4)))
    with pytest.raises(AssertionError) as failed:
        wrap_on_ranks(meta_model, 2)
    message = str(failed.value)
    assert "2 of 2 ranks failed" in message and "hung" not in message
    assert message.count("ValueError: ShardedModule: meta-device initialisation left") == 2
    assert "parameter '1.gain' (in Scale)" in message and "'0.weight'" not in message
    assert "reset_parameters()" in message and "param_init_fn=" in message


def test_param_init_fn_that_misses_or_half_writes_tensors_is_named() -> None:
    def linear_only(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight[: module.weight.shape[0] // 2].normal_()  # half of it
            if module.bias is not None:
                module.bias.zero_()

    with pytest.raises(ValueError, match="param_init_fn") as failed:
        ShardedModule(on_meta(lambda: GPT(depth=1)), auto_wrap=Block, param_init_fn=linear_only)
    message = str(failed.value)
    for name in ("wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias", "lm_head.weight"):
        assert f"parameter '{name}'" in message
    assert "lm_head.bias" not in message and "wholly or in part" in message


def test_buffer_computed_in_init_is_named() -> None:
    meta_model = on_meta(lambda: nn.Sequential(nn.Linear(5, 5), Positions(5)))
    with pytest.raises(ValueError, match=r"buffer '1\.order' \(in Positions\)") as failed:
        ShardedModule(meta_model)
    assert "__init__" in str(failed.value)

    def positions(module: nn.Module) -> None:
        if isinstance(module, Positions):
            module.order.copy_(torch.arange(5))
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    def new_positions(module: nn.Module) -> None:
        if isinstance(module, Positions):
            module.order = torch.arange(5)  # a new buffer, not written in place: also fine
        elif isinstance(module, nn.Linear):
            module.reset_parameters()

    for init in (positions, new_positions):
        model = ShardedModule(
            on_meta(lambda: nn.Sequential(nn.Linear(5, 5), Positions(5))), param_init_fn=init
        )
        assert torch.equal(model[1].order, torch.arange(5)), init.__name__
        assert "order" not in model.state_dict()  # still a non-persistent buffer


class Counted(nn.Linear):
    """A linear layer whose ``reset_parameters`` writes values that depend on nothing random."""

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.copy_(torch.arange(self.weight.numel()).view_as(self.weight) / 10)
            if self.bias is not None:
                self.bias.fill_(0.5)


def _counted() -> nn.Sequential:
    return nn.Sequential(Counted(4, 6), nn.ReLU(), nn.Sequential(Counted(6, 6), Counted(6, 2)))


@pytest.mark.parametrize("recurse", [False, True], ids=["own tensors", "whole subtree"])
def test_param_init_fn_that_materialises_with_to_empty_initialises_like_plain(
    recurse: bool,
) -> None:
    """FSDP's ``param_init_fn`` idiom, ``module.to_empty(device=...)`` then
    ``module.reset_parameters()``: each unit initialises as the plain model does, on every
    rank. With ``recurse`` (``to_empty`` on the root and every container) the other units'
    tensors stay on meta: only the unit being built is real."""

    def init(module: nn.Module) -> None:
        module.to_empty(device="cpu", recurse=recurse)
        if isinstance(module, Counted):
            module.reset_parameters()

    plain = _counted()
    for state in wrap_on_ranks(on_meta(_counted), 2, auto_wrap=Counted, param_init_fn=init):
        torch.testing.assert_close(state, dict(plain.state_dict()), atol=0, rtol=0)


def test_to_empty_then_nothing_written_is_named_on_every_rank() -> None:
    """``to_empty()`` in a ``param_init_fn`` that then initialises only some modules: what it
    left unwritten is named on every rank. Before, it kept whatever the new memory held
    (``-2.15e+29``, different on each rank): most runs trained on it without a word, and one
    rank raising alone left the other waiting."""

    def linear_only(module: nn.Module) -> None:
        module.to_empty(device="cpu")
        if isinstance(module, nn.Linear):
            module.reset_parameters()

    meta_model = on_meta(lambda: nn.Sequential(nn.Linear(4, 4), Scale(4)))
    with pytest.raises(AssertionError) as failed:
        wrap_on_ranks(meta_model, 2, param_init_fn=linear_only)
    message = str(failed.value)
    assert "2 of 2 ranks failed" in message and "hung" not in message
    assert message.count("parameter '1.gain' (in Scale)") == 2
    assert "'0.weight'" not in message


def test_param_init_fn_that_initialises_only_meta_tensors_is_told_why() -> None:
    """FSDP's guarded idiom (materialise and reset only where the module's tensors are on
    meta) finds them already real here, and initialises nothing: the error names that."""

    def only_meta(module: nn.Module) -> None:
        if any(t.is_meta for t in module.parameters(recurse=False)):
            module.to_empty(device="cpu", recurse=False)
            module.reset_parameters()

    with pytest.raises(ValueError, match="parameter '0.weight'") as failed:
        ShardedModule(on_meta(_counted), param_init_fn=only_meta)
    assert "only where tensors are meta" in str(failed.value)


def test_initialiser_that_replaces_a_parameter_is_refused() -> None:
    def replace(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            module.weight = nn.Parameter(torch.zeros_like(module.weight, device="cpu"))
            module.bias.data.zero_()

    with pytest.raises(ValueError, match=r"replaced parameter\(s\) \['weight'\].*in place"):
        ShardedModule(on_meta(lambda: nn.Linear(3, 3)), param_init_fn=replace)


def test_param_init_fn_only_for_meta_models() -> None:
    with pytest.raises(ValueError, match="param_init_fn.*meta device"):
        ShardedModule(nn.Linear(3, 3), param_init_fn=lambda m: None)
    with pytest.raises(TypeError, match="param_init_fn must be a callable"):
        ShardedModule(on_meta(lambda: nn.Linear(3, 3)), param_init_fn="normal")


def test_optimizer_over_the_meta_parameters_fails_loudly() -> None:
    model = on_meta(lambda: nn.Linear(3, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ShardedModule(model)
    with pytest.raises(RuntimeError, match="from before the model was wrapped"):
        optimizer.step()


# Hugging Face transformers -------------------------------------------------------------


def test_hf_gpt2_initialises_with_its_init_weights_and_trains() -> None:
    import transformers
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    config = tiny_gpt2_config()
    meta_model = on_meta(lambda: transformers.GPT2LMHeadModel(config))

    def train(model: nn.Module, rank: int, pg: ProcessGroup | None) -> tuple:
        start = model.full_state_dict()
        losses = train_steps(model, rank, 2, pg, sgd, HF_BATCHES, hf_loss)
        return start, losses, model.full_state_dict()

    torch.manual_seed(SEED)

    def fn(rank: int, pg: ProcessGroup | None) -> tuple:
        model = copy.deepcopy(meta_model)
        sharded = ShardedModule(
            model, auto_wrap=GPT2Block, process_group=pg, param_init_fn=model._init_weights
        )
        assert sharded.lm_head.weight is sharded.transformer.wte.weight
        return train(sharded, rank, pg)

    runs = run_ranks(2, fn, timeout=TIMEOUT)
    start = runs[0][0]
    assert_all_finite(start)
    std = config.initializer_range
    assert torch.equal(start["transformer.wte.weight"], start["lm_head.weight"])
    for k, v in start.items():
        if k.endswith(".bias") and ".ln_" not in k and "ln_f" not in k:
            assert torch.equal(v, torch.zeros_like(v)), k
        elif "ln_" in k:
            assert torch.equal(v, torch.full_like(v, float(k.endswith("weight")))), k
        elif "c_proj.weight" in k:  # GPT-2's scaled residual init, written by the parent module
            assert 0.7 * std / 2 < v.std() < 1.3 * std / 2, k
        else:
            assert 0.7 * std < v.std() < 1.3 * std, k
    plain = transformers.GPT2LMHeadModel(config)
    plain.load_state_dict(start)
    ref = train_reference(plain, sgd, HF_BATCHES, hf_loss)
    for rank, (s, losses, state) in enumerate(runs):
        assert all(torch.equal(s[k], start[k]) for k in start), f"rank {rank} started elsewhere"
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref.losses), atol=1e-5, rtol=0
        )
        torch.testing.assert_close(state, ref.state, atol=1e-5, rtol=0)


def test_hf_llama_rotary_buffers_recomputed_or_named() -> None:
    import transformers
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    config = tiny_llama_config()
    meta_model = on_meta(lambda: transformers.LlamaForCausalLM(config))
    with pytest.raises(ValueError) as failed:
        ShardedModule(copy.deepcopy(meta_model), auto_wrap=LlamaDecoderLayer)
    message = str(failed.value)
    assert "parameter 'model.norm.weight' (in LlamaRMSNorm)" in message
    assert "buffer 'model.rotary_emb.inv_freq' (in LlamaRotaryEmbedding)" in message

    plain = transformers.LlamaForCausalLM(config)
    model = copy.deepcopy(meta_model)
    sharded = ShardedModule(model, auto_wrap=LlamaDecoderLayer, param_init_fn=model._init_weights)
    state = sharded.full_state_dict()
    assert_all_finite(state)
    for k in ("inv_freq", "original_inv_freq"):  # non-persistent: not in the state dict
        assert torch.equal(getattr(sharded.model.rotary_emb, k), getattr(plain.model.rotary_emb, k))
    for k in ("model.norm.weight", "model.layers.1.post_attention_layernorm.weight"):
        assert torch.equal(state[k], torch.ones_like(state[k])), k
    batch = HF_BATCHES[0][0]
    loss = hf_loss(sharded, batch, batch)
    loss.backward()
    assert torch.isfinite(loss) and all(
        p.grad is None or torch.isfinite(p.grad).all() for p in sharded.parameters()
    )
