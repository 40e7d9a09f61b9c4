"""The CUDA tier, compressed communication: the blockwise codecs (``comm/quantize.py``) on CUDA
tensors, where each pass is one kernel over the whole tensor instead of the CPU's cache-sized
chunks, and compressed gathers on a GPU.

Proves, for int8, int4 and fp8:

- every element decoded on the GPU is within its block's bound (int8 ``m / 254``, int4
  ``m / 14``, fp8 ``2^-4 |x| + 2^-10 m / 448``, ``m`` the block's largest magnitude), a block
  of zeros decodes to zeros, a non-finite value makes its block, and only its block,
  non-finite;
- the GPU packs the same bytes as the CPU and decodes the same values, with error feedback's
  residual too (every operation is per element or per block, in IEEE arithmetic on both);
- a compressed gather computes with the decoded weights: forward equals the plain model's on
  the same GPU with every shard packed and decoded, and the shards stay exact, at world size
  1 and over NCCL's default group of one rank.

Run: ``.venv/bin/python -m pytest -m gpu tests/tiers/test_gpu_codecs.py -q -ra``
"""

from __future__ import annotations

import copy
from contextlib import AbstractContextManager, nullcontext

import pytest
import torch
from torch import Tensor

from shardwrap import Compression, ShardedModule
from shardwrap.comm.quantize import Codec
from tests.support.compression import element_bound, flat, groups
from tests.support.cuda import NEEDS_CUDA, cpu, gpu, nccl_world
from tests.support.models import GPT, Block, make_batch

pytestmark = [pytest.mark.gpu, pytest.mark.stage3, NEEDS_CUDA]  # no stage involved

FORMATS = ["int8", "int4", "fp8"]
BLOCK = 256


def _data(n: int, seed: int) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes that vary by orders between elements and blocks, a block of zeros
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    x[BLOCK : 2 * BLOCK] = 0
    return x


def check_within_bound(fmt: str, device: torch.device) -> None:
    codec = Codec(fmt, BLOCK)
    x = _data(5 * BLOCK + 37, 0).to(device)  # a partial last block
    decoded = codec.round_trip(x)
    assert decoded.device == device
    assert ((decoded - x).abs() <= element_bound(x, codec)).all()
    assert torch.equal(decoded[BLOCK : 2 * BLOCK], torch.zeros(BLOCK, device=device))
    x[3 * BLOCK + 5] = float("inf")
    decoded = codec.round_trip(x)
    poisoned = torch.zeros_like(x, dtype=torch.bool)
    poisoned[3 * BLOCK : 4 * BLOCK] = True
    assert not torch.isfinite(decoded[poisoned]).any()
    assert torch.isfinite(decoded[~poisoned]).all()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decoded_values_are_within_their_blocks_bound(fmt: str) -> None:
    check_within_bound(fmt, gpu())


def check_as_on_the_cpu(fmt: str, device: torch.device) -> None:
    codec = Codec(fmt, BLOCK)
    x = _data(9 * BLOCK + 101, 1)
    residual = torch.randn(x.numel(), generator=torch.Generator().manual_seed(2)) * 0.01
    here, there = residual.clone(), residual.to(device)
    on_cpu, on_gpu = codec.pack(x, residual=here), codec.pack(x.to(device), residual=there)
    first = (on_cpu != on_gpu.cpu()).nonzero()
    assert first.numel() == 0, f"{fmt}: packed bytes differ from byte {first[0].item()} on"
    assert torch.equal(here, there.cpu()), f"{fmt}: error feedback's residuals differ"
    n = x.numel()
    assert torch.equal(codec.unpack(on_cpu, n), codec.unpack(on_gpu, n).cpu())


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_gpu_packs_and_decodes_as_the_cpu_does(fmt: str) -> None:
    check_as_on_the_cpu(fmt, gpu())


def check_compressed_forward(device: torch.device, world: AbstractContextManager) -> None:
    """A compressed gather still decodes this rank's own shard: forward equals the plain
    model's with every parameter packed and decoded, and the shards stay exact."""
    torch.manual_seed(0)
    model = GPT().to(device)
    codec = Codec("int8", BLOCK)
    ref = copy.deepcopy(model)
    with world:
        m = ShardedModule(
            copy.deepcopy(model), auto_wrap=Block, compression=Compression(params="int8")
        )
        x, y = (t.to(device) for t in make_batch(0, 4))
        got = m(x, y)
        exact = m.full_state_dict()
        torch.testing.assert_close(exact, cpu(model.state_dict()), atol=0, rtol=0)
        for g in groups(m):
            full = flat(exact, g).to(device)
            decoded = torch.cat([codec.round_trip(part) for part in full.chunk(g.mesh.shard_size)])
            with torch.no_grad():
                for name, offset, n in zip(g.names, g.layout.offsets, g.layout.numels):
                    param = ref.get_parameter(name)
                    param.copy_(decoded[offset : offset + n].view_as(param))
        torch.testing.assert_close(got, ref(x, y), atol=0, rtol=0)


def test_compressed_gathers_on_a_gpu_compute_with_the_decoded_weights() -> None:
    check_compressed_forward(gpu(), nullcontext())


def test_compressed_gathers_over_nccl_compute_with_the_decoded_weights() -> None:
    check_compressed_forward(gpu(), nccl_world())
