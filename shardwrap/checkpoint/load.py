"""Loading a sharded checkpoint: validate everything, then read only the bytes this rank needs.

The folder's layout is described in :mod:`shardwrap.checkpoint.save`. Each rank intersects its own
pieces (for its world size and policy) with the saved element ranges and reads only those
bytes, memory-mapped; a tensor-parallel parameter saved at another split (another tp degree,
or none) is read run by run where the two splits' elements meet (``engine/shards/split.py``).
State of an optimizer that steps parameters whole (Muon, Adafactor) is
read whole, each parameter's by the rank that owns it in the new layout, into a tensor made
from the shard parameter as the optimizer makes its state (with the disk tier, in its files).
Every check runs on every rank before anything is written into the model or the optimizer.
"""

from __future__ import annotations

import functools
import io
import json
import mmap
import struct
import warnings
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..comm.failures import is_out_of_memory
from ..engine.optim.whole_params import stepped_whole
from ..engine.shards.param_index import Param
from ..engine.shards.split import Split, overlaps
from ..engine.step.root import Root
from .checksum import buffer_checksum, tensor_checksum
from .entry import wrapped_root
from .files import DTYPES, agree, agree_path, few
from .format import (
    BUFFERS,
    METADATA,
    OPTIMIZER,
    dtype_name,
    extra_file,
    persistent_buffers,
    read_metadata,
    residuals_file,
    resolve_folder,
)
from .optimizer_state import (
    Optimizers,
    as_list,
    check_count,
    check_hyperparameters,
    check_optimizer,
    check_whole_state,
    names_by_id,
    optimizer_problem,
    owns,
    saved_optimizers,
    whole_state_shapes,
)
from .packed_state import unpack
from .residuals import expected_residuals, restore, start_at_zero

__all__ = ["load_checkpoint"]


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: Optimizers = None
) -> dict[str, Any]:
    """Load a checkpoint saved by :func:`save_checkpoint` at any world size and policy.

    Each rank reads only the element ranges its own shards hold, memory-mapped. Everything
    is validated on every rank before anything is modified, so a failed load leaves the
    model and optimizer as they were. Call on every rank.

    Args:
        path: a checkpoint folder, or a folder whose ``latest`` pointer names one.
        model: the model, wrapped with :class:`ShardedModule` at any world size and
            ``auto_wrap``; parameter dtypes may differ from the saved ones (values are cast).
        optimizer: an optimizer of the saved class over ``model.parameters()``, grouped into
            the same parameter groups by name (the order within a group is free); its
            state and hyperparameters are replaced. A list of optimizers (``[muon, adamw]``)
            for a checkpoint saved with a list: as many, in the same order. ``None`` loads
            the model alone.

    Returns:
        The ``**extra`` this rank saved; a rank beyond the saving world size gets rank 0's.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a missing file.
        ValueError: a truncated or corrupt file; a model whose parameter or buffer names or
            shapes differ (all differences named); an optimizer of another class or with
            other parameter groups, another number of optimizers, or one given for a
            checkpoint saved without; an optimizer stepping whole parameters for state saved
            elementwise, or the reverse.
    """
    model, root = wrapped_root(model, "load_checkpoint")
    path = agree_path(root.mesh.control, root.mesh.control_device, "load_checkpoint", path)
    optimizers = as_list(optimizer, "load_checkpoint")
    for o in optimizers if root.optimizers is not None else ():
        root.optimizers.add(o)  # its steps get the offload tier's hook from now
    with ExitStack() as files:
        loader: _Loader | None = None

        def prepare() -> int:
            nonlocal loader
            loader = _Loader(Path(path), model, root, optimizers, files)
            return 0

        agree(root.mesh.control, root.mesh.control_device, "load_checkpoint", prepare)
        assert loader is not None
        loader.apply()
        return loader.extra


# a saved piece's file, and where it holds this rank's piece: (offset in the saved piece,
# offset in this rank's piece, elements) each
Read = tuple[str, list[tuple[int, int, int]]]
_DTYPES = {name: dtype for dtype, name in DTYPES.items()}  # safetensors name -> torch dtype


class _Loader:
    """One rank's view of a checkpoint, validated on construction; :meth:`apply` loads it."""

    def __init__(
        self,
        path: Path,
        model: nn.Module,
        root: Root,
        optimizers: list[torch.optim.Optimizer],
        stack: ExitStack,
    ) -> None:
        self.folder = resolve_folder(path)
        self.meta = read_metadata(self.folder)
        self.params = params = root.params
        self.reductions, self.mesh = root.reductions, root.mesh
        rank = root.mesh.rank
        self.buffers = persistent_buffers(model, params)
        self.optimizers = optimizers
        self._stack = stack
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._read_keys: dict[str, set[str]] = {}  # file -> the tensors this rank reads
        # file -> optimizer tensors read whole into fresh memory: checked there, while read
        self._checked_when_read: dict[str, set[str]] = {}
        self._names = names_by_id(model)
        self._shapes = {p.name: tuple(p.shape) for p in params}  # full shapes, by name
        self._stepping: list[Any] = []  # per optimizer: how it steps whole parameters, or None
        self._check_model()
        self.saved_optimizers = self._check_optimizers() if optimizers else []
        self.reads = {p.name: self._plan_reads(p) for p in params}
        if self.buffers:
            self._open(BUFFERS)
            missing = [k for k in self.buffers if k not in self._keys[BUFFERS]]
            if missing:
                raise ValueError(
                    f"load_checkpoint: {self.folder / BUFFERS} lacks buffers {few(missing)}"
                )
            for k, v in self.buffers.items():
                self._check_stored(BUFFERS, k, tuple(v.shape), v.dtype)
            self._read_keys.setdefault(BUFFERS, set()).update(self.buffers)
        for file, keys in self._read_keys.items():
            self._verify(file, keys - self._checked_when_read.get(file, set()))
        self.optimizer_states = [self._optimizer_state_dict(i) for i in range(len(optimizers))]
        self.residuals = self._read_residuals(rank)
        saved_ranks = self.meta.get("ranks", self.meta["world_size"])
        self.extra = self._load_pt(extra_file(rank if rank < saved_ranks else 0), sized=False)

    # validation ----------------------------------------------------------------------

    def _check_model(self) -> None:
        saved, saved_buffers = self.meta["params"], self.meta["buffers"]
        own = {p.name: p.shape for p in self.params}
        own_buffers = {k: tuple(v.shape) for k, v in self.buffers.items()}
        problems = []
        for kind, mine, theirs in (
            ("parameters", own, saved),
            ("buffers", own_buffers, saved_buffers),
        ):
            missing = [n for n in mine if n not in theirs]
            unexpected = [n for n in theirs if n not in mine]
            shapes = [
                f"'{n}': checkpoint {tuple(theirs[n]['shape'])}, model {mine[n]}"
                for n in mine
                if n in theirs and tuple(theirs[n]["shape"]) != mine[n]
            ]
            if missing:
                problems.append(f"{kind} missing from the checkpoint: {few(missing)}")
            if unexpected:
                problems.append(f"{kind} not in the model: {few(unexpected)}")
            if shapes:
                problems.append(f"{kind} of another shape: {few(shapes, quote=False)}")
        if problems:
            raise ValueError(
                f"load_checkpoint: {self.folder} does not match the model; "
                + "; ".join(problems)
                + ". Build the model with the configuration it was saved with."
            )
        for name, entry in saved.items():
            at = 0
            for _, start, stop in sorted(entry["pieces"], key=lambda piece: piece[1]):
                if start != at:
                    break
                at = stop
            numel = 1
            for s in entry["shape"]:
                numel *= s
            if at != numel:
                raise ValueError(
                    f"load_checkpoint: {self.folder / METADATA} is corrupt: pieces of '{name}'"
                )

    def _check_optimizers(self) -> list[dict[str, Any]]:
        if self.meta["optimizer"] is None:
            raise ValueError(
                f"load_checkpoint: {self.folder} was saved without an optimizer; pass "
                "optimizer=None to load the model alone"
            )
        found = saved_optimizers(self._load_pt(OPTIMIZER, sized=True), self.meta["optimizer"])
        problem = found if isinstance(found, str) else None
        for entry in found[0] if problem is None else ():
            problem = problem or optimizer_problem(entry)
        if problem is not None:
            raise ValueError(f"load_checkpoint: {self.folder / OPTIMIZER} is malformed: {problem}")
        saved, stepped = found
        check_count(self.optimizers, saved)
        whole = self.meta["optimizer"].get("whole_state", {})
        for optimizer, entry, saved_whole in zip(self.optimizers, saved, stepped):
            check_optimizer(optimizer, entry, self._names)
            check_hyperparameters(optimizer, entry, str(self.folder / OPTIMIZER))
            self._stepping.append(stepped_whole(optimizer))
            if saved_whole != (self._stepping[-1] is not None):
                raise ValueError(_kind_mismatch(type(optimizer).__name__, saved_whole))
            for name in (self._names[id(p)] for g in optimizer.param_groups for p in g["params"]):
                if saved_whole and name in whole:  # before any of it is read, on every rank
                    shapes = {key: tuple(at["shape"]) for key, at in whole[name].items()}
                    where = str(self.folder / METADATA)
                    packed = self.meta["optimizer"].get("packed_state", {}).get(name)
                    shape = self._shapes[name]
                    check_whole_state(optimizer, name, shape, shapes, where, packed)
        return saved

    def _open(self, file: str) -> Any:
        """A memory-mapped handle on ``file``, checked against its recorded size."""
        if file not in self._handles:
            path = self._sized(file)
            try:
                self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:
                raise _read_error(path, e, f"load_checkpoint: {path} is corrupt: {e}") from e
            self._keys[file] = set(self._handles[file].keys())
        return self._handles[file]

    def _sized(self, file: str) -> Path:
        path = self.folder / file
        if not path.is_file():
            raise FileNotFoundError(f"load_checkpoint: {path} is missing")
        size, expected = path.stat().st_size, self.meta["files"].get(file)
        if size != expected:
            raise ValueError(
                f"load_checkpoint: {path} is {size} bytes, the checkpoint recorded {expected}: "
                "truncated or overwritten"
            )
        return path

    def _load_pt(self, file: str, sized: bool) -> Any:
        path = self._sized(file) if sized else self.folder / file
        if not path.is_file():
            raise FileNotFoundError(f"load_checkpoint: {path} is missing")
        try:
            data = path.read_bytes()
        except MemoryError as e:
            raise _read_error(path, e, "") from e
        self._verify_file(file, data)
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as e:
            raise _read_error(path, e, f"load_checkpoint: cannot read {path}: {e}") from e

    def _plan_reads(self, p: Param) -> list[Read]:
        """The saved ranges overlapping this rank's piece of ``p``, their headers checked."""
        piece, mine, spec = p.group.pieces[p.index], p.group.splits[p.index], p.group.specs[p.index]
        at = spec.index * mine.block_numel if spec is not None and mine.is_split else 0
        lo, hi = at + piece.start, at + piece.stop  # in stacked order (see split.py)
        entry = self.meta["params"][p.name]
        dim, parts = entry.get("split", (None, 1))
        theirs = Split(tuple(entry["shape"]), dim, parts)
        keys = [f"model/{p.name}"]
        if self.optimizers:
            keys += [
                f"optim/{k}/{p.name}" for k in self.meta["optimizer"]["state_keys"].get(p.name, [])
            ]
        reads = []
        for file, start, stop in entry["pieces"]:
            found = overlaps(mine, lo, hi, theirs, start, stop)
            if not found:
                continue
            for key in keys:
                self._check_stored(file, key, (stop - start,), p.shard.dtype)
            reads.append((file, found))
            self._read_keys.setdefault(file, set()).update(keys)
            if found == [(0, 0, stop - start)]:  # one copy of it whole: checked as read
                whole = {k for k in keys if k.startswith("optim/")}
                self._checked_when_read.setdefault(file, set()).update(whole)
        return reads

    def _check_stored(
        self, file: str, key: str, shape: tuple[int, ...], dtype: torch.dtype | None
    ) -> None:
        """Raise unless ``file`` stores ``key`` at ``shape`` in a dtype that loads into
        ``dtype`` (any floating point into floating point, as ``load_state_dict`` casts; any
        other exactly; ``None``: any), from the file's header alone: before any memory is
        taken for it."""
        handle = self._open(file)
        if key not in self._keys[file]:
            raise ValueError(
                f"load_checkpoint: {self.folder / file} lacks '{key}' of shape {shape}"
            )
        stored = handle.get_slice(key)
        got, kind = tuple(stored.get_shape()), _DTYPES.get(stored.get_dtype())
        recorded = self.meta["checksums"]["tensors"].get(file, {}).get(key)
        if recorded is not None and recorded[0] != stored.get_dtype():
            raise ValueError(
                f"load_checkpoint: {self.folder / file} stores '{key}' as {stored.get_dtype()}, "
                f"but it was written as {recorded[0]}: the file was altered after the save"
            )
        fits = kind is not None and (
            dtype is None or kind == dtype or (kind.is_floating_point and dtype.is_floating_point)
        )
        if got != shape or not fits:
            raise ValueError(
                f"load_checkpoint: {self.folder / file} stores '{key}' as {got} "
                f"{stored.get_dtype()}, where the model needs {shape} "
                f"{dtype_name(dtype) if dtype is not None else ''}. The "
                "file was altered or written for another model: load a checkpoint saved for "
                "this one"
            )

    def _verify_file(self, file: str, data: bytes) -> None:
        """Check a whole ``.pt`` file against the checksum recorded when it was written."""
        if buffer_checksum(data) != self.meta["checksums"]["files"].get(file):
            raise ValueError(
                f"load_checkpoint: {self.folder / file} fails its checksum: the file was "
                "corrupted or replaced after the save. Load an earlier checkpoint."
            )

    def _verify(self, file: str, keys: set[str]) -> None:
        """Check each stored tensor this rank reads from ``file``, whole, against the dtype
        and checksum recorded when it was written."""
        path = self.folder / file
        recorded = self.meta["checksums"]["tensors"].get(file)
        if recorded is None:
            raise ValueError(
                f"load_checkpoint: {self.folder / METADATA} has no checksums for {file}"
            )
        try:
            mapped = _mapped(path)
        except OSError as e:
            if not is_out_of_memory(e):
                raise
            raise _read_error(path, e, "") from e
        with mapped as mm:
            (length,) = struct.unpack("<Q", mm[:8])
            header = json.loads(mm[8 : 8 + length])
            for key in sorted(keys):
                entry, saved = header.get(key), recorded.get(key)
                if not isinstance(entry, dict) or saved is None:
                    raise ValueError(f"load_checkpoint: no checksum recorded for '{key}' in {path}")
                if entry.get("dtype") != saved[0]:
                    raise ValueError(
                        f"load_checkpoint: {path} stores '{key}' as {entry.get('dtype')}, but it "
                        f"was written as {saved[0]}: the file was altered after the save"
                    )
                start, stop = entry["data_offsets"]
                if buffer_checksum(mm, 8 + length + start, stop - start) != saved[1]:
                    raise ValueError(
                        f"load_checkpoint: '{key}' in {path} fails its checksum: the file was "
                        "corrupted after the save (a disk or copy error). Load an earlier "
                        "checkpoint."
                    )

    # loading -------------------------------------------------------------------------

    def _read(self, key: str, p: Param, out: Tensor) -> None:
        """Fill ``out`` (this rank's piece of ``p``) with the saved tensor ``key``; check the
        pieces :meth:`_plan_reads` left to be checked here, in ``out`` itself."""
        for file, found in self.reads[p.name]:
            stored = self._open(file).get_slice(key)
            for at, to, n in found:
                region = out.view(-1)[to : to + n]
                region.copy_(stored[at : at + n])
            if key not in self._checked_when_read.get(file, ()):
                continue
            saved_dtype, saved_sum = self.meta["checksums"]["tensors"][file][key]
            as_saved = saved_dtype == stored.get_dtype() == DTYPES.get(region.dtype)
            got = tensor_checksum(region) if as_saved else None
            if got is None:  # cast or unaligned: check the stored bytes instead
                self._verify(file, {key})
            elif got != saved_sum:
                raise ValueError(
                    f"load_checkpoint: '{key}' in {self.folder / file} fails its checksum: the "
                    "file was corrupted after the save (a disk or copy error). Load an earlier "
                    "checkpoint."
                )

    def apply(self) -> None:
        """Write what construction read and checked: nothing here can fail on bad data."""
        with torch.no_grad():
            for p in self.params:
                self._read(f"model/{p.name}", p, p.shard)
            for k, v in self.buffers.items():
                v.copy_(self._open(BUFFERS).get_tensor(k))
        for optimizer, state in zip(self.optimizers, self.optimizer_states):
            optimizer.load_state_dict(state)
        if self.reductions.error_feedback:  # as saved, or zero as in a fresh run
            restore(self.reductions, self.residuals)

    def _read_residuals(self, rank: int) -> dict[str, Tensor]:
        """This rank's error-feedback residuals, read and checked, where the checkpoint holds
        them for this model's mesh and groups (else none: they start at zero, with a warning
        where some were saved; see :mod:`shardwrap.checkpoint.residuals`)."""
        saved = self.meta.get("residuals")
        expected = expected_residuals(self.reductions, self.mesh, saved)
        if expected is None:
            if saved is not None and self.reductions.error_feedback and self.mesh.world_size > 1:
                if rank == 0:
                    warnings.warn(
                        start_at_zero(self.reductions, self.mesh, saved, str(self.folder)),
                        stacklevel=4,
                    )
            return {}
        file = residuals_file(rank)
        self._open(file)
        unknown = sorted(self._keys[file] - expected.keys())
        if unknown:
            raise ValueError(
                f"load_checkpoint: {self.folder / file} holds {few(unknown)}, which this model's "
                f"reductions do not keep (only {few(sorted(expected))}). The file was altered: "
                "load an earlier checkpoint"
            )
        for key in self._keys[file]:
            numel, dtype, _ = expected[key]
            self._check_stored(file, key, (numel,), dtype)
        self._verify(file, self._keys[file])
        loaded = {}
        for key in sorted(self._keys[file]):
            numel, dtype, device = expected[key]
            loaded[key] = torch.empty(numel, dtype=dtype, device=device)
            loaded[key].copy_(self._open(file).get_tensor(key))
        return loaded

    def _read_whole(self, key: str, at: dict[str, Any], dtype: torch.dtype | None) -> Tensor:
        """The whole-stepped state tensor ``key`` as saved, from the file ``at`` names, checked
        against its recorded shape (checked against the optimizer's rule already), ``dtype``
        (see :meth:`_check_stored`) and checksum."""
        file = at["file"]
        self._check_stored(file, key, tuple(at["shape"]), dtype)
        value = self._open(file).get_tensor(key)
        recorded = self.meta["checksums"]["tensors"].get(file, {}).get(key)
        as_saved = recorded is not None and recorded[0] == DTYPES.get(value.dtype)
        got = tensor_checksum(value) if as_saved else None
        if got is None:  # another dtype or unaligned: check the stored bytes instead
            self._verify(file, {key})
        elif got != recorded[1]:
            raise ValueError(
                f"load_checkpoint: '{key}' in {self.folder / file} fails its checksum: the file "
                "was corrupted after the save (a disk or copy error). Load an earlier checkpoint."
            )
        return value

    def _optimizer_state_dict(self, i: int) -> dict[str, Any]:
        """Optimizer ``i``'s own ``state_dict`` format, for the current parameters' pieces;
        stepped whole, for the parameters this rank owns (the others have no state here)."""
        optimizer, saved_optimizer, stepping = (
            self.optimizers[i],
            self.saved_optimizers[i],
            self._stepping[i],
        )
        by_name = {p.name: p for p in self.params}
        keys, scalars = self.meta["optimizer"]["state_keys"], saved_optimizer["state"]
        whole = self.meta["optimizer"].get("whole_state", {})
        packed = self.meta["optimizer"].get("packed_state", {})
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, saved in zip(optimizer.param_groups, saved_optimizer["param_groups"]):
            ids = []
            for param in group["params"]:
                name = self._names[id(param)]
                if stepping is not None:
                    if (name in whole or name in scalars) and owns(stepping, param):
                        entry = dict(scalars.get(name, {}))
                        known = whole_state_shapes(optimizer, self._shapes[name]) is not None
                        dtype = param.dtype if known else None  # its rule: floating point
                        read = {
                            key: self._read_whole(f"optim/{key}/{name}", at, dtype)
                            for key, at in whole.get(name, {}).items()
                        }
                        made = functools.partial(_made_from, param)
                        entry.update(unpack(read, packed.get(name, {}), made, param.device))
                        state[index] = entry
                elif name in keys or name in scalars:
                    p = by_name[name]
                    entry: dict[str, Any] = dict(scalars.get(name, {}))
                    for key in keys.get(name, []):
                        entry[key] = torch.empty_like(p.shard, requires_grad=False)
                        self._read(f"optim/{key}/{name}", p, entry[key])
                    state[index] = entry
                ids.append(index)
                index += 1
            hyper = {k: v for k, v in saved.items() if k != "params"}
            groups.append({**hyper, "params": ids})
        return {"state": state, "param_groups": groups}


def _mapped(path: Path) -> mmap.mmap:
    """``path``, memory-mapped for reading."""
    with open(path, "rb") as f:
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


def _read_error(path: Path, error: Exception, otherwise: str) -> Exception:
    """What to raise for ``error`` met while reading ``path``: running out of memory says so
    and that nothing is known to be wrong with the file (a user told it is corrupt might delete
    a good checkpoint); any other error is ``ValueError(otherwise)``."""
    if is_out_of_memory(error):
        return MemoryError(
            f"load_checkpoint: out of memory while reading {path} ({error}): nothing is known "
            "to be wrong with the file, so do not delete it. Free memory on this rank (or raise "
            "its memory limit), then load again"
        )
    return ValueError(otherwise)


def _made_from(param: nn.Parameter, value: Tensor) -> Tensor:
    """Whole-stepped state ``value`` of ``param``, as read, where the optimizer makes such
    state: made from the shard parameter (``new_empty``; with the disk tier, in its files), in
    its dtype as ``load_state_dict`` casts floating-point state. Other state: as read."""
    if not value.is_floating_point():
        return value
    out = param.new_empty(value.shape)
    with torch.no_grad():
        out.copy_(value)
    return out


def _kind_mismatch(cls: str, saved_whole: bool) -> str:
    """The error for an optimizer that steps otherwise than the one saved: each parameter's
    state whole on its owner, or this rank's pieces of it, are not the same state."""
    if saved_whole:
        saved, now, declare = (
            "stepped whole, each parameter's on one owner rank",
            "steps each rank's piece of a parameter (declared reads_shapes=False)",
            True,
        )
    else:
        saved, now, declare = (
            "of an elementwise optimizer, sharded by element ranges",
            "steps each parameter whole (Muon, Adafactor or declared reads_shapes=True)",
            False,
        )
    return (
        f"load_checkpoint: optimizer mismatch: the checkpoint holds {cls} state {saved}, but "
        f"this {cls} {now}. Declare it as it was when saved, before loading: "
        f"shardwrap.declare_optimizer({cls}, reads_shapes={declare})"
    )
