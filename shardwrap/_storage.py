"""Files on disk for checkpoints and exports: streamed safetensors, atomic folders, agreement.

Design note. Every save goes through the same three moves:

1. :func:`agree` runs one phase of work on every rank and exchanges one integer per rank
   (one small all-reduce). A rank that raised reports failure, so *every* rank raises
   instead of some waiting forever in the next collective. It doubles as a barrier.
2. Files are written into a hidden temporary folder next to the target
   (``.NAME.partial``), each fsynced, then the folder itself.
3. Rank 0 renames the folder to its final name, fsyncs the parent and replaces a
   ``latest`` pointer atomically (temporary file, fsync, ``os.replace``). A save killed at
   any point before the rename leaves the previous checkpoint and pointer untouched.

:class:`SafetensorsWriter` writes the `safetensors <https://github.com/huggingface/safetensors>`_
format itself, tensor by tensor: the header is declared up front, so a file larger than
memory can be streamed one unit at a time, and views that share storage (the pieces of one
shard) need no copy.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import torch
import torch.distributed as dist
from torch import Tensor

from ._checksum import BLOCK, Checksum
from ._collectives import Group, all_reduce, group_rank, group_size

__all__ = [
    "LATEST",
    "Entry",
    "SafetensorsWriter",
    "agree",
    "begin_folder",
    "commit_folder",
    "fsync_path",
    "is_plain_name",
    "moved_aside_path",
    "restore_moved_aside",
    "surviving",
    "partial_path",
    "remove_folder",
    "tensor_nbytes",
    "write_file",
    "write_latest",
]

LATEST = "latest"
Entry = tuple[str, tuple[int, ...], torch.dtype]  # a tensor's name, shape and dtype
_CHUNK = BLOCK  # bytes copied to the host per write, one checksum block each

# torch dtype <-> safetensors dtype name.
DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``, from the shape alone."""
    numel = 1
    for s in shape:
        numel *= s
    return numel * dtype.itemsize


class SafetensorsWriter:
    """Write one safetensors file whose tensors are declared up front and then streamed.

    Call :meth:`write` once per declared tensor, then :meth:`close`; used as a context
    manager, the file is closed if an error interrupts the writing.

    Args:
        path: the file to create.
        entries: ``(key, shape, dtype)`` of every tensor, in the order :meth:`write` gets them.
        metadata: the header's string-to-string ``__metadata__``.

    Raises:
        ValueError: a written tensor that differs from its declared shape or dtype, or
            :meth:`close` before every declared tensor was written.

    After writing, ``checksums`` holds ``[dtype name, checksum]`` of every tensor by key.
    """

    def __init__(
        self,
        path: Path,
        entries: list[Entry],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.path = path
        self._entries = entries
        self._next = 0
        self.checksums: dict[str, list[str]] = {}
        header: dict[str, object] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for key, shape, dtype in entries:
            if dtype not in DTYPES:
                raise ValueError(f"'{key}': dtype {dtype} has no safetensors equivalent")
            n = tensor_nbytes(shape, dtype)
            header[key] = {
                "dtype": DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + n],
            }
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self._file = open(path, "wb")
        self._file.write(struct.pack("<Q", len(raw)) + raw)

    def write(self, tensor: Tensor) -> None:
        """Append the next declared tensor (any device; copied to CPU if needed)."""
        key, shape, dtype = self._entries[self._next]
        if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(
                f"'{key}': declared {tuple(shape)} {dtype}, "
                f"got {tuple(tensor.shape)} {tensor.dtype}"
            )
        data = tensor.detach().reshape(-1).view(torch.uint8)
        digest = Checksum()
        # NOTE: .numpy() pins a storage's size for good, so never on the caller's storage
        # (a unit's gathered buffer must stay resizable): copy bounded chunks instead.
        for at in range(0, data.numel(), _CHUNK):
            chunk = data[at : at + _CHUNK].to("cpu", copy=True)
            digest.add(chunk)
            self._file.write(chunk.numpy().data)
        self.checksums[key] = [DTYPES[dtype], digest.hexdigest()]
        self._next += 1

    def close(self) -> int:
        """Flush and fsync the file; returns its size in bytes."""
        if self._next != len(self._entries):
            missing = [k for k, _, _ in self._entries[self._next :]]
            self._file.close()
            raise ValueError(f"{self.path.name}: closed before writing {missing}")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return self.path.stat().st_size

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self._file.close()


def is_plain_name(name: object) -> bool:
    """Whether ``name`` names an entry of a folder itself: no separator, not ``.`` or ``..``.

    Files that a checkpoint, a ``latest`` pointer or an export index name must pass, so that
    nothing they name resolves outside their folder.
    """
    return (
        isinstance(name, str)
        and name not in ("", ".", "..")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
    )


def write_file(path: Path, data: bytes) -> int:
    """Write ``data`` and fsync it; returns the size in bytes."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return len(data)


def fsync_path(path: Path) -> None:
    """Make a file's contents, or a folder's entries (creations, renames), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# agreement ---------------------------------------------------------------------------


def agree(group: Group, device: torch.device, what: str, work: Callable[[], int]) -> list[int]:
    """Run ``work`` on this rank and exchange its non-negative result with every rank.

    Returns:
        Every rank's result, indexed by rank.

    Raises:
        Exception: whatever ``work`` raised on this rank.
        RuntimeError: on the ranks where ``work`` succeeded, naming the ranks where it
            failed. No rank proceeds past a failure anywhere.
    """
    error: BaseException | None = None
    try:
        value = work()
    except Exception as e:  # reported to every rank below, then re-raised
        error, value = e, -1
    results = [value]
    if group is not None:
        t = torch.zeros(group_size(group), dtype=torch.int64, device=device)
        t[group_rank(group)] = value + 1  # 0: failed
        all_reduce(t, group, dist.ReduceOp.SUM).wait()
        results = [v - 1 for v in t.tolist()]
    if error is not None:
        raise error
    failed = [r for r, v in enumerate(results) if v < 0]
    if failed:
        raise RuntimeError(f"{what} failed on rank(s) {failed}; see the error raised there")
    return results


# atomic folders ----------------------------------------------------------------------


def partial_path(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def moved_aside_path(target: Path) -> Path:
    """Where :func:`commit_folder` moves an existing ``target`` while replacing it."""
    return target.parent / f".{target.name}.old"


def surviving(target: Path) -> Path:
    """``target``, or the complete copy a replacing save moved aside, if it was killed between
    its two renames and left nothing at ``target``."""
    old = moved_aside_path(target)
    if not target.exists() and old.is_dir():
        return old
    return target


def restore_moved_aside(target: Path) -> None:
    """Put back the copy of ``target`` that a killed replacing save moved aside (rank 0)."""
    old = moved_aside_path(target)
    if surviving(target) == old:
        os.rename(old, target)
        fsync_path(target.parent)


def begin_folder(target: Path) -> Path:
    """Create the empty temporary folder for ``target`` (rank 0), replacing a stale one.

    A previous copy of ``target`` that a killed save left moved aside is put back first, so
    that this save replaces it like any other and never deletes the last complete copy.
    """
    tmp = partial_path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    restore_moved_aside(target)
    remove_folder(tmp)
    tmp.mkdir()
    return tmp


def commit_folder(tmp: Path, target: Path) -> None:
    """Rename the complete temporary folder to ``target`` (rank 0).

    An existing ``target`` is moved aside first and removed once the new one is in place; a
    kill between the two renames leaves it moved aside, where loads find it
    (:func:`surviving`) and the next save puts it back (:func:`begin_folder`).
    """
    fsync_path(tmp)
    old = moved_aside_path(target)
    if target.exists():
        remove_folder(old)
        os.rename(target, old)
    os.rename(tmp, target)
    fsync_path(target.parent)
    remove_folder(old)


def remove_folder(path: Path) -> None:
    """Delete a folder, renaming it first so that a half-deleted one never looks complete."""
    if not path.exists():
        return
    doomed = path.parent / f".{path.name}.deleting"
    if doomed.exists():
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def write_latest(folder: Path, name: str) -> None:
    """Point ``folder/latest`` at ``name`` atomically."""
    tmp = folder / f".{LATEST}.tmp"
    write_file(tmp, (name + "\n").encode())
    os.replace(tmp, folder / LATEST)
    fsync_path(folder)
