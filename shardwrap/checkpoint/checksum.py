"""Content checksums of stored pieces: computed while a checkpoint is written, checked on load.

Design note. A checksum here is Fletcher's two running sums, taken not over bytes but over
blocks of 64 MiB: each block contributes the wrapping sum of its 64-bit little-endian words
(the last word zero-padded). Summing words is what memory does fastest (about 30 GB/s on one
core, where ``zlib.crc32`` manages 6), so a load can afford to check every piece it reads;
the second sum makes the order of blocks count. It catches flipped, zeroed or overwritten
bytes and a tensor read with another dtype; it is not a cryptographic hash and does not
defend against a file crafted to pass it.
"""

from __future__ import annotations

import mmap
import warnings
from typing import Any

import torch
from torch import Tensor

__all__ = ["BLOCK", "Checksum", "buffer_checksum", "tensor_checksum"]

BLOCK = 1 << 26  # bytes per block: also the size of the writer's copies to the host
_MASK = (1 << 64) - 1


class Checksum:
    """The running checksum of one byte stream, fed block by block."""

    def __init__(self) -> None:
        self._a = 0
        self._b = 0

    def add(self, block: Tensor) -> None:
        """Add the next block: 1-D ``uint8`` on the CPU, 8-byte aligned, at most ``BLOCK``
        bytes (only the stream's last block may be shorter)."""
        body = block.numel() // 8 * 8
        words = block[:body].view(torch.int64) if body else None
        self.add_words(words, bytes(block[body:].tolist()))

    def add_words(self, words: Tensor | None, tail: bytes) -> None:
        """Add the next block given as its 64-bit words and the bytes after the last whole
        word (fewer than 8, zero-padded into one more word)."""
        total = int(words.sum()) if words is not None else 0
        total += int.from_bytes(tail, "little")
        self._a = (self._a + total) & _MASK
        self._b = (self._b + self._a) & _MASK

    def hexdigest(self) -> str:
        return f"{self._a:016x}{self._b:016x}"


def tensor_checksum(t: Tensor) -> str | None:
    """The checksum of a contiguous tensor's bytes as stored, or ``None`` where its memory is
    not 8-byte aligned (then only a read of the stored bytes can check them)."""
    data = t.detach().reshape(-1).view(torch.uint8)
    if data.numel() and data.data_ptr() % 8:
        return None
    digest = Checksum()
    for at in range(0, data.numel(), BLOCK):
        digest.add(data[at : at + BLOCK])
    return digest.hexdigest()


def buffer_checksum(buffer: bytes | mmap.mmap | Any, offset: int = 0, nbytes: int = -1) -> str:
    """The checksum of ``nbytes`` bytes of ``buffer`` from ``offset``, read in place."""
    if nbytes < 0:
        nbytes = len(buffer) - offset
    digest = Checksum()
    for at in range(0, nbytes, BLOCK):
        n = min(BLOCK, nbytes - at)
        body = n // 8 * 8
        words = (
            torch.frombuffer(buffer, dtype=torch.int64, count=body // 8, offset=offset + at)
            if body
            else None
        )
        digest.add_words(words, bytes(buffer[offset + at + body : offset + at + n]))
    return digest.hexdigest()


def _quiet_read_only_buffers() -> None:
    """Have torch say once, now, and to no one, that a read-only buffer (a checkpoint's bytes,
    an ``mmap`` opened for reading) makes a read-only tensor: nothing here writes to one.

    NOTE: torch warns of it once per process, so it is said here, at import, rather than
    silenced around every read: ``warnings.catch_warnings`` swaps process-wide state, and a
    background save's writer thread reading at the same time as the training thread (or two
    ranks as threads) would leave the other's warning filters swapped, dropping later warnings.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.frombuffer(bytes(8), dtype=torch.int64)


_quiet_read_only_buffers()
