"""Blockwise quantization: the wire formats of compressed gathers and reductions.

Design note. A 1-D tensor of ``n`` elements is cut into blocks of ``block`` elements (the last
one shorter); each block is sent as codes scaled by the block's largest magnitude, one float32
scale per block. A block of zeros has scale 0 and decodes to zeros. The packed form is one
``uint8`` buffer, so a single collective moves codes and scales together:

    [ scales: float32 x ceil(n / block) | codes | padding to a multiple of 4 bytes ]

Scales come first and every packed size is a multiple of 4, so in a buffer of several packed
payloads back to back each payload's scales can be read in place as float32.

Formats (``q`` the code, ``s`` the block's scale, ``m`` its largest magnitude):

======  =========================  ==============================  ===========================
format  code                       scale                           error per element
======  =========================  ==============================  ===========================
int8    round(x / s) in [-127,127]  m / 127                         at most s / 2 = m / 254
int4    round(x / s) in [-7, 7],    m / 7                           at most s / 2 = m / 14
        two codes a byte
fp8     x / s as float8_e4m3fn      m / 448 (e4m3's largest value)  at most 2^-4 |x| + 2^-10 s
======  =========================  ==============================  ===========================

Decoding is ``q * s`` in float32, the same operations on every rank, so ranks that decode the
same bytes get the same values bit for bit. A non-finite value makes its block's scale
non-finite and the whole block decodes to non-finite values (NaN or infinities), so an overflow
still reaches whoever checks for one (``ShardedGradScaler``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Codec"]

_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}


class Codec:
    """One blockwise format: packs a 1-D tensor into bytes and decodes them.

    Args:
        fmt: ``"int8"``, ``"int4"`` or ``"fp8"``.
        block: elements per scale.
    """

    def __init__(self, fmt: str, block: int) -> None:
        if fmt not in _QMAX:
            raise ValueError(f"unknown quantization format {fmt!r}; use int8, int4 or fp8")
        self.fmt = fmt
        self.block = block
        self.qmax = _QMAX[fmt]

    def __repr__(self) -> str:
        return f"Codec({self.fmt!r}, block={self.block})"

    def blocks(self, n: int) -> int:
        return -(-n // self.block)

    def code_bytes(self, n: int) -> int:
        return (n + 1) // 2 if self.fmt == "int4" else n

    def nbytes(self, n: int) -> int:
        """Bytes of the packed form of ``n`` elements (a multiple of 4)."""
        raw = 4 * self.blocks(n) + self.code_bytes(n)
        return -(-raw // 4) * 4

    def pack(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        """``x`` (1-D, floating point) packed into ``out`` (1-D ``uint8`` of ``nbytes``)."""
        n = x.numel()
        if out is None:
            out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        nb = self.blocks(n)
        if n == 0:
            return out
        scales = out[: 4 * nb].view(torch.float32)
        codes = out[4 * nb : 4 * nb + self.code_bytes(n)]
        padded = x.new_zeros(nb * self.block, dtype=torch.float32)
        padded[:n].copy_(x)
        blocks = padded.view(nb, self.block)
        torch.amax(blocks.abs(), dim=1, out=scales)
        scales.div_(self.qmax)
        # a zero block divides by 1 and stays zero; a non-finite scale stays non-finite
        divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
        scaled = blocks.div_(divisor[:, None]).view(-1)[:n]
        if self.fmt == "fp8":
            codes.view(torch.float8_e4m3fn).copy_(scaled.clamp_(-448, 448))
        elif self.fmt == "int8":
            codes.view(torch.int8).copy_(scaled.round_().clamp_(-127, 127))
        else:
            q = scaled.round_().clamp_(-7, 7).add_(8).to(torch.uint8)
            if n % 2:
                q = torch.cat([q, q.new_full((1,), 8)])
            pairs = q.view(-1, 2)
            torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=codes)
        if out.numel() > 4 * nb + codes.numel():
            out[4 * nb + codes.numel() :].zero_()
        return out

    def unpack(self, packed: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        """The ``n`` values of ``packed`` (1-D ``uint8``, as :meth:`pack` made it), decoded in
        float32 and written into ``out`` (1-D, ``n`` elements, any floating dtype) or returned
        as a new float32 tensor."""
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=packed.device)
        if n == 0:
            return out
        nb = self.blocks(n)
        scales = packed[: 4 * nb].view(torch.float32)
        codes = packed[4 * nb : 4 * nb + self.code_bytes(n)]
        if self.fmt == "fp8":
            q = codes.view(torch.float8_e4m3fn).float()
        elif self.fmt == "int8":
            q = codes.view(torch.int8).float()
        else:
            q = torch.stack([codes & 15, codes >> 4], dim=1).view(-1)[:n].float().sub_(8)
        whole = (n // self.block) * self.block
        if whole:
            full = q[:whole].view(-1, self.block).mul_(scales[: whole // self.block, None])
            out[:whole].copy_(full.view(-1))
        if whole < n:
            out[whole:].copy_(q[whole:].mul_(scales[-1]))
        return out

    def round_trip(self, x: Tensor) -> Tensor:
        """``x`` as a peer decodes it: ``unpack(pack(x))``, in float32."""
        return self.unpack(self.pack(x), x.numel())
