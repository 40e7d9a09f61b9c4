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
still reaches whoever checks for one (the loss scaler).

On the CPU both directions work a cache-sized chunk of blocks at a time (``_CPU_CHUNK``),
reading the input in place: each elementwise pass then runs over data already in cache instead
of the whole tensor in memory, and the results are those of whole-tensor operations bit for bit
(every operation is per element or per block).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["Codec"]

_QMAX = {"int8": 127.0, "int4": 7.0, "fp8": 448.0}
# Elements a CPU chunk of pack and unpack covers: its two float32 temporaries (1 MiB) stay in
# L2 cache; measured against 2^13 to 2^17 (one thread, 25M elements: pack 0.13 s -> 0.015 s).
_CPU_CHUNK = 1 << 17


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

    def pack(self, x: Tensor, out: Tensor | None = None, residual: Tensor | None = None) -> Tensor:
        """``x`` (1-D, floating point) packed into ``out`` (1-D ``uint8`` of ``nbytes``); ``x``
        is not modified.

        With ``residual`` (1-D, shaped like ``x``; error feedback) what is packed is
        ``x + residual``, added in ``x``'s dtype, and ``residual`` then receives
        ``x + residual - unpack(out)``, in float32 and zero where not finite: the new
        quantization error, found while the chunk it comes from is still in cache.
        """
        n = x.numel()
        if out is None:
            out = torch.empty(self.nbytes(n), dtype=torch.uint8, device=x.device)
        nb = self.blocks(n)
        if n == 0:
            return out
        scales = out[: 4 * nb].view(torch.float32)
        codes = out[4 * nb : 4 * nb + self.code_bytes(n)]
        # Whole blocks are read from ``x`` in place, a chunk at a time; the rest is padded with
        # zeros (int4 codes of an odd block size share bytes across blocks: all padded at once).
        whole = 0 if self.fmt == "int4" and self.block % 2 else n // self.block
        step = self._rows_per_chunk(x, nb)
        work = torch.empty(min(whole, step) * self.block, dtype=torch.float32, device=x.device)
        # float32 input is read in place, added to a float32 residual in place; the rest is
        # staged in float32 a chunk at a time
        fp32 = x.dtype == torch.float32 and (residual is None or residual.dtype == x.dtype)
        staged = not (fp32 and x.is_contiguous())
        stage = torch.empty_like(work) if staged else None
        for r in range(0, whole, step):
            rows = min(step, whole - r)
            a, b = r * self.block, (r + rows) * self.block
            part = None if residual is None else residual[a:b]
            src = _sent(x[a:b], part, None if stage is None else stage[: b - a])
            self._pack_rows(src, scales[r : r + rows], codes, a, work[: b - a], part, b - a)
        if whole < nb:
            a = whole * self.block
            tail = x.new_zeros((nb - whole) * self.block, dtype=torch.float32)
            part = None if residual is None else residual[a:]
            tail[: n - a].copy_(_sent(x[a:], part, None))
            self._pack_rows(tail, scales[whole:], codes, a, torch.empty_like(tail), part, n - a)
        if out.numel() > 4 * nb + codes.numel():
            out[4 * nb + codes.numel() :].zero_()
        return out

    def unpack(self, packed: Tensor, n: int, out: Tensor | None = None) -> Tensor:
        """The ``n`` values of ``packed`` (1-D ``uint8``, as :meth:`pack` made it), decoded in
        float32 and written into ``out`` (1-D contiguous, ``n`` elements, any floating dtype;
        a narrower one receives the float32 values rounded once) or returned as a new float32
        tensor."""
        if out is None:
            out = torch.empty(n, dtype=torch.float32, device=packed.device)
        if n == 0:
            return out
        nb = self.blocks(n)
        scales = packed[: 4 * nb].view(torch.float32)
        codes = packed[4 * nb : 4 * nb + self.code_bytes(n)]
        step = self._rows_per_chunk(out, nb)
        for r in range(0, nb, step):
            a, b = r * self.block, min(n, (r + step) * self.block)
            mine = codes[a // 2 : (b + 1) // 2] if self.fmt == "int4" else codes[a:b]
            self._decode(mine, scales[r : r + step], out[a:b])
        return out

    def _rows_per_chunk(self, t: Tensor, nb: int) -> int:
        """Blocks handled at once: on the CPU few enough that a chunk's float32 temporaries stay
        in cache, so that each pass over them costs little; elsewhere (one kernel a pass) all.
        int4 codes of an odd block size share a byte across blocks: all of them at once."""
        if t.device.type != "cpu" or (self.fmt == "int4" and self.block % 2):
            return nb
        return max(1, _CPU_CHUNK // self.block)

    def _pack_rows(
        self,
        src: Tensor,
        scales: Tensor,
        codes: Tensor,
        a: int,
        work: Tensor,
        residual: Tensor | None,
        count: int,
    ) -> None:
        """Pack ``src`` (1-D float32 of whole blocks; its first ``count`` values are elements
        ``a`` onwards of the input, the rest zero padding): its scales into ``scales``, its
        codes into their place in ``codes``, the error into ``residual`` (``count`` elements)
        if given. ``work`` is float32 scratch shaped like ``src``."""
        blocks = src.view(scales.numel(), self.block)
        scaled = work.view_as(blocks)
        torch.amax(torch.abs(blocks, out=scaled), dim=1, out=scales)
        # by a tensor on the device: CUDA divides by a Python number as a multiplication by its
        # reciprocal, a bit off for some scales, and the bytes would differ from the CPU's
        scales.div_(scales.new_full((), self.qmax))
        # a zero block divides by 1 and stays zero; a non-finite scale stays non-finite
        divisor = torch.where(scales == 0, torch.ones_like(scales), scales)
        scaled = torch.div(blocks, divisor[:, None], out=scaled).view(-1)
        if self.fmt == "fp8":
            mine = codes[a : a + count]
            mine.view(torch.float8_e4m3fn).copy_(scaled[:count].clamp_(-448, 448))
        elif self.fmt == "int8":
            mine = codes[a : a + count]
            mine.view(torch.int8).copy_(scaled[:count].round_().clamp_(-127, 127))
        else:
            q = scaled.round_().clamp_(-7, 7).add_(8).to(torch.uint8)
            q[count:] = 8  # the padding's codes, an odd tail's missing half included
            if count % 2 and q.numel() == count:
                q = torch.cat([q, q.new_full((1,), 8)])
            pairs = q[: count + count % 2].view(-1, 2)
            mine = codes[a // 2 : a // 2 + pairs.shape[0]]
            torch.bitwise_or(pairs[:, 0], pairs[:, 1] << 4, out=mine)
        if residual is not None:
            decoded = self._decode(mine, scales, work[:count])
            torch.sub(src[:count], decoded, out=decoded)
            residual.copy_(decoded.nan_to_num_(0.0, 0.0, 0.0))

    def _decode(self, codes: Tensor, scales: Tensor, out: Tensor) -> Tensor:
        """``out.numel()`` values of consecutive blocks from their ``codes`` and ``scales``,
        decoded in float32 (``q * s``) into ``out``."""
        count = out.numel()
        if self.fmt == "int8":
            q = codes.view(torch.int8)  # promoted to float32 by the product itself
        elif self.fmt == "fp8":
            q = codes.view(torch.float8_e4m3fn).float()
        else:
            q = torch.stack([codes & 15, codes >> 4], dim=1).view(-1)[:count].float().sub_(8)
        m = count // self.block * self.block
        if m:
            rows = (m // self.block, self.block)
            torch.mul(q[:m].view(rows), scales[: rows[0], None], out=out[:m].view(rows))
        if m < count:
            out[m:].copy_(q[m:count].float().mul_(scales[m // self.block]))
        return out

    def round_trip(self, x: Tensor) -> Tensor:
        """``x`` as a peer decodes it: ``unpack(pack(x))``, in float32."""
        return self.unpack(self.pack(x), x.numel())


def _sent(x: Tensor, residual: Tensor | None, out: Tensor | None) -> Tensor:
    """What is packed: ``x + residual`` (``x`` where ``residual`` is ``None``), added in
    ``x``'s dtype; into ``residual`` itself where both are float32 (it receives the error
    next), else into ``out`` (float32, shaped like ``x``) where given."""
    if residual is not None:
        if x.dtype == residual.dtype == torch.float32:
            x = residual.add_(x)
        else:
            x = torch.add(x, residual).to(x.dtype)
    return x if out is None else out.copy_(x)
