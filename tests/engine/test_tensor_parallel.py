"""2-D parallelism: shardwrap units over torch's tensor-parallel layers on a ("dp", "tp") mesh.

Four ranks as threads, each with a ``DeviceMesh`` over its own default gloo group
(``tests/support/tp.py``): dp=2 x tp=2. The model is parallelized on ``mesh["tp"]`` first
(``parallelize_module``, or a ``transformers`` model's own plan), then wrapped over the mesh.
Every run trains on each rank's dp slice of the global batch and is compared with the plain
model trained on the whole batch. Proves:

- the tests' GPT (vocabulary-parallel embedding and head, column- then row-parallel MLP,
  row-parallel attention projection) at stages 1, 2 and 3 with SGD: every parameter within
  1e-5, the losses, and ``clip_grad_norm_`` over both axes, clipping; one exchange per unit
  (``bucket_mb=0``), so that stage 3 gives buffers to other units between forward and backward
  (the DTensors autograd saved are rebuilt over wherever their unit is gathered again);
- a ``transformers`` Llama under its own tensor-parallel plan, stages 1 to 3, AdamW: losses and
  clipped norms;
- sequence parallelism (norms as replicated DTensors, their gradients counted once in the
  norm, not once per tp rank);
- Muon stepping each tp-split matrix whole on one owner among the four ranks (its state there,
  in the whole shape), within 1e-4 of the reference;
- bf16 mixed precision: forward computes with bf16 DTensors, the parameters follow the plain
  mixed-precision recipe within 1e-4 (bf16 rounds the row-parallel partial sums), fp32 masters;
- int8 gradient compression over the dp axis: each step's reduced gradient within the
  format's bound of the exact average, and a quarter of the bytes;
- hybrid sharding with tensor parallelism, replicate 2 x dp 1 x tp 2;
- ``torch.amp.GradScaler``: an inf in one rank's block of a tp-split gradient, or in one rank's
  piece of a replicated one, makes all four ranks skip the step and lower the scale alike;
- what cannot be sharded is refused on every rank, by name, before any collective.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_tensor_parallel.py -q``
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from shardwrap import Compression, MixedPrecision, Offload, ShardedModule
from tests.support.models import Block
from tests.support.optimizers import MuonAndSGD, scaled_step
from tests.support.parity import (
    GPT_BATCHES,
    HF_BATCHES,
    adamw,
    gpt_loss,
    hf_loss,
    sgd,
    train_recipe,
)
from tests.support.tp import (
    SPBlock,
    SPStack,
    data_rank,
    parallelize_gpt,
    parallelize_llama,
    parallelize_stack,
    run_mesh_ranks,
    stack_batches,
    stack_loss,
    tp_gpt,
    tp_llama,
    train_plain,
    train_tp,
)

DP_TP = ((2, 2), ("dp", "tp"))
CLIP = 0.5  # below every step's norm: clipping changes the update


def _gpt_loss(model: nn.Module, x: Tensor, y: Tensor, mesh: Any) -> Tensor:
    return gpt_loss(model, x, y)


def _hf_loss(model: nn.Module, x: Tensor, y: Tensor, mesh: Any) -> Tensor:
    return hf_loss(model, x, y)


MODEL = tp_gpt()


@pytest.mark.parametrize("recompute", [False, True], ids=["", "recomputed"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt_trains_like_the_plain_model(stage: int, recompute: bool) -> None:
    """Also with each block recomputed in backward (``checkpoint_activations=True``) over the
    tp-split blocks."""
    want = train_plain(MODEL, sgd, GPT_BATCHES, _gpt_loss, clip=CLIP)
    assert all(n > CLIP for n in want.norms)
    runs = train_tp(
        MODEL, parallelize_gpt, *DP_TP, sgd, GPT_BATCHES, _gpt_loss, clip=CLIP,
        auto_wrap=Block, stage=stage, bucket_mb=0, checkpoint_activations=recompute,
    )  # fmt: skip
    for rank, run in enumerate(runs):
        msg = f"rank {rank}"
        torch.testing.assert_close(run.losses, want.losses, atol=1e-5, rtol=0, msg=msg)
        torch.testing.assert_close(run.norms, want.norms, atol=1e-5, rtol=1e-5, msg=msg)
        torch.testing.assert_close(run.state, want.state, atol=1e-5, rtol=0, msg=msg)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_transformers_llama_under_its_own_plan_trains_like_the_plain_model(stage: int) -> None:
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tp_llama()
    want = train_plain(model, adamw, HF_BATCHES, _hf_loss, clip=CLIP)
    runs = train_tp(
        model, parallelize_llama, *DP_TP, adamw, HF_BATCHES, _hf_loss, clip=CLIP,
        auto_wrap=LlamaDecoderLayer, stage=stage,
    )  # fmt: skip
    for run in runs:
        torch.testing.assert_close(run.losses, want.losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(run.norms, want.norms, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_transformers_llama_under_its_own_plan_evaluates_and_generates_without_grad(
    stage: int,
) -> None:
    """Under ``torch.no_grad()`` the plan's layers compute on local tensors (swapping their
    registered DTensor parameters): logits and greedy ``generate`` equal the plain model's, and
    the shard parameters stay registered after."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    model = tp_llama()
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = model(ids).logits
    tokens = model.generate(ids, max_new_tokens=4, do_sample=False)

    def fn(rank: int, mesh: DeviceMesh) -> None:
        plain = parallelize_llama(copy.deepcopy(model), mesh["tp"])
        m = ShardedModule(plain, process_group=mesh, auto_wrap=LlamaDecoderLayer, stage=stage)
        registered = [id(p) for p in m.parameters()]
        with torch.no_grad():
            torch.testing.assert_close(m(ids).logits, want, atol=1e-6, rtol=0)
        assert torch.equal(m.generate(ids, max_new_tokens=4, do_sample=False), tokens)
        assert [id(p) for p in m.parameters()] == registered

    run_mesh_ranks(*DP_TP, fn)


def test_sequence_parallel_norms_count_their_replicated_gradients_once() -> None:
    torch.manual_seed(0)
    model = SPStack()
    batches = stack_batches()
    want = train_plain(model, sgd, batches, stack_loss, clip=CLIP)

    def placements(m: nn.Module, opt: Any, mesh: DeviceMesh) -> tuple:
        seen = []
        hook = m.blocks[0].register_forward_pre_hook(
            lambda b, args: seen.append((b.norm.weight.placements, b.fc1.weight.placements))
        )
        stack_loss(m, *batches[0], mesh)
        hook.remove()
        return seen[0]

    runs = train_tp(
        model, parallelize_stack, *DP_TP, sgd, batches, stack_loss, clip=CLIP,
        finish=placements, auto_wrap=SPBlock, split_loss=True,
    )  # fmt: skip
    for run in runs:
        # the norms are replicated DTensors, the matmuls split: both kinds are sharded
        assert run.finished == ((Replicate(),), (Shard(0),))
        torch.testing.assert_close(run.losses, want.losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(run.norms, want.norms, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run.state, want.state, atol=1e-5, rtol=0)


def test_the_norm_of_split_and_replicated_gradients_joined_into_one_vector_is_global() -> None:
    """``parameters_to_vector`` of a tensor-parallel model's gradients joins split ones (reduced
    over dp x tp) and replicated ones (over dp): the joined vector was a plain tensor, its norm
    each rank's own part, different on every rank. Now each part's norm is completed over its
    own group: the vector's norm is the whole model's, as ``get_total_norm`` gives it."""
    torch.manual_seed(0)
    model = SPStack()
    batches = stack_batches()

    def norms(m: nn.Module, opt: Any, mesh: DeviceMesh) -> tuple[float, ...]:
        stack_loss(m, *batches[0], mesh).backward()
        grads = [p.grad for p in m.parameters()]
        joined = torch.nn.utils.parameters_to_vector(grads)
        return tuple(
            value.item()
            for order in (2.0, float("inf"))
            for value in (torch.nn.utils.get_total_norm(grads, order), joined.norm(order))
        )

    runs = train_tp(
        model, parallelize_stack, *DP_TP, sgd, batches, stack_loss, clip=CLIP,
        finish=norms, auto_wrap=SPBlock, split_loss=True,
    )  # fmt: skip
    first = runs[0].finished
    for run in runs:
        whole, joined, whole_inf, joined_inf = run.finished
        assert joined == pytest.approx(whole, rel=1e-6) and joined_inf == whole_inf
        assert run.finished == pytest.approx(first, rel=1e-6)  # every rank alike


def test_a_split_state_dict_and_a_split_after_wrapping_are_refused_naming_the_fix() -> None:
    """A tensor-parallel model's own ``state_dict()`` (DTensor blocks) given to the sharded
    model's ``load_state_dict`` failed in torch ("got mixed torch.Tensor and DTensor") after
    the plain keys before it had loaded; ``parallelize_module`` on the sharded model was
    refused as if a resize. Now each is refused naming the fix, nothing loaded or changed."""
    torch.manual_seed(0)
    model = SPStack()
    torch.manual_seed(1)
    other = SPStack()

    def fn(rank: int, mesh: DeviceMesh) -> None:
        m = ShardedModule(
            parallelize_stack(copy.deepcopy(model), mesh["tp"]),
            process_group=mesh,
            auto_wrap=SPBlock,
        )
        before = m.full_state_dict()
        split = parallelize_stack(copy.deepcopy(other), mesh["tp"]).state_dict()
        for load in (m.load_state_dict, m.load_full_state_dict):
            with pytest.raises(ValueError, match=r"are DTensors .* v\.full_tensor\(\)"):
                load(split)
        torch.testing.assert_close(m.full_state_dict(), before, atol=0, rtol=0)
        wrapped_first = ShardedModule(copy.deepcopy(model), process_group=mesh, auto_wrap=SPBlock)
        with pytest.raises(ValueError, match=r"a DTensor .*Apply tensor parallelism first"):
            parallelize_stack(wrapped_first, mesh["tp"])

    run_mesh_ranks(*DP_TP, fn)


@pytest.mark.parametrize("stage", [1, 3])
def test_muon_steps_each_split_matrix_whole_on_one_of_the_four_ranks(stage: int) -> None:
    _, want = train_recipe(MODEL, 2, torch.float32, make_optimizer=MuonAndSGD)

    def owned(m: nn.Module, opt: MuonAndSGD, mesh: DeviceMesh) -> dict[str, tuple[int, ...]]:
        names = {id(p): n for n, p in m.named_parameters()}
        state = opt.optimizers[0].state  # Muon's
        return {names[id(p)]: tuple(s["momentum_buffer"].shape) for p, s in state.items()}

    runs = train_tp(
        MODEL, parallelize_gpt, *DP_TP, MuonAndSGD, GPT_BATCHES, _gpt_loss,
        finish=owned, auto_wrap=Block, stage=stage,
    )  # fmt: skip
    owners: dict[str, list[tuple[int, ...]]] = {}
    for run in runs:
        torch.testing.assert_close(run.state, want, atol=1e-4, rtol=0)
        for name, shape in run.finished.items():
            owners.setdefault(name, []).append(shape)
    # a tp-split matrix has its state on one rank of the four, whole; a replicated one on one
    # rank of each tp rank's shard group
    split = ("wte", "lm_head", "mlp.0", "mlp.2", "attn.proj")
    for name, value in want.items():
        if value.ndim == 2:
            copies = 1 if any(s in name for s in split) else 2
            assert owners[name] == [tuple(value.shape)] * copies, name


@pytest.mark.parametrize("where", ["split", "replicated"])
def test_an_inf_on_one_rank_makes_torchs_grad_scaler_skip_on_all_four(where: str) -> None:
    # the block's last two: a row-parallel weight (split over tp) and its bias (replicated),
    # both in the second dp rank's half of the block's flat group
    name = "blocks.0.mlp.2.weight" if where == "split" else "blocks.0.mlp.2.bias"

    def fn(rank: int, mesh: DeviceMesh) -> list[tuple[bool, float]]:
        tp = parallelize_gpt(copy.deepcopy(MODEL), mesh["tp"])
        m = ShardedModule(tp, process_group=mesh, auto_wrap=Block)
        opt = adamw(m.parameters())
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        index, count = data_rank(mesh)
        seen = []
        for step, (x, y) in enumerate(GPT_BATCHES[:3]):
            loss = _gpt_loss(m, x.chunk(count)[index], y.chunk(count)[index], mesh)
            scaler.scale(loss).backward()
            grad = dict(m.named_parameters())[name].grad
            if step == 1 and rank == 3:  # dp 1, tp 1 only
                grad.view(-1)[-1] = float("inf")
            seen.append(scaled_step(scaler, opt, m))
        return seen

    for rank, seen in enumerate(run_mesh_ranks(*DP_TP, fn)):
        assert seen == [(True, 1024.0), (False, 512.0), (True, 512.0)], rank


BF16 = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def test_bf16_follows_the_plain_mixed_precision_recipe() -> None:
    want_losses, want = train_recipe(MODEL, 2, torch.bfloat16)

    def computed_in(m: nn.Module, opt: Any, mesh: DeviceMesh) -> tuple:
        seen = []
        hook = m.blocks[0].register_forward_pre_hook(
            lambda b, args: seen.append((type(b.mlp[0].weight), b.mlp[0].weight.dtype))
        )
        gpt_loss(m, *GPT_BATCHES[0])
        hook.remove()
        return seen[0]

    def loss(model: nn.Module, x: Tensor, y: Tensor, mesh: Any) -> Tensor:
        return gpt_loss(model, x, y).float()

    runs = train_tp(
        MODEL, parallelize_gpt, *DP_TP, sgd, GPT_BATCHES, loss, finish=computed_in,
        auto_wrap=Block, mixed_precision=BF16,
    )  # fmt: skip
    for run in runs:
        # within bf16's rounding of the row-parallel layers' partial sums, which one process
        # does not split: a loss (computed in bf16) may round to the next bf16 value
        torch.testing.assert_close(run.losses, want_losses, atol=2**-5, rtol=0)
        torch.testing.assert_close(run.state, want, atol=1e-4, rtol=0)
        assert all(v.dtype == torch.float32 for v in run.state.values())
        assert run.finished == (DTensor, torch.bfloat16)


def test_int8_gradients_over_dp_stay_within_the_format_bound_of_the_exact_average() -> None:
    from shardwrap.comm.quantize import Codec
    from tests.support.compression import block_bound, groups

    compression = Compression(grads="int8", block=64, error_feedback=False)
    codec = Codec("int8", 64)

    def fn(rank: int, mesh: DeviceMesh) -> None:
        packed = ShardedModule(
            parallelize_gpt(copy.deepcopy(MODEL), mesh["tp"]),
            process_group=mesh,
            auto_wrap=Block,
            compression=compression,
        )
        opt = torch.optim.SGD(packed.parameters(), lr=0.05)
        index, count = data_rank(mesh)
        dp, r = mesh["dp"].get_group(), mesh["dp"].get_local_rank()
        for x, y in GPT_BATCHES[:3]:
            x, y = x.chunk(count)[index], y.chunk(count)[index]
            plain = copy.deepcopy(MODEL)
            plain.load_state_dict(packed.full_state_dict())
            exact = ShardedModule(
                parallelize_gpt(plain, mesh["tp"]), process_group=mesh, auto_wrap=Block
            )
            with exact.no_sync():  # each rank's own flat gradients, unreduced
                gpt_loss(exact, x, y).backward()
            gpt_loss(packed, x, y).backward()
            for mine, g in zip(groups(exact), groups(packed)):
                flats = [torch.empty_like(mine.full.grad) for _ in range(2)]
                dist.all_gather(flats, mine.full.grad, group=dp)
                n = g.shard.numel()
                ranks = [f[r * n : (r + 1) * n] for f in flats]
                average = torch.stack(ranks).mean(0)
                limit = block_bound(ranks[1 - r], codec) / 2 + 1e-6 * average.abs() + 1e-7
                got = torch.cat([p.grad.reshape(-1) for p in g.shard_params])
                want = torch.cat([average[pc.shard_offset :][: pc.numel] for pc in g.pieces])
                bound = torch.cat([limit[pc.shard_offset :][: pc.numel] for pc in g.pieces])
                assert ((got - want).abs() <= bound).all()
                assert not torch.equal(got, want)  # quantized
            opt.step()
            opt.zero_grad()

    run_mesh_ranks(*DP_TP, fn)


def test_hybrid_sharding_with_tensor_parallelism_replicate_2_dp_1_tp_2() -> None:
    want = train_plain(MODEL, sgd, GPT_BATCHES, _gpt_loss, clip=CLIP)
    runs = train_tp(
        MODEL, parallelize_gpt, (2, 1, 2), ("replicate", "dp", "tp"), sgd, GPT_BATCHES,
        _gpt_loss, clip=CLIP, auto_wrap=Block,
    )  # fmt: skip
    for run in runs:
        torch.testing.assert_close(run.losses, want.losses, atol=1e-5, rtol=0)
        torch.testing.assert_close(run.norms, want.norms, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(run.state, want.state, atol=1e-5, rtol=0)


def _partial(mesh: DeviceMesh) -> nn.Module:
    m = nn.Linear(4, 4)
    local = m.weight.detach()
    m.weight = nn.Parameter(DTensor.from_local(local, mesh["tp"], [Partial()], run_check=False))
    return m


def _uneven(mesh: DeviceMesh) -> nn.Module:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    return parallelize_module(nn.Linear(4, 3), mesh["tp"], ColwiseParallel())


def _split(mesh: DeviceMesh) -> nn.Module:
    m = nn.Linear(4, 4)
    m.weight = nn.Parameter(distribute_tensor(m.weight.detach(), mesh["tp"], [Shard(0)]))
    return m


def _replicated(mesh: DeviceMesh) -> nn.Module:
    """``distribute_module`` without a partition function: every parameter replicated."""
    from torch.distributed.tensor import distribute_module

    return distribute_module(nn.Linear(4, 4), mesh["dp"])


@pytest.mark.parametrize(
    ("build", "wrap", "words"),
    [
        (_partial, {}, "'weight': placed Partial"),
        (_uneven, {}, "dimension 0 of (3, 4) does not split into 2 equal blocks"),
        (_split, {"process_group": "dp"}, 'has no "tp" dimension'),
        (_replicated, {"process_group": "dp"}, "replicated on every rank of its mesh"),
        (
            _split,
            {"offload": Offload(device="cpu")},
            "offload is not supported with tensor parallelism",
        ),
    ],
    ids=["partial", "uneven", "no-tp-mesh", "replicated-no-tp", "offload"],
)
def test_what_cannot_be_sharded_is_refused_on_every_rank(
    build: Any, wrap: dict, words: str
) -> None:
    def fn(rank: int, mesh: DeviceMesh) -> None:
        kwargs = dict(wrap)
        if kwargs.get("process_group") == "dp":
            kwargs["process_group"] = mesh["dp"]
        kwargs.setdefault("process_group", mesh)
        with pytest.raises(ValueError, match=_escaped(words)):
            ShardedModule(build(mesh), **kwargs)

    run_mesh_ranks((1, 2), ("dp", "tp"), fn)


def _escaped(words: str) -> str:
    import re

    return re.escape(words)


def _seeded(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return tp_gpt()


MODELS = [_seeded(seed) for seed in range(4)]  # one per rank, each its own weights


def test_sync_module_states_and_gathered_edits_handle_blocks() -> None:
    """``sync_module_states=True`` gives every rank rank 0's model: parallelize_module gives
    each tp rank its block of its tp group's first rank's weights, the sync copies the first dp
    rank's blocks and rank 0's replicated weights. Inside ``gathered(writeback=True)`` the
    parameters are whole DTensors; edits every rank makes alike are written back, edits of one
    rank's block are refused on every rank (the tp ranks' blocks are fingerprinted together),
    and so is a ``modifier_rank``."""
    want = {k: v.clone() for k, v in MODELS[0].state_dict().items()}

    def fn(rank: int, mesh: DeviceMesh) -> None:
        m = ShardedModule(
            parallelize_gpt(copy.deepcopy(MODELS[rank]), mesh["tp"]),
            process_group=mesh,
            auto_wrap=Block,
            sync_module_states=True,
        )
        torch.testing.assert_close(m.full_state_dict(), want, atol=0, rtol=0)
        with m.gathered(writeback=True):
            assert isinstance(m.blocks[0].mlp[0].weight, DTensor)
            m.blocks[0].mlp[0].weight.add_(1.0)
            m.ln_f.weight.add_(1.0)
        edited = m.full_state_dict()
        for name in ("blocks.0.mlp.0.weight", "ln_f.weight"):
            torch.testing.assert_close(edited[name], want[name] + 1.0, atol=0, rtol=0)
        with pytest.raises(ValueError, match="differ across ranks: blocks.0.mlp.0.weight"):
            with m.gathered(writeback=True):
                if rank == 1:  # one tp rank's block only
                    m.blocks[0].mlp[0].weight.add_(1.0)
        with pytest.raises(ValueError, match="modifier_rank=.... with tensor parallelism"):
            with m.gathered(modifier_rank=0):
                pass
        torch.testing.assert_close(m.full_state_dict(), edited, atol=0, rtol=0)

    run_mesh_ranks(*DP_TP, fn)
