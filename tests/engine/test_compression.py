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
  (nothing is reduced inside; the accumulated gradient is reduced once, within its bound) and
  with the disk tier;
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
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import Compression, MixedPrecision, Offload, ShardedModule
from shardwrap.comm.quantize import Codec
from tests.support.hybrid import hybrid_mesh
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

LR = 0.05
STEPS = 3
INT8 = Compression(params="int8", grads="int8", block=64)
HALF_STEP = {"int8": 1 / 254, "int4": 1 / 14}


def _gpt() -> GPT:
    """Build before ``run_ranks``: ranks as threads share the default generator."""
    torch.manual_seed(0)
    return GPT(depth=2)


MODEL = _gpt()


def _groups(m: nn.Module) -> list[Any]:
    return [g for u in m._shardwrap_root.units for g in u.groups]


def _flat(values: dict[str, Tensor], g: Any) -> Tensor:
    """A group's flat buffer (float32, padded) from per-parameter ``values``."""
    flat = torch.zeros(g.layout.padded_numel)
    for name, offset, n in zip(g.names, g.layout.offsets, g.layout.numels):
        flat[offset : offset + n] = values[name].reshape(-1).float()
    return flat


def _decoded(m: nn.Module, masters: dict[str, Tensor]) -> dict[str, Tensor]:
    """What every rank should compute with: each shard of the exact masters packed and
    decoded (float32)."""
    out = {}
    for g in _groups(m):
        flat, world = _flat(masters, g), g.mesh.shard_size
        n = flat.numel() // world
        if g.codec is not None:
            flat = torch.cat([g.codec.round_trip(flat[r * n : (r + 1) * n]) for r in range(world)])
        for name, offset, k, shape in zip(g.names, g.layout.offsets, g.layout.numels, g.shapes):
            out[name] = flat[offset : offset + k].view(shape)
    return out


def _capture(m: nn.Module) -> dict[str, Tensor]:
    """Record the full parameters modules see in forward, by canonical name."""
    seen: dict[str, Tensor] = {}
    for g in _groups(m):
        for name, slots in zip(g.names, g.slots):
            module, attr = slots[0]

            def hook(mod: nn.Module, args: Any, name: str = name, attr: str = attr) -> None:
                seen[name] = getattr(mod, attr).detach().clone()

            module.register_forward_pre_hook(hook)
    return seen


def _block_bound(x: Tensor, codec: Codec) -> Tensor:
    n = x.numel()
    pad = codec.blocks(n) * codec.block - n
    m = torch.nn.functional.pad(x.abs(), (0, pad)).view(-1, codec.block).amax(1)
    return m.repeat_interleave(codec.block)[:n] * (HALF_STEP[codec.fmt] + 1e-6)


def _check_grads(
    m: nn.Module, plain: nn.Module, decoded: dict[str, Tensor], slices: list[Any], codec: Codec
) -> None:
    """This rank's reduced shard gradient against the exact average of the ranks' gradients,
    each made by ``plain`` with the decoded weights on its rank's slice."""
    plain.load_state_dict({k: decoded.get(k, v) for k, v in plain.state_dict().items()})
    per_rank = []
    for x, y in slices:
        plain.zero_grad()
        plain(x, y).backward()
        per_rank.append({k: p.grad.clone() for k, p in plain.named_parameters()})
    world = len(slices)
    for g in _groups(m):
        if not g.requires_grad:
            continue
        fulls = [_flat(grads, g) for grads in per_rank]
        n, rank = g.shard.numel(), g.mesh.shard_rank
        own = slice(rank * n, (rank + 1) * n)
        exact = torch.stack([f[own] for f in fulls]).mean(0)
        limit = sum(_block_bound(f[own], codec) for q, f in enumerate(fulls) if q != rank)
        limit = limit / world + 1e-6 * exact.abs() + 1e-7
        for pc, p in zip(g.pieces, g.shard_params):
            got = p.grad.reshape(-1)
            want = exact[pc.shard_offset : pc.shard_offset + pc.numel]
            assert ((got - want).abs() <= limit[pc.shard_offset : pc.shard_offset + pc.numel]).all()


def _train(
    rank: int,
    world: int,
    group: Any,
    compression: Compression,
    check_grads: bool | str = True,
    **wrap: Any,
) -> dict[str, Tensor]:
    """Train a compressed copy for ``STEPS`` steps checking every step (see the module
    docstring); ``check_grads``: at every step, ``"first"`` only (error feedback then carries
    residuals the plain gradients know nothing of), or not at all. Returns the final masters."""
    model = MODEL
    m = ShardedModule(
        copy.deepcopy(model), process_group=group, auto_wrap=Block, compression=compression, **wrap
    )
    seen = _capture(m)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    codec = m._shardwrap_root.reductions.codec
    plain = copy.deepcopy(model)  # this rank's own: ranks are threads
    for step in range(STEPS):
        x, y = make_batch(seed=step, batch=2 * world)
        slices = list(zip(x.chunk(world), y.chunk(world)))
        masters = m.full_state_dict()
        decoded = _decoded(m, masters)
        seen.clear()
        shards = [p.detach().clone() for p in m.parameters()]
        m(*slices[rank]).backward()
        # the gathers for compute left the shards as the optimizer left them
        assert all(torch.equal(p.detach(), s) for p, s in zip(m.parameters(), shards))
        assert seen.keys() == decoded.keys()
        for name, value in seen.items():
            assert torch.equal(value, decoded[name].to(value.dtype)), name
        if check_grads is True or (check_grads == "first" and step == 0):
            _check_grads(m, plain, decoded, slices, codec)
        before = [(p.detach().clone(), p.grad.clone()) for p in m.parameters()]
        opt.step()
        for p, (value, grad) in zip(m.parameters(), before):
            assert torch.equal(p.detach(), value.add(grad, alpha=-LR))
        opt.zero_grad()
    masters = m.full_state_dict()
    for g in _groups(m):  # the masters are the shards, not what forward computed with
        if g.codec is not None:
            assert not torch.equal(_flat(masters, g), _flat(_decoded(m, masters), g))
    return masters


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


def test_hybrid_replicas_stay_identical() -> None:
    c = Compression(params="int8", grads="int8", error_feedback=True, block=64)
    results = run_ranks(
        4, lambda rank, pg: _train(rank, 4, hybrid_mesh(pg), c, check_grads=False), timeout=30.0
    )
    for masters in results[1:]:
        assert masters.keys() == results[0].keys()
        for k, v in masters.items():
            assert torch.equal(v, results[0][k]), k


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
        trainable = sum(g.requires_grad for g in _groups(m))
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
        for g in _groups(m):
            fulls = [_flat(grads, g) for grads in per_rank]
            n = g.shard.numel()
            own = slice(rank * n, (rank + 1) * n)
            exact = (fulls[0][own] + fulls[1][own]) / 2
            limit = _block_bound(fulls[1 - rank][own], codec) / 2 + 1e-6 * exact.abs() + 1e-7
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
            (g,) = _groups(m)
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
