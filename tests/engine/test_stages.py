"""ZeRO stages 1, 2 and 3: what each rank holds, what it sends, and that it trains exactly.

Training parity of every stage is proven by the whole in-process suite, which ``make test``
runs at stages 1 and 2 as well as 3 (``pytest --stage N``, see ``tests/conftest.py``). This
file proves what distinguishes the stages:

- memory by allocation tracking (every storage each rank creates, from wrapping on): between
  steps a rank holds 1/N optimizer state and its 1/N shards, which at stages 1 and 2 are slices
  of the full parameters it keeps, to the element; at stage 1 the full gradients of every unit
  are alive together at the end of backward, at stage 2 they are not;
- communication: stages 1 and 2 gather each unit once per step (DDP's bytes: one gather and one
  reduce-scatter of the model), stage 3 also in backward; where backward gathers nothing and
  reductions are not deferred, they go out as gradients complete, with one handshake at the end;
- SGD parameter parity and AdamW loss parity at each stage on GPT and on Hugging Face GPT-2,
  with ``generate()`` after training, and with torch's fused SGD and AdamW kernels;
- checkpoints saved at one stage and world size load at another and train on in parity;
- bad input: a stage that is not 1, 2 or 3, ``reshard_after_forward`` at stage 1 or 2, and
  ranks that passed different stages, each a clear error on every rank.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_stages.py -q``
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap
from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.engine.step.strategy import Strategy
from tests.support.memory import StorageTracker
from tests.support.models import GPT, Block, make_batch
from tests.support.parity import (
    GPT_BATCHES,
    HF_BATCHES,
    HFCase,
    adamw,
    assert_parity,
    build_gpt,
    build_hf,
    fused_adamw,
    fused_sgd,
    gpt_loss,
    greedy,
    hf_loss,
    sgd,
)
from tests.support.ranks import run_ranks

STAGES = [1, 2, 3]


def _group(pg: ProcessGroup) -> ProcessGroup | None:
    return pg if pg.size() > 1 else None


def _slice(t: Tensor, rank: int, world: int) -> Tensor:
    n = t.shape[0] // world
    return t[rank * n : (rank + 1) * n]


# parity ------------------------------------------------------------------------------


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_every_stage_trains_like_the_plain_model(stage: int, world_size: int) -> None:
    model = build_gpt(tied=True)
    assert_parity(model, world_size, sgd, GPT_BATCHES, gpt_loss, auto_wrap=Block, stage=stage)
    assert_parity(model, world_size, adamw, GPT_BATCHES, gpt_loss, auto_wrap=Block, stage=stage)


@pytest.mark.parametrize("stage", STAGES)
def test_fused_optimizers_train_like_the_plain_model(stage: int) -> None:
    """torch's fused kernels write the parameters without counting the write in their version
    counters, by which the full parameters that stages 1 and 2 keep learn to refresh."""
    model = build_gpt(tied=False)
    for make in (fused_sgd, fused_adamw):
        assert_parity(model, 2, make, GPT_BATCHES, gpt_loss, auto_wrap=Block, stage=stage)


class _SGDThroughData(torch.optim.Optimizer):
    """Plain SGD written the old way, through ``.data``, which torch does not count in a
    tensor's version counter."""

    def __init__(self, params: Iterable[nn.Parameter]) -> None:
        super().__init__(params, {"lr": 0.05})

    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.data.add_(p.grad, alpha=-group["lr"])


shardwrap.declare_optimizer(_SGDThroughData, reads_shapes=False)  # a user's own: elementwise


@pytest.mark.parametrize("stage", STAGES)
def test_an_update_through_data_is_seen_at_the_next_forward(stage: int) -> None:
    assert_parity(build_gpt(tied=False), 2, _SGDThroughData, GPT_BATCHES, gpt_loss,
                  auto_wrap=Block, stage=stage)  # fmt: skip


@pytest.fixture(scope="module")
def gpt2() -> HFCase:
    return build_hf("gpt2")


@pytest.mark.parametrize("stage", [1, 2])
def test_hugging_face_gpt2_trains_and_generates_at_stage(stage: int, gpt2: HFCase) -> None:
    ref, runs = assert_parity(
        gpt2.model, 2, sgd, HF_BATCHES, hf_loss, finish=greedy, auto_wrap=gpt2.block, stage=stage
    )
    for run in runs:
        torch.testing.assert_close(run.finished, ref.finished, atol=0, rtol=0)


# memory ------------------------------------------------------------------------------


def _held(stage: int, world_size: int, bucket_mb: float = 0) -> list[dict[str, int]]:
    """Train two AdamW steps under allocation tracking; per rank, bytes held and expected.

    ``at_end_of_backward``: bytes alive when backward has run and no deferred reduction has
    been issued yet (relative to before forward), and how many flat gradients are full then.
    """
    torch.manual_seed(0)
    model = GPT(width=48, depth=4)
    batches = [make_batch(seed=s, batch=4 * world_size) for s in range(2)]

    def fn(rank: int, pg: ProcessGroup) -> dict[str, int]:
        plain = copy.deepcopy(model)
        local = [(_slice(x, rank, world_size), _slice(y, rank, world_size)) for x, y in batches]
        with StorageTracker(existing=tuple(t for batch in local for t in batch)) as tracker:
            m = ShardedModule(
                plain,
                auto_wrap=Block,
                process_group=_group(pg),
                stage=stage,
                bucket_mb=bucket_mb,
            )
            reductions = m._shardwrap_root.reductions
            close, at_close = reductions.close, []

            def spy_close() -> list[bool]:
                full = [g for g in reductions.order if g.full.grad is not None]
                at_close.append((tracker.live(), len(full)))
                return close()

            reductions.close = spy_close
            opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
            for x, y in local:
                before = tracker.live()
                m(x, y).backward()
                at_close[-1] = (at_close[-1][0] - before, at_close[-1][1])
                opt.step()
                opt.zero_grad()
            held = tracker.live()
        groups = [g for u in m._shardwrap_root.units for g in u.groups]
        state = {t.untyped_storage()._cdata: t for s in opt.state.values() for t in s.values()}
        return {
            "held": held,
            "optimizer": sum(t.untyped_storage().nbytes() for t in state.values()),
            "shards": sum(g.shard.nbytes for g in groups),
            "full": sum(g.layout.padded_numel * g.dtype.itemsize for g in groups),
            "leaves": sum(g.full.untyped_storage().nbytes() for g in groups),
            "params": sum(p.numel() for p in m.parameters()),
            "n_params": len(list(m.parameters())),
            "n_groups": len(groups),
            "largest_unit": max(g.layout.padded_numel * g.dtype.itemsize for g in groups),
            "at_end_of_backward": at_close[-1][0],
            "full_grads_at_end_of_backward": at_close[-1][1],
        }

    if world_size == 1:
        return [fn(0, _SinglePG())]
    return run_ranks(world_size, fn, timeout=30.0)


class _SinglePG:
    """Stands in for a process group of one rank (``_group`` maps it to ``None``)."""

    def size(self) -> int:
        return 1


@pytest.mark.stage3  # every stage, explicitly: once is enough
@pytest.mark.parametrize("world_size", [2, 4])
def test_each_stage_holds_what_its_row_of_the_table_says(world_size: int) -> None:
    by_stage = {stage: _held(stage, world_size) for stage in STAGES}
    for stage, ranks in by_stage.items():
        for rank, r in enumerate(ranks):
            # AdamW: two moments shaped like this rank's piece of each parameter, and a step.
            assert r["optimizer"] == 2 * 4 * r["params"] + 4 * r["n_params"], (stage, rank)
            # Stages 1 and 2 keep the full parameters, the shard a slice of them; stage 3
            # keeps the shard alone.
            params = r["full"] if stage in (1, 2) else r["shards"]
            expected = params + r["optimizer"] + r["leaves"]
            assert r["held"] == expected, (
                f"stage {stage}, rank {rank}: holds {r['held']} bytes between steps, expected "
                f"parameters {params} + optimizer state {r['optimizer']} + leaves {r['leaves']}"
            )
            assert r["shards"] * world_size == r["full"]  # 1/N of the padded flat buffers
    for rank in range(world_size):
        one, two = by_stage[1][rank], by_stage[2][rank]
        # Stage 1 keeps every unit's full gradient until the end of backward; stage 2 reduces
        # each during backward and lets it go, so at most two are left by then.
        assert one["full_grads_at_end_of_backward"] == one["n_groups"]
        assert two["full_grads_at_end_of_backward"] <= 2
        assert one["at_end_of_backward"] >= one["full"], one
        # Stage 2 holds the reduced 1/N gradients and what is left of at most two full ones.
        assert two["at_end_of_backward"] <= two["full"] // world_size + 2 * two["largest_unit"]
    # Where reductions go in buckets (here of about two units), at most two buckets' worth.
    bucket = 2 * by_stage[2][0]["largest_unit"]
    for two in _held(2, world_size, bucket_mb=bucket / 2**20):
        assert two["full_grads_at_end_of_backward"] < two["n_groups"]
        assert two["at_end_of_backward"] <= two["full"] // world_size + 2 * bucket


# communication -----------------------------------------------------------------------


@pytest.mark.parametrize("bucket_mb", [0, 4])
@pytest.mark.parametrize("stage", STAGES)
def test_gathers_per_step_follow_the_stage(stage: int, bucket_mb: float) -> None:
    """Without buckets stage 3 gathers each unit again for backward; with one bucket that holds
    every unit, the bucket stays gathered from forward to backward, as stages 1 and 2 keep it."""
    torch.manual_seed(0)
    model = GPT(depth=4)
    x, y = make_batch(seed=0, batch=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[dict[str, int], int]:
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=Block,
            process_group=pg,
            stage=stage,
            bucket_mb=bucket_mb,
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):  # the second step runs with the order recorded by the first
            m.comm_stats.reset()
            m(_slice(x, rank, 2), _slice(y, rank, 2)).backward()
            opt.step()
            opt.zero_grad()
        model_bytes = sum(
            g.layout.padded_numel * 4 for u in m._shardwrap_root.units for g in u.groups
        )
        return dict(m.comm_stats.bytes), model_bytes

    for sent, model_bytes in run_ranks(2, fn, timeout=30.0):
        assert model_bytes <= 4 * 2**20
        assert sent["reduce_scatter"] == model_bytes
        if stage in (1, 2) or bucket_mb:
            assert sent["all_gather"] == model_bytes  # each unit once: DDP's volume
        else:
            assert sent["all_gather"] > model_bytes  # gathered again for backward


@pytest.mark.stage3  # every strategy, explicitly: once is enough
@pytest.mark.parametrize("bucket_mb", [0, 4])
@pytest.mark.parametrize(
    ("stage", "reshard", "offers"),
    [(1, True, False), (2, True, True), (3, True, False), (3, False, True)],
)
def test_a_backward_that_gathers_nothing_reduces_without_handshakes(
    stage: int, reshard: bool, offers: bool, bucket_mb: float
) -> None:
    """Stage 2 (and stage 3 kept after forward) gathers nothing in backward: its reductions go
    out as gradients complete, overlapping backward, with one handshake at the end (every rank
    said at the end of forward that its backward gathers nothing). Stage 1 defers them to the
    end of backward; stage 3 issues them at the handshakes of its gathers: one per unit, or
    none where its units all fit in one bucket, kept gathered from forward for backward."""
    assert (
        Strategy(stage=stage, reshard_after_forward=reshard).offers_reductions_in_backward is offers
    )
    torch.manual_seed(0)
    model = GPT(depth=4)
    x, y = make_batch(seed=0, batch=4)

    def fn(rank: int, pg: ProcessGroup) -> tuple[int, int]:
        options = {} if stage < 3 else {"reshard_after_forward": reshard}
        m = ShardedModule(
            copy.deepcopy(model),
            auto_wrap=Block,
            process_group=pg,
            stage=stage,
            bucket_mb=bucket_mb,
            **options,
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):  # the second step runs with the order recorded by the first
            loss = m(_slice(x, rank, 2), _slice(y, rank, 2))
            m.comm_stats.reset()
            loss.backward()
            opt.step()
            opt.zero_grad()
        units = m._shardwrap_root.units
        assert sum(u.gather_nbytes for u in units) <= bucket_mb * 2**20 or bucket_mb == 0
        return m.comm_stats.calls["handshake"], len(units)

    for handshakes, units in run_ranks(2, fn, timeout=30.0):
        if offers or stage == 1:  # the end of backward only
            assert handshakes == 1
        elif bucket_mb == 0:  # one per gather in backward (the root and the last unit stay)
            assert handshakes == units - 2 + 1
        else:  # nothing gathered: the end only
            assert handshakes == 1


# checkpoints across stages -----------------------------------------------------------


@pytest.mark.parametrize(
    ("save", "load"), [((1, 2), (3, 4)), ((3, 2), (2, 1)), ((2, 4), (1, 2))], ids=str
)
def test_checkpoint_saved_at_one_stage_and_world_size_resumes_at_another(
    tmp_path: Path, save: tuple[int, int], load: tuple[int, int]
) -> None:
    """(stage, world size) saving, then loading: SGD with momentum, so optimizer state counts."""
    torch.manual_seed(0)
    model = GPT(tied=True)
    batches = GPT_BATCHES
    ref = copy.deepcopy(model)
    opt = sgd(ref.parameters())
    for x, y in batches:
        opt.zero_grad()
        gpt_loss(ref, x, y).backward()
        opt.step()

    def run(stage: int, world: int, steps: range, resume: bool):  # noqa: ANN202
        def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
            m = ShardedModule(
                copy.deepcopy(model), auto_wrap=Block, process_group=_group(pg), stage=stage
            )
            o = sgd(m.parameters())
            if resume:
                load_checkpoint(tmp_path / "ckpt", m, o)
            for step in steps:
                x, y = batches[step]
                o.zero_grad()
                gpt_loss(m, _slice(x, rank, world), _slice(y, rank, world)).backward()
                o.step()
            if not resume:
                save_checkpoint(tmp_path / "ckpt", m, o)
            return m.full_state_dict()

        return fn(0, _SinglePG()) if world == 1 else run_ranks(world, fn, timeout=30.0)[0]

    half = len(batches) // 2
    run(*save, range(half), resume=False)
    state = run(*load, range(half, len(batches)), resume=True)
    torch.testing.assert_close(state, ref.state_dict(), atol=1e-5, rtol=0)


# bad input ---------------------------------------------------------------------------


@pytest.mark.parametrize("stage", [0, 4, True, "2", 2.0])
def test_a_stage_that_is_not_1_2_or_3_is_refused(stage: object) -> None:
    with pytest.raises(ValueError, match=r"stage must be 1, 2 or 3, got .*ShardedModule"):
        ShardedModule(GPT(), auto_wrap=Block, stage=stage)


@pytest.mark.parametrize("stage", [1, 2])
def test_reshard_after_forward_is_refused_below_stage_3(stage: int) -> None:
    with pytest.raises(ValueError, match="reshard_after_forward is a stage-3 option"):
        ShardedModule(GPT(), auto_wrap=Block, stage=stage, reshard_after_forward=False)


def test_ranks_that_pass_different_stages_all_raise() -> None:
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg, stage=2 + rank)

    with pytest.raises(AssertionError) as failed:
        run_ranks(2, fn, timeout=20.0)
    message = str(failed.value)
    assert "2 of 2 ranks failed" in message and "hung" not in message
    assert message.count("ranks passed different arguments") == 2
    assert message.count("\n  stage: 2 on rank 0; 3 on rank 1\n") == 2


def test_sharded_model_has_no_unexpected_modules() -> None:
    """Stages change lifetimes only: names, parameters and the optimizer's view are the same."""
    names = {}
    for stage in STAGES:
        m = ShardedModule(GPT(), auto_wrap=Block, stage=stage)
        names[stage] = [(n, tuple(p.shape)) for n, p in m.named_parameters()]
        assert all(isinstance(p, nn.Parameter) for p in m.parameters())
    assert names[1] == names[2] == names[3]
