"""Compressed collectives: the gather, the reduce-scatter and the replicas' all-reduce, sending
blockwise-quantized payloads (``comm/quantize.py``) instead of the tensors themselves.

Design note. Each collective packs what a rank sends into one ``uint8`` buffer per destination
(codes and their scales together) and moves it with the plain collectives of
``collectives.py``; the receiver decodes. The three differ in what must stay exact and what
must agree across ranks:

1. :func:`all_gather_quantized`: every rank's shard is packed, gathered, and every slot of the
   output, this rank's own included, is decoded from the gathered bytes, so every rank holds
   the same values bit for bit and computes identically (using its own exact shard would make
   ranks' weights differ by the quantization error). The shard itself is not touched.
2. :func:`reduce_scatter_quantized`: the flat gradient's chunk for each peer is packed and
   sent with one all-to-all; this rank's own chunk never leaves it and is added exactly. The
   received chunks are decoded and summed in float32, then divided by the group's size as the
   plain reduce-scatter does.
3. :func:`all_reduce_quantized` (hybrid sharding, across replicas): each replica's reduced
   shard is packed and all-gathered; every replica decodes every payload, its own included,
   and sums them in the same order, so the replicas' gradients, and so their steps, stay
   identical.

Error feedback (Seide et al., 1-bit SGD, https://www.isca-archive.org/interspeech_2014/seide14_interspeech.html;
Karimireddy et al., https://arxiv.org/abs/1901.09847): with a ``residual`` each call adds it to
what it sends and keeps the new quantization error in it, so what a rank has sent over many
steps differs from the exact sum by one step's error, not by the sum of every step's. A
non-finite gradient leaves a zero residual behind (the step it poisons is skipped or fails
anyway; the next ones start clean).

``CommStats`` counts each under the kind of the exact collective it replaces ("all_gather",
"reduce_scatter", "all_reduce"), with the packed bytes (codes and scales), as the exact ones
count their tensors' bytes: fewer bytes under the same kinds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .collectives import CommStats, Group, Pending, all_gather, all_to_all, group_size
from .quantize import Codec

__all__ = ["all_gather_quantized", "all_reduce_quantized", "reduce_scatter_quantized"]


def all_gather_quantized(
    out: Tensor,
    shard: Tensor,
    group: Group,
    codec: Codec,
    stats: CommStats | None = None,
    packed: Tensor | None = None,
) -> Pending:
    """Gather every rank's ``shard`` (1-D, ``n``) into ``out`` (1-D, ``world * n``, any
    floating dtype), quantized on the wire: every slot of ``out`` is decoded, the same on every
    rank (see the note above). ``packed``: ``codec.pack(shard)`` where the caller kept it from
    an earlier gather of the same values (it is sent as it is), else ``None``."""
    world, n = group_size(group), shard.numel()
    size = codec.nbytes(n)
    if stats is not None:
        stats.add("all_gather", size * world)
    if packed is None:
        packed = codec.pack(shard)
    gathered = torch.empty(size * world, dtype=torch.uint8, device=out.device)
    work = all_gather(gathered, packed, group)

    def decode() -> None:
        for r in range(world):
            codec.unpack(gathered[r * size : (r + 1) * size], n, out[r * n : (r + 1) * n])

    return _then(work, decode, "all-gather", group)


def reduce_scatter_quantized(
    out: Tensor,
    full: Tensor,
    group: Group,
    codec: Codec,
    residual: Tensor | None = None,
    stats: CommStats | None = None,
) -> Pending:
    """Average ``full`` (1-D, ``world * n``) over ranks into ``out`` (1-D, ``n``: this rank's
    chunk), each peer's chunk quantized on the wire (see the note above).

    ``full`` is scratch, which this call may overwrite. ``residual`` (shaped like ``full``, or
    ``None`` for no error feedback) is added to what is sent (each peer's chunk as it is
    packed) and then holds this call's quantization error; its own chunk stays zero, never
    being quantized.
    """
    world, n = group_size(group), out.numel()
    size = codec.nbytes(n)
    if stats is not None:
        stats.add("reduce_scatter", size * world)
    if group is None:
        out.copy_(full)
        return Pending(None)
    rank = group.rank()
    if residual is not None:  # the peers' chunks get theirs as they are packed
        full[rank * n : (rank + 1) * n].add_(residual[rank * n : (rank + 1) * n])
    empty = torch.empty(0, dtype=torch.uint8, device=full.device)
    ins, outs = [], []
    for q in range(world):
        if q == rank or n == 0:
            ins.append(empty)
            outs.append(empty)
            continue
        error = None if residual is None else residual[q * n : (q + 1) * n]
        ins.append(codec.pack(full[q * n : (q + 1) * n], residual=error))
        outs.append(torch.empty(size, dtype=torch.uint8, device=full.device))
    work = all_to_all(outs, ins, group)

    def decode() -> None:
        total = full[rank * n : (rank + 1) * n].float()
        peer = torch.empty(n, dtype=torch.float32, device=full.device)
        for q in range(world):
            if q != rank and n:
                total += codec.unpack(outs[q], n, peer)
        out.copy_(total.div_(world))

    return _then(work, decode, "reduce-scatter", group)


def all_reduce_quantized(
    tensor: Tensor,
    group: Group,
    codec: Codec,
    residual: Tensor | None = None,
    stats: CommStats | None = None,
) -> Pending:
    """Average ``tensor`` (1-D) in place over ``group``, every rank's contribution quantized on
    the wire and decoded alike on every rank (see the note above); ``residual`` as in
    :func:`reduce_scatter_quantized`, shaped like ``tensor``."""
    world, n = group_size(group), tensor.numel()
    size = codec.nbytes(n)
    if stats is not None:
        stats.add("all_reduce", size * world)
    packed = codec.pack(tensor, residual=residual)
    gathered = torch.empty(size * world, dtype=torch.uint8, device=tensor.device)
    work = all_gather(gathered, packed, group)

    def decode() -> None:
        total = torch.zeros(n, dtype=torch.float32, device=tensor.device)
        decoded = torch.empty_like(total)
        for r in range(world):
            total += codec.unpack(gathered[r * size : (r + 1) * size], n, decoded)
        tensor.copy_(total.div_(world))

    return _then(work, decode, "all-reduce", group)


def _then(work: Pending, finish: Callable[[], None], what: str, group: Group) -> Pending:
    """``work``, then ``finish()`` once it is done."""

    def run() -> None:
        work.wait()
        finish()

    return Pending(None, run, what, group)
