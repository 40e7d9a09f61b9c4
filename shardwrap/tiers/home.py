"""Where a flat group's shard lives between uses (its home), apart from where it computes.

Design note. Two devices meet in every flat group: the compute device, where gathered
parameters, flat gradients and collectives are, and the shard's home, where the fp32 shard,
its reduced gradient and so the optimizer state live. Every site that allocates, gathers or
lands a gradient asks the group's :class:`Home` rather than deciding itself:

1. :class:`Home` (no offload): the home is the compute device. A gather reads the shard in
   place; a reduced gradient stays where it landed.
2. :class:`HostHome` (``Offload(device="cpu")`` with a CUDA device):
   shards and their gradients in pinned host memory, so the optimizer makes its state there
   and steps on the CPU. A gather first *stages* the shard: a host-to-device copy on a side
   stream into a device tensor of its own, issued when the unit before it is gathered
   (:meth:`HostHome.read_ahead`; with prefetch, while the unit two before computes), so the
   compute stream, which waits for the copy where the all-gather is issued, finds it done.
   The staged copy is a tensor apart, not a slot of the gathered buffer, because a pooled
   buffer may still be read by the previous unit's kernels on the compute stream; copying
   into it would have to wait for them. The all-gather then reads the staged copy, casting
   into its slot of the buffer on the device under mixed precision: the host does no pass
   over the shard, and the copy stays asynchronous (a cast on the host would go through an
   unpinned temporary). The price is fp32 bytes over the bus rather than half of them. A
   reduced gradient is cast to the shard's dtype on the device and copied device-to-host on
   a second side stream, into a pinned buffer kept per group; the copies are waited for at
   the end of backward, before ``.grad`` is set.
3. :class:`DiskHome` (``Offload(device="disk")``, on a CPU device): shards, their gradients
   and the optimizer state in files mapped into memory (below). A gather reads the shard in
   place, its pages read ahead; a reduced gradient is written straight into the group's
   gradient file.

The disk tier keeps every tensor that scales with the model's size in files under
``Offload.path``, one preallocated file per tensor, mapped into memory (``MAP_SHARED``). The
kernel pages them in when a gather, the optimizer or a save reads them and writes them back
when they change; the page cache is reclaimable, so what a rank holds in anonymous memory is
the gathered working set (a few units), activations and the unit being read ahead
(``MADV_WILLNEED``, when the unit before it is gathered). Files are created with
``posix_fallocate``, so a full disk fails when the home is made (a clear ``OSError``), never
later as a signal inside a mapped write; a lock file keeps two runs from sharing a folder. A
mapping outlives its file being deleted (the state would vanish unseen) or replaced, and
touching a mapped page past a truncated file's end kills the process with ``SIGBUS``; so every
forward, backward and optimizer step first checks each file by path (one ``stat``: the same
inode, at least the mapped size) and raises :class:`StoreError` before anything reads it.

A gradient buffer kept per group (this pinned buffer, the disk tier's gradient file) takes a
backward's gradient only while nothing holds it: a ``.grad`` still set, or one a user kept
past ``zero_grad()``, which reusing the buffer would overwrite (its storage's reference count
tells, :meth:`FlatGroup.free_home_grad`); otherwise that backward lands in a new tensor.

Host writes to a shard (the optimizer step, loads, ``gathered(writeback=True)``) must not race
a staged copy still reading it: :meth:`Home.quiesce` waits for every copy in flight, at the end
of backward, and :meth:`Home.check` (which quiesces, or checks the disk tier's files) runs
before each of them (the step pre-hook of each optimizer over the shards,
``engine/optim/step_hooks.py``; the root's checks before a call).
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import itertools
import math
import mmap
import os
import shutil
import uuid
import warnings
import weakref
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, NamedTuple

import torch
from torch import Tensor, nn

from ..options import Offload
from .offload import HOME_ATTR, StoreError, stored_param
from .shard_param import ShardParam

__all__ = ["DiskHome", "HostHome", "Home", "make_home"]


class Home:
    """Shards at home on the compute device: gathers read them in place, nothing is copied.

    Args:
        device: the compute device.
    """

    offload = "none"  # the tier, as the wrap's summary names it
    staged = False  # whether a gather copies the shard to the compute device first
    hooks_optimizers = False  # whether an optimizer's steps over the shards need a pre-hook

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where compute runs
        self.memory = device  # where shards, their gradients and the optimizer state live

    def tensor(self, numel: int, dtype: torch.dtype, name: str = "") -> Tensor:
        """A new 1-D tensor of zeros in the home's memory (``name``: what it holds)."""
        return torch.zeros(numel, dtype=dtype, device=self.memory)

    def shard_param(self, data: Tensor, requires_grad: bool) -> nn.Parameter:
        """The shard parameter over ``data``, a view of a shard in this home."""
        return ShardParam(data, requires_grad)

    def grad_buffer(self, numel: int, grad_dtype: torch.dtype, dtype: torch.dtype) -> Tensor | None:
        """A gradient buffer a group keeps in the home between steps, or ``None`` (none kept).

        ``grad_dtype``: the reduction's; ``dtype``: the shard params' ``.grad``'s.
        """
        return None

    def reduce_into(self, numel: int, grad_dtype: torch.dtype, buffer: Tensor | None) -> Tensor:
        """Where a reduce-scatter writes a group's shard gradient: a new tensor on the compute
        device. ``buffer``: the group's gradient buffer, if it may take this backward's."""
        return torch.empty(numel, dtype=grad_dtype, device=self.device)

    def made_from_grad(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """``func(*args, **kwargs)`` made in this home, where it is optimizer state made from a
        shard gradient (``args[0]``) that the home keeps; ``None``: torch makes it."""
        return None

    def read_ahead(self, shards: Iterable[Tensor]) -> None:
        """Start moving these shards to the compute device (they are gathered next)."""

    def gather_input(self, shard: Tensor) -> Tensor:  # 1-D, padded/N, on the device
        """``shard`` on the compute device, as the all-gather's input."""
        return shard

    def land(self, out: Tensor, buffer: Tensor | None, dtype: torch.dtype) -> Tensor:
        """A reduced shard gradient (on the compute device) as it is kept: here, as it is.

        ``buffer``: a gradient buffer kept in the home that may take it (or ``None``);
        ``dtype``: the shard params' ``.grad``'s.
        """
        return out

    def quiesce(self) -> None:
        """Wait for every copy in flight between the home and the compute device."""

    def check(self) -> None:
        """Before a forward, a backward, an optimizer step or a call that reads or writes every
        shard: wait for the copies in flight (:meth:`quiesce`)."""
        self.quiesce()

    def close(self) -> None:
        """The model is being freed."""


class _Staged(NamedTuple):
    """A shard copied to the compute device: the copy, the shard's version it holds, and the
    event the copy's stream records when done (``None`` on a CPU device)."""

    tensor: Tensor  # 1-D, padded/N, shard dtype, on the compute device
    version: int
    done: torch.cuda.Event | None


class HostHome(Home):
    """The host tier: shards and their gradients in host memory, staged to the compute device.

    Args:
        device: the compute device; on CUDA the host memory is pinned and copies run on side
            streams; on a CPU device (which :func:`make_home` never chooses; the tests build
            one to cover the logic) they are unpinned, and the copies plain.
    """

    offload = "host memory"
    staged = True
    hooks_optimizers = True  # wait for copies, and the fused kernel

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.memory = torch.device("cpu")
        cuda = device.type == "cuda"
        self._pinned = cuda
        self._up = torch.cuda.Stream(device) if cuda else None  # host -> device copies
        self._down = torch.cuda.Stream(device) if cuda else None  # device -> host copies
        self._staged: dict[int, _Staged] = {}  # id(shard) -> its copy, not yet used
        self._closed = False

    def tensor(self, numel: int, dtype: torch.dtype, name: str = "") -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self._pinned).zero_()

    def shard_param(self, data: Tensor, requires_grad: bool) -> nn.Parameter:
        """A shard parameter that names this home, where an optimizer's step pre-hook finds it."""
        param = ShardParam(data, requires_grad)
        setattr(param, HOME_ATTR, self)
        return param

    def grad_buffer(self, numel: int, grad_dtype: torch.dtype, dtype: torch.dtype) -> Tensor | None:
        """A buffer in (pinned) host memory, in the ``.grad``'s dtype."""
        return self.tensor(numel, dtype)

    def read_ahead(self, shards: Iterable[Tensor]) -> None:
        for shard in shards:
            staged = self._staged.get(id(shard))
            if staged is None or staged.version != shard._version:
                self._staged[id(shard)] = self._stage(shard)

    def _stage(self, shard: Tensor) -> _Staged:
        if self._up is None:
            return _Staged(shard.clone(), shard._version, None)
        with torch.cuda.stream(self._up):
            copy = torch.empty(shard.shape, dtype=shard.dtype, device=self.device)
            copy.copy_(shard, non_blocking=True)
            done = self._up.record_event()
        return _Staged(copy, shard._version, done)

    def gather_input(self, shard: Tensor) -> Tensor:
        staged = self._staged.pop(id(shard), None)
        if staged is None or staged.version != shard._version:
            staged = self._stage(shard)
        if staged.done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.done)
            staged.tensor.record_stream(current)  # made on the copy stream, used on this one
        return staged.tensor

    def land(self, out: Tensor, buffer: Tensor | None, dtype: torch.dtype) -> Tensor:
        """``out`` in the ``.grad``'s ``dtype`` (cast on the device), copied into ``buffer``, the
        group's pinned gradient buffer, or a new one where ``buffer`` is ``None`` (``.grad``
        or anything else holds it)."""
        home = buffer if buffer is not None else self.tensor(out.numel(), dtype)
        src = out.to(dtype)
        if self._down is None:
            home.copy_(src)
            return home
        self._down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._down):
            home.copy_(src, non_blocking=True)
        src.record_stream(self._down)
        return home

    def quiesce(self) -> None:
        if self._up is not None and self._down is not None:
            self._up.synchronize()
            self._down.synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._staged.clear()


class _File(NamedTuple):
    """A file of the disk tier as made: where it is, which inode it is, how many bytes are
    mapped."""

    path: Path
    inode: tuple[int, int]  # (st_dev, st_ino)
    nbytes: int


class DiskHome(Home):
    """The disk tier: one rank's shards, their gradients and the optimizer state in
    preallocated files, mapped into memory.

    Args:
        device: the compute device (the CPU, where the files are mapped).
        folder: the run's folder (``Offload.path``).
        rank: this rank's index among every rank of the model.

    Raises:
        RuntimeError: another live model (this run's or another's) holds the rank's folder.
    """

    offload = "disk"
    hooks_optimizers = True  # check the files, and the fused kernel

    def __init__(self, device: torch.device, folder: Path, rank: int) -> None:
        super().__init__(device)
        self.memory = torch.device("cpu")
        self.folder = Path(folder) / f"rank-{rank:05d}"
        lock = self._take_folder()
        if lock is None:  # a model of this process deleted but not yet collected may hold it
            gc.collect()  # (its home then removes the folder: taken afresh after)
            lock = self._take_folder()
        if lock is None:
            raise RuntimeError(
                f"Offload: {self.folder} is in use by another run (or another live model of "
                "this one); give each model its own Offload(path=...)."
            )
        self._lock = lock
        for stale in self.folder.glob("*.bin"):  # left by a run that was killed
            stale.unlink()
        self._lock_file = _File(self.folder / "lock", _inode(os.fstat(self._lock.fileno())), 0)
        # The live files by a key of their own; a file leaves (and is deleted) once no tensor
        # maps it any more: optimizer state a load or a new optimizer replaced.
        self._files: dict[int, _File] = {}
        self._maps: dict[int, tuple[int, int, weakref.ref[mmap.mmap]]] = {}  # address, length
        self._made = itertools.count()

    @property
    def nbytes(self) -> int:
        """Bytes in the live files."""
        return sum(f.nbytes for f in list(self._files.values()))

    def _take_folder(self) -> IO[str] | None:
        """The folder's lock file, made and locked (held while the home lives); ``None`` where
        another live home holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        lock = open(self.folder / "lock", "a+")  # noqa: SIM115
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            return None
        return lock

    def tensor(self, numel: int, dtype: torch.dtype, name: str = "") -> Tensor:
        """A new 1-D tensor of ``numel`` zeros whose memory is a file of this home.

        Raises:
            OSError: the disk cannot hold it (checked now, by preallocating the file).
        """
        if numel == 0:
            return torch.empty(0, dtype=dtype)
        nbytes = numel * dtype.itemsize
        key = f"{name or 'tensor'}-{uuid.uuid4().hex[:12]}"
        path = self.folder / f"{key}.bin"
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                free = shutil.disk_usage(self.folder).free
                raise OSError(
                    e.errno,
                    f"Offload: {self.folder} cannot hold {nbytes / 2**20:.1f} MiB more "
                    f"({free / 2**20:.1f} MiB free, {self.nbytes / 2**30:.2f} GiB in the "
                    "store); free space or choose a larger disk",
                ) from e
            mapped = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
            made = _File(path, _inode(os.fstat(fd)), nbytes)
        finally:
            os.close(fd)
        key = next(self._made)
        self._files[key] = made
        self._maps[key] = (_address(mapped), nbytes, weakref.ref(mapped))
        weakref.finalize(mapped, _released, self._files, self._maps, key)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mapped, dtype=torch.uint8, count=numel * dtype.itemsize)
        return t.view(dtype)

    def shard_param(self, data: Tensor, requires_grad: bool) -> nn.Parameter:
        """A shard parameter whose optimizer state, made "like" it, lives in this home."""
        return stored_param(data, requires_grad, self)

    def grad_buffer(self, numel: int, grad_dtype: torch.dtype, dtype: torch.dtype) -> Tensor | None:
        """A file in the reduction's dtype, which the reduce-scatter writes straight into."""
        return self.tensor(numel, grad_dtype, "grad")

    def reduce_into(self, numel: int, grad_dtype: torch.dtype, buffer: Tensor | None) -> Tensor:
        return buffer if buffer is not None else super().reduce_into(numel, grad_dtype, None)

    def shaped(self, shape: Sequence[int], dtype: torch.dtype, fill: Any = None) -> Tensor:
        """A tensor of this home of ``shape``: zeros, or filled with ``fill``."""
        out = self.tensor(math.prod(shape), dtype).view(shape)
        if fill is not None:
            out.fill_(fill)
        return out

    def like(self, t: Tensor, fill: Any = None, copy: bool = False) -> Tensor:
        """A tensor of this home shaped like ``t``: zeros, filled with ``fill``, or a copy."""
        out = self.shaped(t.shape, t.dtype, None if copy else fill)
        if copy:
            with torch._C.DisableTorchFunctionSubclass():
                out.copy_(t)
        return out

    def made_like(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Tensor | None:
        """``func(*args, **kwargs)`` made in this home, where it makes a tensor "like" the first
        argument, in its device and dtype: of its shape (``zeros_like``, ``full_like``, ...)
        or of a given one (``new_zeros``, ``new_full``, ...: Adafactor's factors); ``None``
        for any other call."""
        if func not in _LIKE:
            return None
        source = args[0]
        dtype, device = kwargs.get("dtype"), kwargs.get("device")
        if (dtype is not None and dtype != source.dtype) or (
            device is not None and torch.device(device) != source.device
        ):
            return None
        shape, fill = _LIKE[func](source, args, kwargs)
        out = self.shaped(shape, source.dtype, fill)
        if kwargs.get("requires_grad"):
            out.requires_grad_(True)
        return out

    def made_from_grad(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        """State made like a gradient, or a clone of it (SGD's momentum), is made here."""
        if func in (torch.clone, Tensor.clone) and not kwargs:
            return self.like(args[0], copy=True)
        return self.made_like(func, args, kwargs)

    def read_ahead(self, shards: Iterable[Tensor]) -> None:
        """Ask the kernel to start reading these shards' files in (``MADV_WILLNEED``)."""
        for t in shards:
            mapped = self._map_of(t)
            if mapped is not None:
                mapped.madvise(mmap.MADV_WILLNEED)

    def _map_of(self, t: Tensor) -> mmap.mmap | None:
        ptr = t.data_ptr()
        for base, length, mapped in list(self._maps.values()):
            if base <= ptr < base + length:
                return mapped()
        return None

    def check(self) -> None:
        """Check that every file of this home is still the one mapped, whole (a ``stat``
        each).

        Raises:
            StoreError: a file was deleted (or moved away), replaced by another file, or
                truncated; touching its mapping could end the process with ``SIGBUS``.
        """
        for file in (self._lock_file, *list(self._files.values())):
            try:
                st = os.stat(file.path)
            except FileNotFoundError:
                self._fail(file, "was deleted (or moved away)")
            if _inode(st) != file.inode:
                self._fail(file, "was replaced by another file")
            if st.st_size < file.nbytes:
                self._fail(file, f"was truncated to {st.st_size} of its {file.nbytes} bytes")

    def _fail(self, file: _File, what: str) -> None:
        role = "lock" if file.nbytes == 0 else "training state"
        raise StoreError(
            f"Offload: the store file {file.path} ({role}) {what} while the model is live, so "
            "this rank's training state can no longer be trusted. The store is not a place to "
            "clean up while a run is live: keep cleaners (rm, tmpwatch, systemd-tmpfiles) and "
            "other programs out of Offload.path, and restart from the last checkpoint."
        )

    def close(self) -> None:
        """Release the lock and delete the files it made, then the folder if nothing else is in
        it (the model is being freed). A file at one of their paths that is another (the
        folder removed and taken by a newer model meanwhile) is left alone."""
        if self._lock.closed:
            return
        self._maps.clear()
        for file in (self._lock_file, *list(self._files.values())):
            _delete(file)
        self._files.clear()
        with contextlib.suppress(OSError):
            self.folder.rmdir()
        self._lock.close()


def _delete(file: _File) -> None:
    """Delete ``file`` if the path still names it (not a newer model's file there)."""
    with contextlib.suppress(OSError):
        if _inode(os.stat(file.path)) == file.inode:
            file.path.unlink()


def _released(files: dict[int, _File], maps: dict[int, Any], key: int) -> None:
    """No tensor maps the file ``key`` any more (state a load or a new optimizer replaced):
    it leaves the home, deleted, its space free again. After ``close`` it has gone already."""
    maps.pop(key, None)
    file = files.pop(key, None)
    if file is not None:
        _delete(file)


def _inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _address(mapped: mmap.mmap) -> int:
    """Where ``mapped`` starts in memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()


def _size(args: tuple, kwargs: dict) -> Sequence[int]:
    """The size given to ``new_zeros``, ``new_empty`` or ``new_ones``: ``(2, 3)`` or ``2, 3``."""
    if "size" in kwargs:
        return kwargs["size"]
    return args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]


def _arg(args: tuple, kwargs: dict, i: int, name: str) -> Any:
    return args[i] if len(args) > i else kwargs[name]


# What a call makes of a tensor it is "like" (``t``): the shape and fill of the disk tier's
# tensor made in its place.
_LIKE: dict[Callable[..., Any], Callable[[Tensor, tuple, dict], tuple[Sequence[int], Any]]] = {
    torch.zeros_like: lambda t, args, kwargs: (t.shape, None),
    torch.empty_like: lambda t, args, kwargs: (t.shape, None),
    torch.ones_like: lambda t, args, kwargs: (t.shape, 1),
    torch.full_like: lambda t, args, kwargs: (t.shape, _arg(args, kwargs, 1, "fill_value")),
    Tensor.new_zeros: lambda t, args, kwargs: (_size(args, kwargs), None),
    Tensor.new_empty: lambda t, args, kwargs: (_size(args, kwargs), None),
    Tensor.new_ones: lambda t, args, kwargs: (_size(args, kwargs), 1),
    Tensor.new_full: lambda t, args, kwargs: (
        _arg(args, kwargs, 1, "size"),
        _arg(args, kwargs, 2, "fill_value"),
    ),
}


def make_home(offload: Offload | None, device: torch.device, rank: int) -> Home:
    """The home the offload options and the compute device call for (``rank``: this rank's
    index among every rank of the model, which names its folder of the disk tier).

    1. ``Offload(device="disk")``: :class:`DiskHome` (on a CPU device, checked before).
    2. ``Offload(device="cpu")`` with a CUDA device: :class:`HostHome`.
    3. ``Offload(device="cpu")`` with a CPU device: the state is in host memory already, so
       :class:`Home`, with a warning that the tier changes nothing.
    4. No offload: :class:`Home`.
    """
    if offload is None:
        return Home(device)
    if offload.device == "disk":
        return DiskHome(device, Path(offload.path), rank)  # type: ignore[arg-type]
    if device.type == "cuda":
        return HostHome(device)
    warnings.warn(
        'Offload(device="cpu") with a CPU compute device changes nothing: the state is in '
        "host memory already. Use it with a GPU, or the disk tier for a model larger than "
        "memory.",
        stacklevel=3,
    )
    return Home(device)
