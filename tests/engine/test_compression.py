"""Compressed communication in training: ``ShardedModule(..., compression=Compression(...))``.

Runs at the suite's stage (3, and 2 and 1 in their passes). Each step of a compressed run is
checked against what the formats promise, not against a loosened tolerance:

- forward computes with exactly the decoded bytes of every rank's shard: the full parameters
  a module sees in forward equal, bit for bit, the shards' exact values (read with
  ``full_state_dict()``) packed chunk by chunk and decoded, in the compute dtype; the same on
  every rank;
- the reduced gradient each rank's optimizer sees is within the sum of the peers' per-block
  bounds (``tests/comm/test_compression.py``) of the exact average of the ranks' gradients,
  each computed by a plain model with those decoded weights on its rank's slice of the batch;
- the optimizer's update lands exactly in the shards (master weights): after SGD's step each
  shard is its value before minus ``lr`` times the gradient it was given, and
  ``full_state_dict()`` reads those exact values, never decoded ones;
- with mixed precision, with hybrid sharding (replicas stay identical), under ``no_sync``
  (nothing is reduced inside; the accumulated gradient is reduced once, within its bound),
  with the disk tier and with the host tier (a ``HostHome`` on the CPU);
- without the option, and with ``Compression()``, training is bit for bit what it was;
- ``comm_stats`` counts the packed bytes: exactly ``nbytes / (4 n)`` of a float32 run's;
- bad options are refused with errors that name the fix, before any collective, on every rank.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/engine/test_compression.py -q``
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from shardwrap import Compression, MixedPrecision, Offload, ShardedGradScaler, ShardedModule
from shardwrap.comm.quantize import Codec
from shardwrap.engine.shards.flat_group import FlatGroup
from shardwrap.engine.wrap import sharded_module
from shardwrap.tiers.home import Home, HostHome
from tests.support.compression import (
    block_bound,
    capture,
    decoded_params,
    flat,
    groups,
    train_checked,
)
from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, Block, Branch, Branchy, make_batch
from tests.support.ranks import run_ranks

STEPS = 3
INT8 = Compression(params="int8", grads="int8", block=64)


def _gpt() -> GPT:
    """Build before ``run_ranks``: ranks as threads share the default generator."""
    torch.manual_seed(0)
    return GPT(depth=2)


MODEL = _gpt()


def _train(rank: int, world: int, group: Any, compression: Compression, **kwargs: Any) -> Any:
    return train_checked(MODEL, rank, world, group, compression, **kwargs)


def test_int8_params_and_grads_with_error_feedback() -> None:
    run_ranks(2, lambda rank, pg: _train(rank, 2, pg, INT8, check_grads="first"), timeout=30.0)


def test_fp8_params_and_int4_grads_without_error_feedback() -> None:
    c = Compression(params="fp8", grads="int4", error_feedback=False, block=32)
    run_ranks(3, lambda rank, pg: _train(rank, 3, pg, c), timeout=30.0)


def test_mixed_precision_computes_with_decoded_values_in_bf16() -> None:
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    c = Compression(params="int8")
    run_ranks(
        2,
        lambda rank, pg: _train(rank, 2, pg, c, check_grads=False, mixed_precision=mp),
        timeout=30.0,
    )


def test_hybrid_gradients_within_both_collectives_bounds_and_replicas_identical() -> None:
    c = Compression(params="int8", grads="int8", error_feedback=True, block=64)
    results = run_ranks(
        4, lambda rank, pg: _train(rank, 4, hybrid_mesh(pg), c, check_grads="first"), timeout=30.0
    )
    for masters in results[1:]:
        assert masters.keys() == results[0].keys()
        for k, v in masters.items():
            assert torch.equal(v, results[0][k]), k


def test_an_fp16_overflow_reaches_the_scaler_and_leaves_the_residuals_finite() -> None:
    fp16 = MixedPrecision(param_dtype=torch.float16)

    def fn(rank: int, pg: ProcessGroup) -> list[float]:
        m = ShardedModule(
            copy.deepcopy(MODEL),
            process_group=pg,
            auto_wrap=Block,
            mixed_precision=fp16,
            compression=Compression(grads="int8"),
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        scaler = ShardedGradScaler("cpu", init_scale=2.0**40, process_group=pg)
        x, y = make_batch(seed=0, batch=4)
        scales = []
        for _ in range(2):  # an overflowing scale, then (backed off) one that fits
            before = [p.detach().clone() for p in m.parameters()]
            scaler.scale(m(x.chunk(2)[rank], y.chunk(2)[rank])).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            changed = not all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
            assert changed == bool(scales)  # the first step skipped, the second taken
            residuals = m._shardwrap_root.reductions.residuals
            assert all(r is not None and torch.isfinite(r).all() for r in residuals)
            scales.append(scaler.get_scale())
            scaler.update(2.0**10)
        return scales

    assert run_ranks(2, fn, timeout=30.0) == [[2.0**39, 2.0**10]] * 2


def test_no_sync_reduces_the_accumulated_gradient_once() -> None:
    c = Compression(grads="int8", block=64)
    model = MODEL

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), process_group=pg, auto_wrap=Block, compression=c)
        micro = [make_batch(seed=s, batch=4) for s in range(2)]
        with m.no_sync():
            m(micro[0][0].chunk(2)[rank], micro[0][1].chunk(2)[rank]).backward()
        assert m.comm_stats.calls.get("reduce_scatter", 0) == 0
        assert all(r is None for r in m._shardwrap_root.reductions.residuals)
        m(micro[1][0].chunk(2)[rank], micro[1][1].chunk(2)[rank]).backward()
        trainable = sum(g.requires_grad for g in groups(m))
        assert m.comm_stats.calls["reduce_scatter"] == trainable
        # the plain model accumulates both micro-batches' gradients: one "slice" of each rank
        plain = copy.deepcopy(model)
        per_rank = []
        for q in range(2):
            plain.zero_grad()
            for x, y in micro:
                plain(x.chunk(2)[q], y.chunk(2)[q]).backward()
            per_rank.append({k: p.grad.clone() for k, p in plain.named_parameters()})
        codec = m._shardwrap_root.reductions.codec
        for g in groups(m):
            fulls = [flat(grads, g) for grads in per_rank]
            n = g.shard.numel()
            own = slice(rank * n, (rank + 1) * n)
            exact = (fulls[0][own] + fulls[1][own]) / 2
            limit = block_bound(fulls[1 - rank][own], codec) / 2 + 1e-6 * exact.abs() + 1e-7
            got = torch.zeros(n)
            for pc, p in zip(g.pieces, g.shard_params):
                got[pc.shard_offset : pc.shard_offset + pc.numel] = p.grad.reshape(-1)
            assert ((got - exact).abs() <= limit).all()

    run_ranks(2, fn, timeout=30.0)


@pytest.mark.stage3  # the disk tier is a stage-3 feature
def test_disk_tier(tmp_path: Path) -> None:
    run_ranks(
        2,
        lambda rank, pg: _train(
            rank, 2, pg, INT8, check_grads="first", offload=Offload(path=tmp_path)
        ),
        timeout=30.0,
    )


def test_host_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    # Offload(device="cpu") on the CPU gets the host tier, which the library keeps for GPUs:
    # shards and landed gradients in host memory, gathers from a staged copy
    made: list[HostHome] = []

    def staged(offload: Offload | None, device: torch.device, rank: int) -> Home:
        made.append(HostHome(device))
        return made[-1]

    monkeypatch.setattr(sharded_module, "make_home", staged)
    cpu = Offload(device="cpu")
    run_ranks(
        2,
        lambda rank, pg: _train(rank, 2, pg, INT8, check_grads="first", offload=cpu),
        timeout=30.0,
    )
    assert len(made) == 2


def _plain_run(rank: int, pg: ProcessGroup, **wrap: Any) -> tuple[list[Tensor], Any, Any]:
    m = ShardedModule(copy.deepcopy(MODEL), process_group=pg, auto_wrap=Block, **wrap)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for step in range(STEPS):
        x, y = make_batch(seed=step, batch=4)
        loss = m(x.chunk(2)[rank], y.chunk(2)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return losses, m.full_state_dict(), dict(m.comm_stats.bytes)


def test_off_is_bit_for_bit_the_uncompressed_run() -> None:
    def fn(rank: int, pg: ProcessGroup) -> list[tuple[list[Tensor], Any, Any]]:
        return [
            _plain_run(rank, pg),
            _plain_run(rank, pg, compression=None),
            _plain_run(rank, pg, compression=Compression(error_feedback=False, block=8)),
        ]

    for runs in run_ranks(2, fn, timeout=30.0):
        for losses, state, nbytes in runs[1:]:
            assert all(torch.equal(a, b) for a, b in zip(losses, runs[0][0]))
            assert all(torch.equal(v, runs[0][1][k]) for k, v in state.items())
            assert nbytes == runs[0][2]


def test_comm_stats_count_the_packed_bytes() -> None:
    codec = Codec("int8", 256)

    def fn(rank: int, pg: ProcessGroup) -> None:
        def bytes_of(**wrap: Any) -> tuple[dict[str, int], dict[str, int], int]:
            m = ShardedModule(copy.deepcopy(MODEL), process_group=pg, **wrap)  # one flat group
            x, y = make_batch(seed=0, batch=4)
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
            (g,) = groups(m)
            return dict(m.comm_stats.bytes), dict(m.comm_stats.calls), g.shard.numel()

        plain, plain_calls, n = bytes_of()
        packed, calls, _ = bytes_of(compression=Compression(params="int8", grads="int8"))
        assert calls == plain_calls
        for kind in ("all_gather", "reduce_scatter"):
            assert packed[kind] * 4 * n == plain[kind] * codec.nbytes(n)
            assert packed[kind] < plain[kind] * 0.26  # a quarter, plus a scale per 256

    run_ranks(2, fn, timeout=30.0)


@pytest.mark.stage3  # no stage involved
@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"params": "int4"}, 'params must be None, "int8" or "fp8"'),
        ({"grads": "fp8"}, 'grads must be None, "int8" or "int4"'),
        ({"block": 0}, "block must be a positive int"),
        ({"block": 10**9}, "of at most 65536, got 1000000000"),
        ({"block": 256.0}, "block must be a positive int"),
        ({"error_feedback": "yes"}, "error_feedback must be True or False"),
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match="Compression") as info:
        Compression(**kwargs)
    assert words in str(info.value)


@pytest.mark.stage3  # no stage involved
def test_fp8_without_torch_support_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(torch, "float8_e4m3fn")
    with pytest.raises(ValueError, match='use params="int8"'):
        Compression(params="fp8")


def test_a_compression_of_another_type_is_refused() -> None:
    with pytest.raises(TypeError, match=r"compression=Compression\(params="):
        ShardedModule(_gpt(), compression="int8")  # type: ignore[arg-type]


def test_ranks_that_disagree_are_refused_on_every_rank() -> None:
    def fn(rank: int, pg: ProcessGroup) -> str:
        c = INT8 if rank == 0 else None
        with pytest.raises(ValueError) as info:
            ShardedModule(copy.deepcopy(MODEL), process_group=pg, auto_wrap=Block, compression=c)
        return str(info.value)

    for message in run_ranks(2, fn, timeout=30.0):
        assert "compression" in message


@pytest.mark.stage3  # stages 1 and 2 keep every unit gathered: no rank serves apart
def test_a_unit_held_gathered_serves_a_peers_gather_in_the_compressed_format(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``shared_block`` runs twice per forward and ``branch`` on one rank only: a rank that
    holds a unit gathered serves its peer's gather into a spare buffer, on the same wire."""
    apart = []  # (bytes the served gather counted, two ranks' packed shards)
    serve = FlatGroup.gather_apart

    def counted(self: FlatGroup, stats: Any, batch: Any) -> Any:
        before = stats.bytes.get("all_gather", 0)
        done = serve(self, stats, batch)  # a quantized gather goes out on its own, now
        n = self.shard.numel()
        apart.append((stats.bytes["all_gather"] - before, self.codec.nbytes(n) * 2))
        return done

    monkeypatch.setattr(FlatGroup, "gather_apart", counted)
    torch.manual_seed(0)
    model = Branchy()
    x = torch.randn(2, 3, 11)
    x[0], x[1] = x[0].abs(), -x[1].abs()  # rank 0 runs the branch, rank 1 skips it

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Branch, process_group=pg, compression=INT8
        )
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(STEPS):
            m(x[rank]).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return m.full_state_dict()

    first, second = run_ranks(2, fn, timeout=30.0)
    assert apart and all(sent == packed for sent, packed in apart)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


@pytest.mark.stage3  # stages 1 and 2 gather once a step: nothing to reuse
def test_backward_sends_the_shard_forward_packed_and_a_step_packs_it_afresh(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward and backward gather every unit at stage 3; the shard is packed for the first and
    the same bytes sent again by the second. A write the version counter misses (``.data``,
    as some optimizers make) is still gathered by the next forward: backward's end drops the
    packed shards."""
    packs: list[int] = []  # addresses of the tensors packed, both ranks
    pack = Codec.pack

    def counted(self: Codec, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        packs.append(x.data_ptr())
        return pack(self, x, *args, **kwargs)

    monkeypatch.setattr(Codec, "pack", counted)

    def fn(rank: int, pg: ProcessGroup) -> list[int]:
        m = ShardedModule(copy.deepcopy(MODEL), process_group=pg, auto_wrap=Block, compression=INT8)
        seen = capture(m)
        shards = [g.shard.data_ptr() for g in groups(m)]
        gathers = 0
        for step in range(2):
            x, y = make_batch(seed=step, batch=4)
            decoded = decoded_params(m, m.full_state_dict())
            before = m.comm_stats.calls["all_gather"]
            m(x.chunk(2)[rank], y.chunk(2)[rank]).backward()
            gathers += m.comm_stats.calls["all_gather"] - before
            assert all(torch.equal(seen[k], v) for k, v in decoded.items())
            with torch.no_grad():
                for p in m.parameters():
                    p.data.mul_(0.5).add_(p.grad)
            m.zero_grad()
        assert gathers > 2 * len(shards)  # backward gathered units again
        return shards

    shards = sum(run_ranks(2, fn, timeout=30.0), [])
    assert sorted(p for p in packs if p in shards) == sorted(2 * shards)
