"""Sharded checkpoints: every rank writes its own pieces; any world size and policy loads them.

Design note. Nothing on disk depends on the world size or the ``auto_wrap`` policy that
wrote it: every tensor is keyed by the parameter's original (canonical) name and by an
element range ``[start, stop)`` of the flattened parameter. Rank ``r`` writes the pieces its
shards hold, with no collective beyond three small agreements (see
:func:`~shardwrap.checkpoint.files.agree`); rank 0 adds the metadata, which it computes from the
flat layouts without asking anyone. With hybrid sharding the first replica writes the shard
files and every other replica writes only its ``extra``: a checkpoint is written once, and
loads at any mesh. A loading rank intersects its own pieces (for its world
size and policy) with the saved ranges and reads only those bytes, memory-mapped. A folder::

    metadata.json                     names, full shapes, dtypes, which file holds which range
    rank-00000-of-00002.safetensors   rank 0's pieces, 1-D: model/NAME and optim/KEY/NAME
    rank-00001-of-00002.safetensors
    buffers.safetensors               buffers (BatchNorm statistics), from rank 0
    optimizer.pt                      optimizer class, param_groups by name, scalar state
                                      (of each optimizer, for a list of them)
    extra-00000.pt, extra-00001.pt    each rank's ``**extra``

Optimizer state is split by shape: a tensor shaped like the shard parameter (Adam's
moments, SGD's momentum) is sharded like the parameter; a 0-d tensor or a number (``step``)
is a scalar, equal on every rank, saved once by rank 0. An optimizer that steps parameters
whole (Muon, Adafactor: :mod:`shardwrap.engine.optim.whole_params`) holds a parameter's state on
its owner rank alone, in the state's own shapes (a matrix's momentum, Adafactor's row and
column variances): the owner writes those tensors whole into its rank file (``optim/KEY/NAME``)
and hands their shapes and its scalars to rank 0 through a small file, and the metadata records
which file holds each (``whole_state``). A load gives them to the owners of the new layout.
Any other state of an elementwise optimizer has no meaning per element range and is refused.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from ..engine.shards.param_index import Param
from .background import PendingSave, settle, snapshot, snapshot_plans, writer_group
from .checksum import buffer_checksum
from .entry import wrapped_root, writers_of
from .extra import extra_bytes_of
from .files import (
    LATEST,
    LOGBOOK,
    Entry,
    SafetensorsWriter,
    agree,
    begin_folder,
    commit_folder,
    few,
    full_disk_error,
    is_plain_name,
    partial_path,
    point_latest,
    remove_folder,
    restore_moved_aside,
    safetensors_nbytes,
    stage_latest,
    surviving,
    write_file,
)
from .optimizer_state import (
    OptimizerPlan,
    Optimizers,
    as_list,
    optimizer_record,
    owned_summary,
    plan_optimizers,
)

__all__ = ["PendingSave", "latest_checkpoint", "save_checkpoint"]

FORMAT = "shardwrap.checkpoint"
VERSION = 3  # 2: content checksums of every stored tensor and file; 3: whole-stepped state
METADATA = "metadata.json"
BUFFERS = "buffers.safetensors"
OPTIMIZER = "optimizer.pt"


def persistent_buffers(model: nn.Module, params: list[Param]) -> dict[str, Tensor]:
    """The persistent buffers of the state dict (everything that is not a parameter)."""
    shard_ids = {id(p.shard) for p in params}
    return {
        k: v
        for k, v in nn.Module.state_dict(model, keep_vars=True).items()
        if isinstance(v, Tensor) and id(v) not in shard_ids
    }


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def extra_file(rank: int) -> str:
    return f"extra-{rank:05d}.pt"


def _owned_file(rank: int) -> str:
    """Where a writing owner leaves its whole-stepped state's shapes and scalars for rank 0."""
    return f".optimizer-{rank:05d}.pt"


def _checksum_file(rank: int) -> str:
    """Where a rank leaves its rank file's checksums for rank 0 (merged into the metadata)."""
    return f".checksums-{rank:05d}.json"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint that ``folder/latest`` points to, or ``None`` if there is none yet."""
    pointer = Path(folder) / LATEST
    if not pointer.is_file():
        return None
    name = pointer.read_text().strip()
    if not is_plain_name(name):
        raise ValueError(
            f"{pointer} names {name!r}, not a checkpoint inside {folder}: a latest pointer "
            "holds the name of a folder beside it. Rewrite it or delete it."
        )
    return Path(folder) / name


def resolve_folder(path: Path) -> Path:
    path = surviving(path)
    if (path / METADATA).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"load_checkpoint: no checkpoint at {path}: it holds neither {METADATA} nor a "
            f"'{LATEST}' pointer (no save to it has completed yet)"
        )
    latest = surviving(latest)
    if not (latest / METADATA).is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {path / LATEST} points to {latest}, which has no {METADATA}"
        )
    return latest


# what a folder holds ---------------------------------------------------------------------


def _metadata_of(folder: Path) -> dict[str, Any] | None:
    """The metadata of the checkpoint ``folder`` is, or ``None`` if it is none."""
    try:
        meta = json.loads((folder / METADATA).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def _own_files(meta: dict[str, Any]) -> set[str]:
    """The names in a checkpoint's folder that the checkpoint wrote, by its metadata."""
    files, ranks = meta.get("files"), meta.get("ranks", meta.get("world_size"))
    names = {METADATA, *(files if isinstance(files, dict) else ())}
    return names | {extra_file(r) for r in range(ranks if isinstance(ranks, int) else 0)}


def saves_in(folder: Path) -> list[str]:
    """What of shardwrap's own saves ``folder`` holds, each said for an error message: a
    checkpoint, checkpoints (a ``latest`` pointer, checkpoint folders), a Logbook's run."""
    if not folder.is_dir():
        return []
    found = []
    if _metadata_of(folder) is not None:
        found.append(f"a shardwrap checkpoint ({METADATA})")
    if (folder / LATEST).is_file():
        found.append(f"a '{LATEST}' pointer to checkpoints")
    inside = sorted(c.name for c in folder.iterdir() if _metadata_of(c) is not None)
    if inside:
        found.append(f"checkpoints {few(inside)}")
    if (folder / LOGBOOK).is_file():
        found.append(f"a Logbook's run ({LOGBOOK})")
    return found


def _refuse_to_replace(target: Path) -> None:
    """Raise unless a checkpoint saved at ``target`` would delete nothing it did not write:
    ``target`` must be new, an empty folder, or a checkpoint holding only its own files."""
    folder = surviving(target)
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise ValueError(
            f"save_checkpoint: {target} is a file, not a checkpoint folder; pass a folder "
            "path that does not exist yet, e.g. ckpt/step-000100"
        )
    names = sorted(c.name for c in folder.iterdir())
    meta = _metadata_of(folder)
    if meta is None and names:
        saves = saves_in(folder)
        held = "; ".join(saves) if saves else few(names)
        hint = f", e.g. {target / 'step-000100'}" if (folder / LATEST).is_file() else ""
        raise ValueError(
            f"save_checkpoint: {target} is not a shardwrap checkpoint: it holds {held}, which "
            f"replacing it would delete. Save to a folder path that does not exist yet{hint}"
        )
    foreign = [n for n in names if meta is not None and n not in _own_files(meta)]
    if foreign:
        raise ValueError(
            f"save_checkpoint: {target} is a checkpoint that also holds {few(foreign)}, which "
            "it did not write and replacing it would delete. Move them out of it, or save to "
            "another path"
        )


# save --------------------------------------------------------------------------------


@overload
def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    keep_last: int | None = None,
    blocking: Literal[True] = True,
    **extra: Any,
) -> Path: ...


@overload
def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    keep_last: int | None = None,
    blocking: Literal[False],
    **extra: Any,
) -> PendingSave: ...


@overload
def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    keep_last: int | None = None,
    blocking: bool,
    **extra: Any,
) -> Path | PendingSave: ...


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: Optimizers = None,
    *,
    keep_last: int | None = None,
    blocking: bool = True,
    **extra: Any,
) -> Path | PendingSave:
    """Save a sharded checkpoint that loads at any world size and ``auto_wrap`` policy.

    Every rank writes its own pieces of the parameters and of the optimizer state, in
    parallel and without gathering; rank 0 writes the metadata. The save is atomic: files go
    to a temporary folder next to ``path``, are fsynced, and the folder is renamed to
    ``path`` once every rank is done; then ``path.parent/latest`` is pointed at it. A save
    that fails, or is killed, before that leaves the previous checkpoint and pointer intact;
    a failed one leaves no temporary files behind. Call on every rank.

    Args:
        path: the checkpoint folder to create, e.g. ``ckpt/step-1000``: a path that does
            not exist yet, an empty folder, or a checkpoint of this function to replace.
        model: a model wrapped with :class:`ShardedModule`.
        optimizer: an optimizer over ``model.parameters()``, or a list of optimizers over
            disjoint parts of them (``[muon, adamw]``); per-parameter state, scalar state
            (``step``) and ``param_groups`` hyperparameters are saved by parameter name.
        keep_last: once the new checkpoint is complete, delete all but the newest
            ``keep_last`` checkpoints in ``path.parent`` (and leftovers of killed saves).
        blocking: ``False`` returns once this rank's state is copied to host memory and
            writes the checkpoint in a background thread, with the same files, checks and
            atomic commit, while training goes on; what is saved is the state at the call.
            Costs one host copy of this rank's shards and optimizer state, kept for the
            model's next non-blocking save. A save started
            while one is being written (on the same ranks) waits for it first. See
            :mod:`shardwrap.checkpoint.background`.
        **extra: anything ``torch.load(weights_only=True)`` reads back (step, scheduler and
            data-loader state dicts, RNG states), saved per rank; see :func:`load_checkpoint`.

    Returns:
        ``path``, as a ``Path``; with ``blocking=False`` a :class:`PendingSave` whose
        ``wait()`` returns it once the checkpoint is complete, and ``done()`` says whether
        the write has ended.

    Raises:
        TypeError: an ``extra`` value that ``load_checkpoint`` could not read back, naming
            its key, or an ``optimizer`` that is neither an optimizer nor a list of them;
            raised on every rank before anything is written.
        ValueError: state of an elementwise optimizer that is not elementwise (state of one
            stepping whole parameters, Muon or Adafactor, is saved whole by each parameter's
            owner), an optimizer parameter that is not the model's or is in two optimizers;
            or a ``path`` holding anything but a checkpoint's own files (replacing it would
            delete them). Raised on every rank before anything is written.
        OSError: a full disk or quota (``errno`` ``ENOSPC`` or ``EDQUOT``), on every rank,
            naming the checkpoint, the bytes it needs and those free, once its temporary
            files are deleted.
        Exception: with ``blocking=False``, errors met while writing are raised on every rank
            by the handle's ``wait()``, or else by the next save on those ranks, which then
            saves nothing; the checks above still raise at the call.
    """
    root = wrapped_root(model, "save_checkpoint")
    writers = writers_of(root)
    settle(writers)  # the previous save, if still writing; raises its error
    optimizers = as_list(optimizer, "save_checkpoint")
    for o in optimizers if root.optimizers is not None else ():
        root.optimizers.add(o)  # its steps get the offload tier's hook from now
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    target = Path(path)
    mesh = root.mesh
    rank, world = mesh.shard_rank, mesh.shard_size
    params = root.params
    tmp = partial_path(target)
    plans: list[OptimizerPlan] = []
    extra_bytes = b""
    entries: list[Entry] = []
    tensors: list[Tensor] = []
    needed = 0  # bytes of the whole checkpoint's tensor and extra files, once known
    staged: Path | None = None
    buffers: dict[str, Tensor] = {}  # rank 0's
    copied: Callable[[], None] = _filled  # waits until a snapshot is filled

    def prepare() -> int:
        """Check ``path`` and what is saved, and return the bytes this rank will write."""
        nonlocal plans, extra_bytes, needed, buffers, tensors, copied
        _refuse_to_replace(target)
        extra_bytes = extra_bytes_of(extra)
        plans = plan_optimizers(model, optimizers)
        for p in params if mesh.writes else ():
            if p.shard.numel() == 0:
                continue
            entries.append((f"model/{p.name}", (p.shard.numel(),), p.shard.dtype))
            tensors.append(p.shard.reshape(-1))
            for key, value in (kv for plan in plans for kv in plan.sharded.get(p.name, {}).items()):
                entries.append((f"optim/{key}/{p.name}", (value.numel(),), value.dtype))
                tensors.append(value.reshape(-1))
        for plan in plans if mesh.writes else ():
            for name, state in plan.owned.items():
                for key, value in state.items():  # stepped whole: in the state's own shape
                    entries.append((f"optim/{key}/{name}", tuple(value.shape), value.dtype))
                    tensors.append(value)
        needed = len(extra_bytes)
        if mesh.writes:
            needed += safetensors_nbytes(entries, {"format": "pt"})
        if mesh.rank == 0:
            buffers = persistent_buffers(model, params)
            needed += safetensors_nbytes(
                [(k, tuple(v.shape), v.dtype) for k, v in buffers.items()], {"format": "pt"}
            )
        if not blocking:  # the state as of now, whatever training does next
            copies, copied = snapshot(root, [*tensors, *buffers.values()])
            tensors, plans = copies[: len(tensors)], snapshot_plans(plans)
            buffers = dict(zip(buffers, copies[len(tensors) :]))
        if mesh.rank == 0:
            begin_folder(target)
        return needed

    def write_rank_files() -> int:
        """Write this rank's extra, and its shard's file if it is the shard's writing replica.

        Returns ``1 + size * world + shard rank`` for a writer, ``0`` for anyone else, so one
        agreement tells rank 0 every shard file's size.
        """
        copied()  # a snapshot on a GPU is filled by now
        write_file(tmp / extra_file(mesh.rank), extra_bytes)
        if not mesh.writes:
            return 0
        # a snapshot is the save's own memory: written from it, not through copies
        file = tmp / rank_file(rank, world)
        with SafetensorsWriter(file, entries, {"format": "pt"}, in_place=not blocking) as w:
            for t in tensors:
                w.write(t)
            size = w.close()
        write_file(tmp / _checksum_file(rank), json.dumps(w.checksums).encode())
        if any(plan.whole for plan in plans):
            buffer = io.BytesIO()
            torch.save(owned_summary(plans, rank_file(rank, world)), buffer)
            write_file(tmp / _owned_file(rank), buffer.getvalue())
        return 1 + size * world + rank

    def finish(codes: list[int]) -> int:
        nonlocal staged
        if mesh.rank == 0:
            sizes = [0] * world
            for code in (c - 1 for c in codes if c > 0):
                sizes[code % world] = code // world
            _restore_moved_aside(target.parent)
            sequence = 1 + max((n for n, _, _ in _completed(target.parent)), default=0)
            listed = isinstance(optimizer, (list, tuple))
            metadata = _metadata(
                buffers, params, plans, listed, sizes, mesh.world_size, sequence, tmp
            )
            write_file(tmp / METADATA, json.dumps(metadata, indent=1).encode())
            staged = stage_latest(target.parent, target.name)  # the last bytes written
            commit_folder(tmp, target)
            point_latest(staged)
            if keep_last is not None:
                _prune(target.parent, keep_last, target)
        return 0

    def undo() -> None:
        """After a failure anywhere: rank 0 deletes what this save wrote and did not commit."""
        if mesh.rank == 0:
            remove_folder(tmp)
            if staged is not None:
                staged.unlink(missing_ok=True)

    def retold(e: Exception) -> Exception:
        """``e``, or for a full disk the error naming the bytes needed and free."""
        full = full_disk_error(
            e,
            "save_checkpoint",
            target,
            needed,
            f"Nothing of it was kept, and '{LATEST}' and the checkpoints before it are as "
            "they were. Free space there (keep_last deletes older checkpoints once a save "
            "completes), or save to another disk.",
        )
        return e if full is None else full

    def write(group: Any, device: torch.device | None) -> None:
        """Write every rank's files, then commit (rank 0), agreeing over ``group``."""
        try:
            codes = agree(group, device, "save_checkpoint", write_rank_files, undo)
            agree(group, device, "save_checkpoint", lambda: finish(codes), undo)
        except Exception as e:
            raised = retold(e)
            if raised is e:
                raise
            raise raised from e

    control, device = mesh.control, mesh.control_device
    try:
        needed = sum(agree(control, device, "save_checkpoint", prepare, undo))
    except Exception as e:
        raised = retold(e)
        if raised is e:
            raise
        raise raised from e
    if blocking:
        write(control, device)
        return target
    # NOTE: the writer thread agrees over a group of its own: on the control group its
    # collectives would interleave with the training loop's (see background.py).
    group = writer_group(control)

    pending = PendingSave(target, lambda: write(group, torch.device("cpu")))
    settle(writers, pending)
    return pending


def _filled() -> None:
    """A blocking save's snapshot: nothing to wait for."""


def _metadata(
    buffers: dict[str, Tensor],
    params: list[Param],
    plans: list[OptimizerPlan],
    listed: bool,
    rank_sizes: list[int],
    ranks: int,
    sequence: int,
    tmp: Path,
) -> dict[str, Any]:
    """The checkpoint's metadata; writes the rank-0-only files on the way (rank 0).

    ``buffers``: the model's persistent buffers, as saved; ``plans``: one per optimizer passed
    (none: ``[]``); ``listed``: passed as a list.

    Gathers the checksums: every rank file's (left by its writer, then removed), the
    buffers', and those of the whole ``.pt`` files.
    """
    world = len(rank_sizes)
    files = {rank_file(r, world): size for r, size in enumerate(rank_sizes)}
    tensor_sums: dict[str, dict[str, list[str]]] = {}
    file_sums: dict[str, str] = {}
    for r in range(world):
        left = tmp / _checksum_file(r)
        tensor_sums[rank_file(r, world)] = json.loads(left.read_bytes())
        left.unlink()
    for r in range(ranks):
        file_sums[extra_file(r)] = buffer_checksum((tmp / extra_file(r)).read_bytes())
    entries: dict[str, Any] = {}
    for p in params:
        pieces = [
            [rank_file(r, world), pc.start, pc.stop] for r, pc in p.group.layout.owners(p.index)
        ]
        entries[p.name] = {
            "shape": list(p.shape),
            "dtype": _dtype_name(p.group.dtype),
            "pieces": pieces,
        }
    with SafetensorsWriter(
        tmp / BUFFERS, [(k, tuple(v.shape), v.dtype) for k, v in buffers.items()], {"format": "pt"}
    ) as w:
        for v in buffers.values():
            w.write(v)
        files[BUFFERS] = w.close()
    tensor_sums[BUFFERS] = w.checksums
    optimizer = None
    if plans:
        summaries = []  # each writing owner's whole-stepped state, left for rank 0
        for r in range(world) if any(plan.whole for plan in plans) else ():
            left = tmp / _owned_file(r)
            summaries.append(torch.load(io.BytesIO(left.read_bytes()), weights_only=True))
            left.unlink()
        saved, optimizer = optimizer_record(plans, listed, summaries)
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        files[OPTIMIZER] = write_file(tmp / OPTIMIZER, buffer.getvalue())
        file_sums[OPTIMIZER] = buffer_checksum(buffer.getvalue())
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved_at_ns": time.time_ns(),
        "sequence": sequence,
        "world_size": world,
        "ranks": ranks,
        "files": files,
        "params": entries,
        "buffers": {
            k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in buffers.items()
        },
        "optimizer": optimizer,
        "checksums": {"tensors": tensor_sums, "files": file_sums},
    }


def _completed(folder: Path) -> list[tuple[int, int, Path]]:
    """The complete checkpoints in ``folder``: (save sequence, save time, path), oldest first.

    Order is the sequence each save took as it completed; the clock only orders checkpoints
    written before saves were numbered, all of which come first.
    """
    found = []
    for child in folder.iterdir() if folder.is_dir() else ():
        if child.name.startswith("."):
            continue
        meta = _metadata_of(child)
        if meta is not None:
            sequence, saved = meta.get("sequence", 0), meta.get("saved_at_ns", 0)
            if isinstance(sequence, int) and isinstance(saved, int):
                found.append((sequence, saved, child))
    return sorted(found)


def _restore_moved_aside(folder: Path) -> None:
    """Put back every checkpoint of ``folder`` that a killed replacing save left moved aside."""
    for child in folder.iterdir():
        if child.name.startswith(".") and child.name.endswith(".old"):
            restore_moved_aside(folder / child.name[1 : -len(".old")])


def _prune(folder: Path, keep_last: int, newest: Path) -> None:
    """Delete all but the last ``keep_last`` completed checkpoints, and leftovers (rank 0).

    ``newest``, the save just completed and what ``latest`` names, is never deleted.
    """
    for child in folder.iterdir():
        if child.name.startswith(".") and child.name.endswith((".partial", ".deleting", ".old")):
            shutil.rmtree(child)
    done = [path for _, _, path in _completed(folder) if path != newest]
    for path in done[: max(0, len(done) - (keep_last - 1))]:
        remove_folder(path)
