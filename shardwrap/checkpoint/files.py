"""Files on disk for checkpoints and exports: streamed safetensors, atomic folders, agreement.

Design note. Every save goes through the same three moves:

1. :func:`agree` runs one phase of work on every rank and exchanges one integer per rank
   (one small all-reduce). A rank that raised reports failure, so *every* rank raises
   instead of some waiting forever in the next collective. It doubles as a barrier, and
   runs a failed save's cleanup on every rank before any of them raises.
2. Files are written into a hidden temporary folder next to the target
   (``.NAME.partial``), each fsynced, then the folder itself.
3. Rank 0 renames the folder to its final name, fsyncs the parent and replaces a
   ``latest`` pointer atomically (temporary file, fsync, ``os.replace``). A save killed at
   any point before the rename leaves the previous checkpoint and pointer untouched. (An
   export into a folder that exists moves its files in one by one instead, keeping what
   else the folder holds: see ``shardwrap.checkpoint.export``.)

A full disk or quota (:data:`DISK_FULL`) is retold by :func:`full_disk_error`, naming the
save, the bytes it needs and those free.

:class:`SafetensorsWriter` writes the `safetensors <https://github.com/huggingface/safetensors>`_
format itself, tensor by tensor: the header is declared up front, so a file larger than
memory can be streamed one unit at a time, and views that share storage (the pieces of one
shard) need no copy.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import struct
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from types import TracebackType
from typing import cast

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import Group, all_reduce, group_rank, group_size
from .checksum import BLOCK, Checksum

__all__ = [
    "DISK_FULL",
    "LATEST",
    "LOGBOOK",
    "Entry",
    "PeerFailed",
    "PeerOSError",
    "SafetensorsWriter",
    "agree",
    "agree_path",
    "begin_folder",
    "commit_folder",
    "fsync_path",
    "full_disk_error",
    "is_plain_name",
    "left_by_shardwrap",
    "moved_aside_path",
    "partial_path",
    "point_latest",
    "remove_folder",
    "restore_moved_aside",
    "safetensors_nbytes",
    "scratch_paths",
    "stage_latest",
    "surviving",
    "tensor_nbytes",
    "write_file",
]

LATEST = "latest"
# A Logbook's file in its run folder: the runs write and read it; saves and exports name it.
LOGBOOK = "logbook.jsonl"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # what a full disk or an exceeded quota raise
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
    torch.complex64: "C64",
}


def tensor_nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a tensor of ``shape`` and ``dtype``, from the shape alone."""
    numel = 1
    for s in shape:
        numel *= s
    return numel * dtype.itemsize


def _header(entries: list[Entry], metadata: dict[str, str] | None) -> bytes:
    """The JSON header of a safetensors file holding ``entries``, padded to 8 bytes."""
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
    return raw + b" " * (-len(raw) % 8)  # the data starts 8-byte aligned


def safetensors_nbytes(entries: list[Entry], metadata: dict[str, str] | None = None) -> int:
    """The size of the file :class:`SafetensorsWriter` writes for ``entries``, before writing."""
    data = sum(tensor_nbytes(shape, dtype) for _, shape, dtype in entries)
    return 8 + len(_header(entries, metadata)) + data


class SafetensorsWriter:
    """Write one safetensors file whose tensors are declared up front and then streamed.

    Call :meth:`write` once per declared tensor, then :meth:`close`; used as a context
    manager, the file is closed if an error interrupts the writing.

    Args:
        path: the file to create.
        entries: ``(key, shape, dtype)`` of every tensor, in the order :meth:`write` gets them.
        metadata: the header's string-to-string ``__metadata__``.
        in_place: CPU tensors are written from their own memory, without bounded copies; only
            for tensors whose storage may be pinned to its size (a save's own snapshot).

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
        in_place: bool = False,
    ) -> None:
        self.path = path
        self.in_place = in_place
        self._entries = entries
        self._next = 0
        self.checksums: dict[str, list[str]] = {}
        raw = _header(entries, metadata)
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
            chunk = data[at : at + _CHUNK]
            if not (self.in_place and chunk.device.type == "cpu"):
                chunk = chunk.to("cpu", copy=True)
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
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
        finally:  # also on a full disk: an open file would hold its space once deleted
            self._file.close()
        return self.path.stat().st_size

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if kind is not None:
            self.abandon()

    def abandon(self) -> None:
        """Close the file unfinished, after an error (deleted while open, it holds its space)."""
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


class PeerFailed(RuntimeError):
    """Raised by :func:`agree` on the ranks whose own work succeeded when it failed elsewhere.

    ``errnos`` maps each failed rank to the ``errno`` of its ``OSError`` (``0`` for any
    other error), so every rank can name, say, a full disk that one rank ran into.
    """

    def __init__(self, what: str, errnos: dict[int, int]) -> None:
        super().__init__(f"{what} failed on rank(s) {sorted(errnos)}; see the error raised there")
        self.errnos = errnos


class PeerOSError(OSError):
    """:class:`PeerFailed` where every rank that failed met an ``OSError``: it keeps the first
    one's ``errno``, so that a handler of ``OSError`` (a read-only or missing folder, a full
    disk) runs on every rank alike rather than on the failing ones only."""

    def __init__(self, what: str, errnos: dict[int, int]) -> None:
        number = errnos[min(errnos)]
        super().__init__(
            number,
            f"{what} failed on rank(s) {sorted(errnos)} with {os.strerror(number).lower()} "
            f"(errno {number}); see the error raised there",
        )
        self.errnos = errnos


def agree(
    group: Group,
    device: torch.device,
    what: str,
    work: Callable[[], int],
    undo: Callable[[], None] | None = None,
) -> list[int]:
    """Run ``work`` on this rank and exchange its non-negative result with every rank.

    Args:
        undo: cleanup after a failure anywhere (a save's temporary folder, by rank 0). Every
            rank runs it in one more agreement before raising, so when any rank raises, every
            rank's cleanup is done. Where the exchange itself failed (a rank died), this rank
            runs it alone.

    Returns:
        Every rank's result, indexed by rank.

    Raises:
        Exception: whatever ``work`` raised on this rank.
        PeerFailed: on the ranks where ``work`` succeeded, naming the ranks where it failed
            (:class:`PeerOSError` where each of them met an ``OSError``). No rank proceeds
            past a failure anywhere.
    """
    error: Exception | None = None
    try:
        value = work()
    except Exception as e:  # reported to every rank below, then re-raised
        error, value = e, -1
    try:
        codes = _exchange(group, device, value, error)
    except Exception:
        if undo is not None:
            with suppress(Exception):  # the exchange's own error is the one to report
                undo()
        raise
    failed = {r: -c for r, c in enumerate(codes) if c <= 0}
    if not failed:
        return [c - 1 for c in codes]
    raised = error if error is not None else _peer_failed(what, failed)
    if undo is not None:

        def cleanup() -> int:
            undo()
            return 0

        try:
            agree(group, device, f"{what}'s cleanup", cleanup)
        except Exception as e:
            raised.add_note(f"and its cleanup failed: {e}")
    raise raised


def _peer_failed(what: str, errnos: dict[int, int]) -> PeerFailed | PeerOSError:
    if all(n > 0 for n in errnos.values()):
        return PeerOSError(what, errnos)
    return PeerFailed(what, errnos)


def agree_path(group: Group, device: torch.device, what: str, path: object) -> Path:
    """``path`` as a ``Path``, once every rank passed the same one (as written, not resolved)
    and a usable one, in one small exchange: ranks given different paths would each write or
    read a different checkpoint, and an empty one is the working folder.

    Raises:
        TypeError, ValueError: on every rank, where some rank's path is neither a ``str`` nor
            an ``os.PathLike``, or is empty (raised there; the others name that rank), or the
            ranks' paths differ.
    """

    def digest() -> int:
        if not isinstance(path, (str, os.PathLike)):
            raise TypeError(
                f"{what}: path must be a folder's path (a str or a pathlib.Path), got {path!r}"
            )
        if not os.fspath(path):
            raise ValueError(
                f"{what}: the path is empty, which would be the working folder itself; pass "
                "the checkpoint's own folder, e.g. 'checkpoints/step-1000'"
            )
        return int.from_bytes(hashlib.blake2b(str(path).encode(), digest_size=7).digest(), "big")

    seen = agree(group, device, what, digest)
    if len(set(seen)) > 1:
        raise ValueError(
            f"{what}: the ranks passed different paths ({len(set(seen))} over {len(seen)} "
            f"ranks; this rank's: '{path}'). Every rank passes the same path, and each writes "
            "or reads its own files inside it: build the path from what every rank shares (the "
            "step), not from the rank."
        )
    return Path(cast("str | os.PathLike[str]", path))  # checked in digest()


def _exchange(group: Group, device: torch.device, value: int, error: Exception | None) -> list[int]:
    """Every rank's code: ``value + 1`` where work succeeded, else ``-errno`` (``0`` for an
    error that is not an ``OSError``), in one small all-reduce."""
    code = value + 1
    if error is not None:
        number = error.errno if isinstance(error, OSError) else None
        code = -number if isinstance(number, int) and number > 0 else 0
    if group is None:
        return [code]
    t = torch.zeros(group_size(group), dtype=torch.int64, device=device)
    t[group_rank(group)] = code
    all_reduce(t, group, dist.ReduceOp.SUM).wait()
    return t.tolist()


# atomic folders ----------------------------------------------------------------------


def partial_path(target: Path) -> Path:
    return target.parent / f".{target.name}.partial"


def moved_aside_path(target: Path) -> Path:
    """Where :func:`commit_folder` moves an existing ``target`` while replacing it."""
    return target.parent / f".{target.name}.old"


def doomed_path(path: Path) -> Path:
    """What :func:`remove_folder` renames ``path`` to before deleting it."""
    return path.parent / f".{path.name}.deleting"


def scratch_paths(target: Path) -> list[Path]:
    """The hidden folders a save or an export to ``target`` may delete or move: its
    temporary folder, the copy of ``target`` it moves aside, and what deleting any of them
    (or ``target``) renames it to first."""
    tmp, old = partial_path(target), moved_aside_path(target)
    return [tmp, old, *(doomed_path(p) for p in (target, tmp, old))]


# What a save or an export writes into its folder: all that the hidden folders a killed one
# leaves (.NAME.partial, .NAME.deleting, .NAME.old) may hold. A folder of such a name holding
# anything else is someone else's, never deleted or moved (tests/checkpoint/
# test_checkpoint_foreign.py checks every name a save and an export write matches).
_WRITTEN = re.compile(
    r"metadata\.json|buffers\.safetensors|optimizer\.pt|\.optimizer-\d{5,}\.pt|extra-\d{5,}\.pt"
    r"|(rank-\d{5,}-of-\d{5,}|residuals-\d{5,})\.safetensors|\.checksums-.+\.json"
    r"|model(-\d{5,}-of-\d{5,})?\.safetensors|model\.safetensors\.index\.json"
    r"|config\.json|generation_config\.json"
)


def left_by_shardwrap(folder: Path) -> bool:
    """Whether ``folder`` is a folder itself (not a link) holding nothing but regular files
    named as a save or an export names its own: a leftover shardwrap may delete or move."""
    if folder.is_symlink() or not folder.is_dir():
        return False
    return all(
        _WRITTEN.fullmatch(c.name) and c.is_file() and not c.is_symlink() for c in folder.iterdir()
    )


def surviving(target: Path) -> Path:
    """``target``, or the complete copy a replacing save moved aside, if it was killed between
    its two renames and left nothing at ``target``."""
    old = moved_aside_path(target)
    if not target.exists() and left_by_shardwrap(old):
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
    """Delete a folder of shardwrap's files, renaming it first so that a half-deleted one never
    looks complete.

    Raises:
        FileExistsError: ``path``, or the name it would be renamed to, holds anything else
            (nothing is deleted).
    """
    if not path.exists():
        return
    doomed = doomed_path(path)
    for folder in (path, doomed):
        if os.path.lexists(folder) and not left_by_shardwrap(folder):
            raise FileExistsError(
                errno.EEXIST,
                f"{folder} holds what shardwrap did not write, so it does not delete it; "
                "move or rename it",
            )
    if os.path.lexists(doomed):
        shutil.rmtree(doomed)
    os.rename(path, doomed)
    shutil.rmtree(doomed)


def stage_latest(folder: Path, name: str) -> Path:
    """Write the next ``folder/latest`` pointer (naming ``name``) beside it, fsynced.

    Its bytes go to disk before the checkpoint is committed, so a full disk fails the save
    while nothing has changed; :func:`point_latest` then only renames.
    """
    staged = folder / f".{LATEST}.tmp"
    try:
        write_file(staged, (name + "\n").encode())
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    return staged


def point_latest(staged: Path) -> None:
    """Replace ``latest`` with the pointer :func:`stage_latest` wrote, atomically."""
    os.replace(staged, staged.parent / LATEST)
    fsync_path(staged.parent)


# a full disk ---------------------------------------------------------------------------


def full_disk_error(
    error: Exception, what: str, target: Path, needed: int, fix: str
) -> OSError | None:
    """``error`` retold when it is a full disk or quota (here, or on the rank a
    :class:`PeerFailed` names): an ``OSError`` with the same ``errno`` whose message names
    ``what`` was saved, to ``target``, the bytes ``needed`` and those free there, and ``fix``.
    ``None`` for any other error.

    Call once the save's temporary files are gone, so that the bytes free are what a retry
    would find.
    """
    ranks = ""
    if isinstance(error, (PeerFailed, PeerOSError)):
        full = {r: n for r, n in error.errnos.items() if n in DISK_FULL}
        if not full:
            return None
        number, ranks = next(iter(full.values())), f" (met on rank(s) {sorted(full)})"
    elif isinstance(error, OSError) and error.errno in DISK_FULL:
        number = error.errno
    else:
        return None
    folder = next(f for f in (target, *target.parents) if f.exists())
    free = shutil.disk_usage(folder).free
    return OSError(
        number,
        f"{what}: {os.strerror(number).lower()} while saving {target}{ranks}: it needs at least "
        f"{_size(needed)}, and {_size(free)} are free on that disk. {fix}",
    )


def _size(n: int) -> str:
    """``n`` bytes, exactly and in the largest binary unit that keeps it at least 1."""
    value, unit = float(n), "B"
    for larger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, larger
    return f"{n:,} bytes ({value:.2f} {unit})"


def few(items: list[str], limit: int = 8, quote: bool = True) -> str:
    """``items`` for an error message, at most ``limit`` of them."""
    shown = ", ".join(f"'{i}'" if quote else i for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
