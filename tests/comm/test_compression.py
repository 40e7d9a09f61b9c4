"""Compressed collectives and their wire formats (``comm/quantize.py``, ``comm/compressed.py``).

Proves, with per-block error bounds derived from the formats (int8: ``m / 254`` per element,
``m`` the block's largest magnitude; int4: ``m / 14``; fp8: ``2^-4 |x| + 2^-10 m / 448``):

- the quantizer: every element within its block's bound at sizes that fill, straddle and
  miss the block; zero blocks decode to zeros; int4's two codes a byte round-trip exactly,
  odd sizes included; packed sizes (scales and codes, a multiple of 4 bytes); a non-finite
  value makes its block, and only its block, decode to non-finite values;
- the gather: every rank holds exactly the decoded bytes of every rank's shard (identical on
  every rank, the own shard decoded too), within the bound of the exact gather, in float32 and
  bfloat16; the bytes it counts are the packed payloads;
- the reduce-scatter: within the sum of the peers' per-block bounds of the exact average (the
  own chunk exact), at 2 and 3 ranks, int8 and int4;
- the all-reduce across replicas: identical on every rank, within the bound;
- error feedback: over repeated reductions of the same gradients, the sum of what was reduced
  stays within one reduction's bound of the exact sum, while without it the error grows with
  every step (the test would fail without the residual).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/comm/test_compression.py -q``
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from shardwrap import CommStats
from shardwrap.comm.compressed import (
    all_gather_quantized,
    all_reduce_quantized,
    reduce_scatter_quantized,
)
from shardwrap.comm.quantize import Codec
from tests.support.compression import element_bound as bound
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # collectives alone: no stage involved


def _data(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes that vary by orders between elements and blocks
    return torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("n, block", [(1, 256), (255, 256), (256, 256), (257, 256), (1000, 16)])
def test_each_element_is_within_its_blocks_bound(fmt: str, n: int, block: int) -> None:
    codec = Codec(fmt, block)
    x = _data(n, seed=n)
    packed = codec.pack(x)
    assert packed.dtype == torch.uint8 and packed.numel() == codec.nbytes(n)
    assert codec.nbytes(n) % 4 == 0
    code_bytes = (n + 1) // 2 if fmt == "int4" else n
    assert codec.nbytes(n) == -(-(4 * -(-n // block) + code_bytes) // 4) * 4
    err = (codec.unpack(packed, n) - x).abs()
    assert (err <= bound(x, codec)).all(), (err - bound(x, codec)).max()
    if n > 1:  # the format does round: a bound that could not fail would prove nothing
        assert err.max() > 0


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
def test_zero_blocks_decode_to_zeros(fmt: str) -> None:
    codec = Codec(fmt, 8)
    x = torch.zeros(29)
    x[8:16] = torch.linspace(-1, 1, 8)
    y = codec.round_trip(x)
    assert torch.equal(y[:8], torch.zeros(8)) and torch.equal(y[16:], torch.zeros(13))
    assert torch.equal(codec.round_trip(torch.zeros(5)), torch.zeros(5))
    assert codec.round_trip(torch.zeros(0)).numel() == 0


@pytest.mark.parametrize("n", [1, 2, 7, 15, 16, 33])
def test_int4_codes_round_trip_exactly(n: int) -> None:
    codec = Codec("int4", 16)
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-7, 8, (n,), generator=g).float()
    x[::16] = 7.0  # each block's largest magnitude 7: scale 1, every code exact
    assert torch.equal(codec.round_trip(x), x)
    assert codec.pack(x).numel() == codec.nbytes(n)


def test_a_non_finite_value_poisons_its_block_only() -> None:
    codec = Codec("int8", 4)
    x = torch.arange(12, dtype=torch.float32)
    x[5] = float("inf")
    y = codec.round_trip(x)
    assert not torch.isfinite(y[4:8]).any()
    assert torch.isfinite(y[:4]).all() and torch.isfinite(y[8:]).all()


def _reference_pack(x: Tensor, codec: Codec) -> Tensor:
    """The format as the module docstring defines it, in plain whole-tensor operations."""
    n, nb, block = x.numel(), codec.blocks(x.numel()), codec.block
    blocks = torch.nn.functional.pad(x.float(), (0, nb * block - n)).view(nb, block)
    scales = blocks.abs().amax(1) / codec.qmax
    scaled = (blocks / torch.where(scales == 0, 1.0, scales)[:, None]).view(-1)[:n]
    if codec.fmt == "fp8":
        codes = scaled.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    elif codec.fmt == "int8":
        codes = scaled.round().clamp(-127, 127).to(torch.int8).view(torch.uint8)
    else:
        q = torch.cat([scaled.round().clamp(-7, 7).add(8), torch.full((n % 2,), 8.0)])
        q = q.to(torch.uint8).view(-1, 2)
        codes = q[:, 0] | (q[:, 1] << 4)
    raw = torch.cat([scales.view(torch.uint8), codes])
    return torch.cat([raw, torch.zeros(codec.nbytes(n) - raw.numel(), dtype=torch.uint8)])


@pytest.mark.parametrize("fmt", ["int8", "int4", "fp8"])
@pytest.mark.parametrize("block", [256, 255])
@pytest.mark.parametrize("layout", ["float32", "strided", "bfloat16"])
def test_packing_by_chunks_is_the_format_bit_for_bit(fmt: str, block: int, layout: str) -> None:
    """Pack and unpack work a cache-sized chunk at a time and read ``x`` in place: across
    chunk and block edges, with non-finite blocks, from any layout, the bytes are the format's;
    ``x`` is untouched; with a residual, ``x + residual`` is packed and the residual becomes
    its error (zero where not finite); a narrower ``out`` gets the float32 values rounded
    once."""
    codec = Codec(fmt, block)
    n = 300_001  # several chunks, and a short last block
    x = _data(2 * n, seed=block)
    x[1000:1300] = 0.0
    x[5000], x[9000] = float("inf"), float("nan")
    x = {"float32": x[:n], "strided": x[::2], "bfloat16": x[:n].bfloat16()}[layout]
    kept = x.clone()
    packed = codec.pack(x)
    assert torch.equal(packed, _reference_pack(x, codec))
    assert torch.equal(x.isnan(), kept.isnan()) and torch.equal(x.nan_to_num(), kept.nan_to_num())
    residual = (_data(n, seed=1) / 100).to(x.dtype)
    sent = x + residual
    with_residual = codec.pack(x, residual=residual)
    assert torch.equal(with_residual, _reference_pack(sent, codec))
    error = sent.float() - codec.unpack(with_residual, n)
    assert torch.equal(residual, error.nan_to_num(0.0, 0.0, 0.0).to(x.dtype))
    assert residual.abs().max() > 0 and not residual.isnan().any()
    decoded = codec.unpack(packed, n)
    narrow = codec.unpack(packed, n, torch.empty(n, dtype=torch.bfloat16))
    assert torch.equal(narrow.isnan(), decoded.isnan())
    assert torch.equal(narrow.nan_to_num(), decoded.bfloat16().nan_to_num())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_decodes_every_shard_alike_on_every_rank(world: int, dtype: torch.dtype) -> None:
    n, codec = 300, Codec("int8", 64)
    shards = [_data(n, seed=r) for r in range(world)]

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, dict[str, int]]:
        out = torch.empty(world * n, dtype=dtype)
        stats = CommStats()
        all_gather_quantized(out, shards[rank].clone(), pg, codec, stats).wait()
        return out, dict(stats.bytes)

    results = run_ranks(world, fn, timeout=20.0)
    decoded = torch.cat([codec.round_trip(s) for s in shards]).to(dtype)
    exact = torch.cat(shards)
    limit = torch.cat([bound(s, codec) for s in shards])
    for out, nbytes in results:
        assert torch.equal(out, decoded)
        if dtype == torch.float32:
            assert ((out - exact).abs() <= limit).all()
        assert nbytes == {"all_gather": world * codec.nbytes(n)}
        assert nbytes["all_gather"] < world * n * 4 / 3.5  # about a quarter of float32's


def _reduce_bound(fulls: list[Tensor], codec: Codec, world: int, n: int) -> Tensor:
    """Per element of the averaged vector: the peers' bounds, summed and averaged."""
    limit = torch.zeros(world * n)
    for owner in range(world):
        chunk = slice(owner * n, (owner + 1) * n)
        for q in range(world):
            if q != owner:
                limit[chunk] += bound(fulls[q][chunk], codec)
    return limit / world


@pytest.mark.parametrize("world, fmt", [(2, "int8"), (3, "int8"), (3, "int4")])
def test_reduce_scatter_is_within_the_peers_bounds(world: int, fmt: str) -> None:
    n, codec = 130, Codec(fmt, 32)
    fulls = [_data(world * n, seed=10 + r) for r in range(world)]

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, dict[str, int]]:
        out = torch.empty(n)
        stats = CommStats()
        reduce_scatter_quantized(out, fulls[rank].clone(), pg, codec, None, stats).wait()
        return out, dict(stats.bytes)

    results = run_ranks(world, fn, timeout=20.0)
    exact = torch.stack(fulls).mean(0)
    limit = _reduce_bound(fulls, codec, world, n)
    got = torch.cat([out for out, _ in results])
    assert ((got - exact).abs() <= limit + 1e-6 * exact.abs()).all()
    assert (got != exact).any()
    assert results[0][1] == {"reduce_scatter": world * codec.nbytes(n)}


def test_all_reduce_across_replicas_is_identical_everywhere() -> None:
    world, n, codec = 3, 200, Codec("int8", 50)
    parts = [_data(n, seed=20 + r) for r in range(world)]

    def fn(rank: int, pg: ProcessGroup) -> Tensor:
        t = parts[rank].clone()
        all_reduce_quantized(t, pg, codec).wait()
        return t

    results = run_ranks(world, fn, timeout=20.0)
    exact = torch.stack(parts).mean(0)
    limit = sum(bound(p, codec) for p in parts) / world
    for t in results:
        assert torch.equal(t, results[0])
        assert ((t - exact).abs() <= limit + 1e-6 * exact.abs()).all()


@pytest.mark.parametrize("feedback", [True, False])
def test_error_feedback_keeps_the_summed_error_at_one_steps_bound(feedback: bool) -> None:
    world, n, steps, codec = 2, 96, 8, Codec("int4", 32)
    fulls = [_data(world * n, seed=30 + r) for r in range(world)]

    def fn(rank: int, pg: ProcessGroup) -> tuple[Tensor, Tensor | None]:
        residual = torch.zeros(world * n) if feedback else None
        total = torch.zeros(n)
        for _ in range(steps):  # the same gradient every step: its rounding never averages out
            out = torch.empty(n)
            reduce_scatter_quantized(out, fulls[rank].clone(), pg, codec, residual).wait()
            total += out
        return total, residual

    results = run_ranks(world, fn, timeout=20.0)
    exact = torch.stack(fulls).mean(0) * steps
    got = torch.cat([total for total, _ in results])
    error = (got - exact).abs()
    one_step = _reduce_bound(fulls, codec, world, n)
    if feedback:
        # sum of reductions = exact sum - (peers' final residuals) / world. A residual is the
        # rounding of g + r, whose block maximum is at most m + max|r|; so max|r| <= m h / (1 - h)
        # (h = 1/14, int4's half step): one step's bound widened by 1 / (1 - h)
        assert (error <= one_step / (1 - 1 / 14) + 1e-5 * exact.abs()).all()
        for rank, (_, residual) in enumerate(results):
            own = slice(rank * n, (rank + 1) * n)
            assert torch.equal(residual[own], torch.zeros(n))  # the own chunk is never sent
    else:
        # the same bound fails: every step adds the same rounding again
        assert (error > one_step / (1 - 1 / 14) + 1e-5 * exact.abs()).any()
