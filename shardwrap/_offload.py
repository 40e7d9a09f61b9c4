"""Offload: where a rank's training state lives when it does not fit in memory.

Design note. The disk tier keeps every tensor that scales with the model's size (the fp32
shards, their gradients and the optimizer state) in files under ``Offload.path``, one
preallocated file per tensor, mapped into memory (``MAP_SHARED``). The kernel pages them in
when a gather, the optimizer or a save reads them and writes them back when they change; the
page cache is reclaimable, so what a rank holds in anonymous memory is the gathered working set
(a few units), activations and the unit being read ahead. Each unit's files are read ahead
(``MADV_WILLNEED``) when the unit before it is gathered. The host tier (``"cpu"``) is a
home for shards apart from the compute device, in ``_home.py``.

Optimizer state is placed without knowing the optimizer: every torch optimizer creates its
per-parameter state with ``torch.zeros_like(param)`` (Adam, AdamW, RMSprop), ``full_like``
(Adagrad) or a clone of the gradient (SGD momentum). Shard parameters and their gradients are
typed so that those calls allocate in the store instead.

Files are created with ``posix_fallocate``, so a full disk fails when the store is made (a
clear ``OSError``), never later as a signal inside a mapped write; a lock file keeps two runs
from sharing a store. A mapping outlives its file being deleted (the state would vanish
unseen) or replaced, and touching a mapped page past a truncated file's end kills the process
with ``SIGBUS``; so every forward, backward and optimizer step first checks each file by path
(one ``stat``: the same inode, at least the mapped size) and raises :class:`StoreError`
before anything reads the store.

Optimizer steps: torch picks its fast multi-tensor path only for plain ``Parameter`` types
on an accelerator, so for the disk tier's shard parameters, and for the host tier's (plain,
but on the CPU), it would fall back to a per-tensor loop several times slower. A step
pre-hook on each optimizer over such shard parameters (``_optimizers.py``) turns on the fused
kernel for their groups that left ``fused`` and ``foreach`` unset (:func:`prefer_fused`).
"""

from __future__ import annotations

import fcntl
import mmap
import os
import shutil
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = [
    "HOME_ATTR",
    "Offload",
    "Store",
    "StoreError",
    "StoredParam",
    "before_step",
    "count_fused_write",
    "prefer_fused",
    "stored_like",
    "stored_param",
]


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Keep the training state that grows with the model outside device memory.

    Attributes:
        device: ``"disk"``: the shards, their gradients and the optimizer state live in
            files under ``path`` (ZeRO-Infinity's tier); memory holds a few units at a time.
            ``"cpu"``: the same state in (pinned) host memory while the model computes on a
            GPU (ZeRO-Offload's tier): gathers copy the shards in, reduced gradients are
            copied out, and the optimizer steps on the CPU; any stage. With a CPU compute
            device it changes nothing, and says so.
        path: the folder for the disk tier's files (a fast local disk); each rank uses its
            own subfolder, locked while the model lives and removed when it is freed.
    """

    device: str = "disk"
    path: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "disk"):
            raise ValueError(
                f'Offload.device must be "cpu" or "disk", got {self.device!r}; e.g. '
                'Offload(device="disk", path="/nvme/run1").'
            )
        if self.device == "disk" and self.path is None:
            raise ValueError(
                'Offload.path: the disk tier needs a folder, e.g. Offload(device="disk", '
                'path="/nvme/run1").'
            )
        if self.device == "cpu" and self.path is not None:
            raise ValueError('Offload.path is for device="disk"; the cpu tier keeps no files.')


class StoreError(RuntimeError):
    """A file of the disk tier's store was deleted, replaced or truncated while its model lives.

    Raised on the rank that sees it, before the store is read; the model's state can no longer
    be trusted. Other ranks wait in their next collective and raise
    :class:`~shardwrap.CollectiveFailed` once the process group's timeout passes.
    """


class _File(NamedTuple):
    """A store file as made: where it is, which inode it is, how many bytes are mapped."""

    path: Path
    inode: tuple[int, int]  # (st_dev, st_ino)
    nbytes: int


class Store:
    """One rank's files of the disk tier: tensors backed by preallocated, mapped files.

    Args:
        folder: the run's folder (``Offload.path``).
        rank: this rank's index among every rank of the model.

    Raises:
        RuntimeError: another live model (this run's or another's) holds the rank's folder.
    """

    def __init__(self, folder: Path, rank: int) -> None:
        self.folder = Path(folder) / f"rank-{rank:05d}"
        self.folder.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.folder / "lock", "a+")  # noqa: SIM115 (held while the store lives)
        try:
            fcntl.flock(self._lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise RuntimeError(
                f"Offload: {self.folder} is in use by another run (or another model of this "
                "one); give each model its own Offload(path=...)."
            ) from None
        for stale in self.folder.glob("*.bin"):  # left by a run that was killed
            stale.unlink()
        self._maps: list[tuple[int, int, mmap.mmap]] = []  # (address, length, map)
        self._files = [_File(self.folder / "lock", _inode(os.fstat(self._lock.fileno())), 0)]
        self.nbytes = 0

    def tensor(self, numel: int, dtype: torch.dtype, name: str = "") -> Tensor:
        """A new 1-D tensor of ``numel`` zeros whose memory is a file of this store.

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
            self._files.append(_File(path, _inode(os.fstat(fd)), nbytes))
        finally:
            os.close(fd)
        self._maps.append((_address(mapped), nbytes, mapped))
        self.nbytes += nbytes
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t = torch.frombuffer(mapped, dtype=torch.uint8, count=numel * dtype.itemsize)
        return t.view(dtype)

    def read_ahead(self, tensors: list[Tensor]) -> None:
        """Ask the kernel to start reading these store tensors in (``MADV_WILLNEED``)."""
        for t in tensors:
            mapped = self._map_of(t)
            if mapped is not None:
                mapped.madvise(mmap.MADV_WILLNEED)

    def _map_of(self, t: Tensor) -> mmap.mmap | None:
        ptr = t.data_ptr()
        for base, length, mapped in self._maps:
            if base <= ptr < base + length:
                return mapped
        return None

    def check(self) -> None:
        """Check that every file of the store is still the one mapped, whole (a ``stat`` each).

        Raises:
            StoreError: a file was deleted (or moved away), replaced by another file, or
                truncated; touching its mapping could end the process with ``SIGBUS``.
        """
        for file in self._files:
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
        """Release the lock and delete the files (the model is being freed)."""
        if self._lock.closed:
            return
        self._maps.clear()
        self._files.clear()
        shutil.rmtree(self.folder, ignore_errors=True)
        self._lock.close()


def _inode(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _address(mapped: mmap.mmap) -> int:
    """Where ``mapped`` starts in memory."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(mapped, dtype=torch.uint8, count=1).data_ptr()


def store_like(store: Store, t: Tensor, fill: Any = None, copy: bool = False) -> Tensor:
    """A store tensor shaped like ``t``: zeros, filled with ``fill``, or a copy of ``t``."""
    out = store.tensor(t.numel(), t.dtype).view(t.shape)
    if copy:
        with torch._C.DisableTorchFunctionSubclass():
            out.copy_(t)
    elif fill is not None:
        out.fill_(fill)
    return out


# What a call makes of a tensor it is "like": how to fill the store tensor in its place.
_LIKE: dict[Callable[..., Any], Callable[[tuple, dict], Any]] = {
    torch.zeros_like: lambda args, kwargs: None,
    torch.empty_like: lambda args, kwargs: None,
    torch.ones_like: lambda args, kwargs: 1,
    torch.full_like: lambda args, kwargs: args[1] if len(args) > 1 else kwargs["fill_value"],
}


def stored_like(
    store: Store, func: Callable[..., Any], args: tuple, kwargs: dict
) -> Tensor | None:
    """``func(*args, **kwargs)`` allocated in ``store``, where it is a plain "like" of the
    first argument (same device and dtype); ``None`` for any other call."""
    if func not in _LIKE:
        return None
    source = args[0]
    dtype, device = kwargs.get("dtype"), kwargs.get("device")
    if (dtype is not None and dtype != source.dtype) or (
        device is not None and torch.device(device) != source.device
    ):
        return None
    out = store_like(store, source, _LIKE[func](args, kwargs))
    if kwargs.get("requires_grad"):
        out.requires_grad_(True)
    return out


def count_fused_write(func: Callable[..., Any], args: tuple) -> None:
    """After one of torch's fused optimizer kernels (``torch._fused_adamw_``, ...): count its
    write to the parameters (argument 0) in their version counters.

    NOTE: those kernels write without counting it, and a version counter is how a unit that
    stays gathered, or a copy staged for the host tier, learns that its shard changed. The
    shard parameters' and shard gradients' torch-function handlers, whichever torch calls,
    count it here.
    """
    if getattr(func, "__name__", "").startswith("_fused_") and args:
        if isinstance(args[0], (list, tuple)):
            torch.autograd.graph.increment_version([p for p in args[0] if isinstance(p, Tensor)])


class StoredParam(torch.nn.Parameter):
    """A shard parameter of the disk tier: state the optimizer makes "like" it is stored too."""

    _shardwrap_store: Store

    @classmethod
    def __torch_function__(
        cls, func: Callable[..., Any], types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if args and isinstance(args[0], StoredParam):
            out = stored_like(args[0]._shardwrap_store, func, args, kwargs)
            if out is not None:
                return out
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        count_fused_write(func, args)
        return out

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickled (``torch.save``) as the plain parameter it is on this rank."""
        with torch._C.DisableTorchFunctionSubclass():
            plain = torch.nn.Parameter(self.detach().clone(), self.requires_grad)
        return plain.__reduce_ex__(protocol)


def stored_param(data: Tensor, requires_grad: bool, store: Store) -> StoredParam:
    """A shard parameter over ``data`` (a view of a store tensor)."""
    param = StoredParam(data, requires_grad)
    param._shardwrap_store = store
    return param


# On a shard parameter of the host tier: its home (``_home.HostHome``), for the step pre-hook.
HOME_ATTR = "_shardwrap_home"

# torch's optimizers that have a fused kernel for CPU tensors, and their subclasses.
_FUSED_OPTIMIZERS = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD, torch.optim.Adagrad)


def prefer_fused(optimizer: torch.optim.Optimizer, group: dict[str, Any]) -> None:
    """Turn on the fused kernel for ``group`` where the user left the choice to torch.

    1. The optimizer is one of torch's with a fused CPU kernel (Adam, AdamW, SGD, Adagrad, or
       a subclass), the group left ``fused`` and ``foreach`` unset (``None``), is not
       ``differentiable``, and all its parameters are floating point on the CPU: ``fused``
       becomes ``True``. State made before (a step already taken, a checkpoint loaded) keeps
       working: each ``step`` count becomes the fp32 tensor the fused kernels count in.
    2. Anything else, an explicit ``fused=False`` or ``foreach=...`` included: unchanged.
    """
    if (
        not isinstance(optimizer, _FUSED_OPTIMIZERS)
        or group.get("fused", False) is not None
        or group.get("foreach", False) is not None
        or group.get("differentiable", False)
        or not all(p.device.type == "cpu" and p.is_floating_point() for p in group["params"])
    ):
        return
    for p in group["params"]:
        state = optimizer.state.get(p)
        if state and "step" in state:
            state["step"] = torch.as_tensor(state["step"], dtype=torch.float32, device=p.device)
    group["fused"] = True


def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Before a step of an optimizer over offloaded shards (its own pre-hook, registered by
    ``_optimizers.py``): for groups holding shard parameters of an offload tier, prefer the
    fused kernel; check the disk tier's files, and let the host tier's copies in flight
    finish before the step writes the shards they read."""
    places: dict[int, Any] = {}  # the disk tier's stores and the host tier's homes
    groups = []
    for group in optimizer.param_groups:
        held = [p._shardwrap_store for p in group["params"] if isinstance(p, StoredParam)]
        held += [getattr(p, HOME_ATTR) for p in group["params"] if hasattr(p, HOME_ATTR)]
        if held:
            places.update((id(place), place) for place in held)
            groups.append(group)
    for place in places.values():
        if isinstance(place, Store):
            place.check()
        else:
            place.quiesce()
    for group in groups:
        prefer_fused(optimizer, group)
