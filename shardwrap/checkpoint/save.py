"""Sharded checkpoints: every rank writes its own pieces; any world size and policy loads them.

Design note. Nothing on disk depends on the world size or the ``auto_wrap`` policy that
wrote it: every tensor is keyed by the parameter's original (canonical) name and by an
element range ``[start, stop)`` of the flattened parameter. Rank ``r`` writes the pieces its
shards hold, with no collective beyond three small agreements (see
:func:`~shardwrap.checkpoint.files.agree`); rank 0 adds the metadata, which it computes from the
flat layouts without asking anyone. With hybrid sharding the first replica writes the shard
files and every other replica writes only its ``extra``: a checkpoint is written once, and
loads at any mesh. A loading rank intersects its own pieces (for its world size and policy)
with the saved ranges and reads only those bytes, memory-mapped. The files of a checkpoint
folder are listed in :mod:`shardwrap.checkpoint.format`.

With tensor parallelism each rank of one copy of the model (dp x tp) writes a file: a
tp-split parameter's ranges are of its blocks stacked in tp order (``engine/shards/split.py``),
recorded with the split (``"split": [dim, parts]``), so a load at another tp degree maps them
to its own; what every tp rank holds alike is written by the first tp rank alone.

Optimizer state is split by shape: a tensor shaped like the shard parameter (Adam's
moments, SGD's momentum) is sharded like the parameter; a 0-d tensor or a number (``step``)
is a scalar, equal on every rank, saved once by rank 0. An optimizer that steps parameters
whole (Muon, Adafactor: :mod:`shardwrap.engine.optim.whole_params`) holds a parameter's state on
its owner rank alone, in the state's own shapes (a matrix's momentum, Adafactor's row and
column variances): the owner writes those tensors whole into its rank file (``optim/KEY/NAME``)
and hands their shapes and its scalars to rank 0 through a small file, and the metadata records
which file holds each (``whole_state``). A load gives them to the owners of the new layout.
Any other state of an elementwise optimizer has no meaning per element range and is refused.

One call is one :class:`_Save`: its phases are methods, run on every rank inside agreements;
``blocking`` decides only whether :meth:`_Save.write` runs on the caller's thread or on a
writer thread (:mod:`shardwrap.checkpoint.background`).
"""

from __future__ import annotations

import io
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch import Tensor, nn

from ..engine.shards.param_index import Param
from ..engine.step.root import Root
from .background import (
    PendingSave,
    begin,
    forget_writer_group,
    previous_save,
    raise_unseen,
    snapshot,
    snapshot_plans,
    writer_group,
)
from .checksum import buffer_checksum
from .entry import wrapped_root, writers_of
from .extra import extra_bytes_of
from .files import (
    LATEST,
    Entry,
    SafetensorsWriter,
    agree,
    agree_path,
    begin_folder,
    commit_folder,
    full_disk_error,
    partial_path,
    point_latest,
    remove_folder,
    safetensors_nbytes,
    stage_latest,
    write_file,
)
from .folder import check_latest, completed, prune, refuse_to_replace, restore_all_moved_aside
from .format import (
    BUFFERS,
    FORMAT,
    METADATA,
    OPTIMIZER,
    UNSPLIT_VERSION,
    VERSION,
    checksum_file,
    dtype_name,
    extra_file,
    latest_checkpoint,
    owned_file,
    persistent_buffers,
    rank_file,
    residuals_file,
)
from .optimizer_state import (
    OptimizerPlan,
    Optimizers,
    as_list,
    optimizer_record,
    owned_summary,
    plan_optimizers,
)
from .residuals import residual_layout, residuals_of

__all__ = ["PendingSave", "latest_checkpoint", "save_checkpoint"]


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
            its key, an ``optimizer`` that is neither an optimizer nor a list of them, or a
            ``blocking`` that is not a bool; raised on every rank before anything is written.
        ValueError: state of an elementwise optimizer that is not elementwise (state of one
            stepping whole parameters, Muon or Adafactor, is saved whole by each parameter's
            owner), an optimizer parameter that is not the model's or is in two optimizers;
            or a ``path`` holding anything but a checkpoint's own files (replacing it would
            delete them). Raised on every rank before anything is written.
        OSError: a full disk or quota (``errno`` ``ENOSPC`` or ``EDQUOT``), on every rank,
            naming the checkpoint, the bytes it needs and those free, once its temporary
            files are deleted.
        Exception: with ``blocking=False``, errors met while writing are raised by the
            handle's ``wait()`` on each rank that calls it; unless ``wait()`` raised it on every
            rank, the next save raises it on every rank and saves nothing (on the ranks that
            had seen it, a ``RuntimeError`` naming those that had not). Starting the write
            (its thread, its group) raises on every rank if it fails on one. The checks above
            still raise at the call.
    """
    model, root = wrapped_root(model, "save_checkpoint")
    writers = writers_of(root)
    previous = previous_save(writers)  # waited for by wrapped_root
    control, device = root.mesh.control, root.mesh.control_device
    if previous is not None:
        raise_unseen(previous, control, device, "save_checkpoint")
    path = agree_path(control, device, "save_checkpoint", path)
    optimizers = as_list(optimizer, "save_checkpoint")
    for o in optimizers if root.optimizers is not None else ():
        root.optimizers.add(o)  # its steps get the offload tier's hook from now
    _check_options(keep_last, blocking)
    listed = isinstance(optimizer, (list, tuple))
    save = _Save(root, model, Path(path), optimizers, listed, keep_last, blocking, extra)
    try:
        save.needed = sum(agree(control, device, "save_checkpoint", save.prepare, save.undo))
    except Exception as e:
        raised = save.retold(e)
        if raised is e:
            raise
        raise raised from e
    if blocking:
        save.write(control, device)
        return save.target
    agree(control, device, "save_checkpoint", save.start, save.abandon)
    assert save.pending is not None
    begin(writers, save.pending)
    return save.pending


def _check_options(keep_last: object, blocking: object) -> None:
    """Raise unless ``keep_last`` is ``None`` or an int of at least 1 and ``blocking`` a bool
    (``blocking="False"`` is a true value: read as one it would block, the opposite)."""
    if keep_last is not None and (
        not isinstance(keep_last, int) or isinstance(keep_last, bool) or keep_last < 1
    ):
        raise ValueError(
            f"save_checkpoint: keep_last must be None or an int of at least 1 (the checkpoints "
            f"kept), got {keep_last!r}; e.g. keep_last=3"
        )
    if not isinstance(blocking, bool):
        raise TypeError(f"save_checkpoint: blocking must be True or False, got {blocking!r}")


class _Save:
    """One rank's part of one ``save_checkpoint`` call.

    Built on the caller's thread; :meth:`prepare` runs there inside the first agreement, and
    :meth:`write` on the caller's thread or a writer thread. Everything it needs from the model
    is read at the call, and a write reads nothing of the model afterwards.

    NOTE: who this rank is (its ranks, whether it writes its shard) is read from the mesh once,
    here: at interpreter exit the mesh drops its groups (``comm/mesh.py``), and a mesh without
    groups answers rank 0 of 1. The exit waits for writers first (``background.py``); read at
    the call, a write does not depend on that order.
    """

    def __init__(
        self,
        root: Root,
        model: nn.Module,
        target: Path,
        optimizers: list[torch.optim.Optimizer],
        listed: bool,
        keep_last: int | None,
        blocking: bool,
        extra: dict[str, Any],
    ) -> None:
        self.root, self.model = root, model
        mesh = root.mesh
        self.target, self.tmp = target, partial_path(target)
        self.optimizers, self.listed = optimizers, listed
        self.keep_last, self.blocking, self.extra = keep_last, blocking, extra
        # among the ranks of one copy of the model (shard x tp), each writing a file
        self.rank, self.world = mesh.model_rank, mesh.shard_size * mesh.tp_size
        self.tp, self.first_tp = mesh.tp_size, mesh.tp_rank == 0
        self.me, self.ranks = mesh.rank, mesh.world_size  # among every rank of the model
        self.writes = mesh.writes  # this rank writes its shard's file (the first replica)
        self.params: list[Param] = root.params
        self.plans: list[OptimizerPlan] = []
        self.extra_bytes = b""
        self.entries: list[Entry] = []
        self.tensors: list[Tensor] = []
        self.needed = 0  # bytes of the whole checkpoint's tensor and extra files, once known
        self.staged: Path | None = None
        self.buffers: dict[str, Tensor] = {}  # rank 0's
        self.copied: Callable[[], None] = _filled  # waits until a snapshot is filled
        self.pending: PendingSave | None = None  # a non-blocking save's writer, once started
        self.residuals: list[tuple[str, Tensor]] = []  # this rank's error feedback, by key
        self.residual_layout: dict[str, Any] | None = None  # what they are relative to

    def prepare(self) -> int:
        """Check ``path`` and what is saved, and return the bytes this rank will write."""
        refuse_to_replace(self.target)
        check_latest(self.target.parent)
        self.extra_bytes = extra_bytes_of(self.extra)
        self.plans = plan_optimizers(self.model, self.optimizers)
        if not self.first_tp:  # what every tp rank holds alike: the first one's is written
            self._drop_replicated()
        for p in self.params if self.writes else ():
            if p.shard.numel() == 0 or not (self.first_tp or p.group.splits[p.index].is_split):
                continue
            self.entries.append((f"model/{p.name}", (p.shard.numel(),), p.shard.dtype))
            self.tensors.append(p.shard.reshape(-1))
            for key, value in (
                kv for plan in self.plans for kv in plan.sharded.get(p.name, {}).items()
            ):
                self.entries.append((f"optim/{key}/{p.name}", (value.numel(),), value.dtype))
                self.tensors.append(value.reshape(-1))
        for plan in self.plans if self.writes else ():
            for name, state in plan.owned.items():
                for key, value in state.items():  # stepped whole: in the state's own shape
                    self.entries.append((f"optim/{key}/{name}", tuple(value.shape), value.dtype))
                    self.tensors.append(value)
        needed = len(self.extra_bytes)
        if self.writes:
            needed += safetensors_nbytes(self.entries, {"format": "pt"})
        if self.me == 0:
            self.buffers = persistent_buffers(self.model, self.params)
            needed += safetensors_nbytes(
                [(k, tuple(v.shape), v.dtype) for k, v in self.buffers.items()], {"format": "pt"}
            )
        self.residuals = residuals_of(self.root.reductions)
        if self.residuals:  # every rank keeps them alike, each its own values
            self.residual_layout = residual_layout(self.root.reductions, self.root.mesh)
            needed += safetensors_nbytes(_entries(self.residuals), {"format": "pt"})
        if not self.blocking:  # the state as of now, whatever training does next
            residuals = [t for _, t in self.residuals]
            # the step counters' copies first: on a GPU the snapshot's event then covers them
            self.plans = snapshot_plans(self.plans)
            copies, self.copied = snapshot(
                self.root, [*self.tensors, *self.buffers.values(), *residuals]
            )
            n, b = len(self.tensors), len(self.buffers)
            self.tensors = copies[:n]
            self.buffers = dict(zip(self.buffers, copies[n : n + b]))
            self.residuals = [(k, t) for (k, _), t in zip(self.residuals, copies[n + b :])]
        if self.me == 0:
            begin_folder(self.target)
        return needed

    def _drop_replicated(self) -> None:
        """Forget the whole-stepped state of parameters every tp rank holds alike (each tp
        rank's shard group has an owner for them; the first tp rank's owner writes theirs)."""
        split = {p.name for p in self.params if p.group.splits[p.index].is_split}
        for plan in self.plans:
            plan.owned = {n: v for n, v in plan.owned.items() if n in split}
            if plan.whole:
                plan.scalars = {n: v for n, v in plan.scalars.items() if n in split}

    def start(self) -> int:
        """Start a non-blocking save's writer thread, held until every rank has started its
        own (:meth:`PendingSave.go`)."""
        control = self.root.mesh.control
        # NOTE: the writer thread agrees over a group of its own: on the control group its
        # collectives would interleave with the training loop's (see background.py).
        group = writer_group(control)
        self.pending = PendingSave(
            self.target, self.me, lambda: self.write(group, torch.device("cpu"))
        )
        return 0

    def abandon(self) -> None:
        """After a start that failed anywhere: no writer writes, and a writer group that some
        rank lacks is made again next time; then what :meth:`undo` deletes."""
        if self.pending is not None:
            self.pending.cancel()
        forget_writer_group(self.root.mesh.control)
        self.undo()

    def write_rank_files(self) -> int:
        """Write this rank's extra, and its shard's file if it is the shard's writing replica.

        Returns ``1 + size * world + shard rank`` for a writer, ``0`` for anyone else, so one
        agreement tells rank 0 every shard file's size.
        """
        self.copied()  # a snapshot on a GPU is filled by now
        write_file(self.tmp / extra_file(self.me), self.extra_bytes)
        if self.residuals:
            self._write_tensors(residuals_file(self.me), self.residuals)
        if not self.writes:
            return 0
        rank, world = self.rank, self.world
        # a snapshot is the save's own memory: written from it, not through copies
        file = self.tmp / rank_file(rank, world)
        with SafetensorsWriter(
            file, self.entries, {"format": "pt"}, in_place=not self.blocking
        ) as w:
            for t in self.tensors:
                w.write(t)
            size = w.close()
        write_file(self.tmp / checksum_file(file.name), json.dumps(w.checksums).encode())
        if any(plan.whole for plan in self.plans):
            buffer = io.BytesIO()
            torch.save(owned_summary(self.plans, rank_file(rank, world)), buffer)
            write_file(self.tmp / owned_file(rank), buffer.getvalue())
        return 1 + size * world + rank

    def _write_tensors(self, name: str, tensors: list[tuple[str, Tensor]]) -> None:
        """Write ``tensors`` (1-D) into the file ``name``, and its checksums for rank 0."""
        with SafetensorsWriter(
            self.tmp / name, _entries(tensors), {"format": "pt"}, in_place=not self.blocking
        ) as w:
            for _, t in tensors:
                w.write(t)
            w.close()
        write_file(self.tmp / checksum_file(name), json.dumps(w.checksums).encode())

    def finish(self, codes: list[int]) -> int:
        """Rank 0: write the metadata, commit the folder, point ``latest`` at it, prune."""
        if self.me != 0:
            return 0
        world, parent = self.world, self.target.parent
        sizes = [0] * world
        for code in (c - 1 for c in codes if c > 0):
            sizes[code % world] = code // world
        restore_all_moved_aside(parent)
        sequence = 1 + max((n for n, _, _ in completed(parent)), default=0)
        metadata = self._metadata(sizes, sequence)
        write_file(self.tmp / METADATA, json.dumps(metadata, indent=1).encode())
        self.staged = stage_latest(parent, self.target.name)  # the last bytes written
        commit_folder(self.tmp, self.target)
        point_latest(self.staged)
        if self.keep_last is not None:
            prune(parent, self.keep_last, self.target)
        return 0

    def undo(self) -> None:
        """After a failure anywhere: rank 0 deletes what this save wrote and did not commit."""
        if self.me == 0:
            remove_folder(self.tmp)
            if self.staged is not None:
                self.staged.unlink(missing_ok=True)

    def retold(self, e: Exception) -> Exception:
        """``e``, or for a full disk the error naming the bytes needed and free."""
        full = full_disk_error(
            e,
            "save_checkpoint",
            self.target,
            self.needed,
            f"Nothing of it was kept, and '{LATEST}' and the checkpoints before it are as "
            "they were. Free space there (keep_last deletes older checkpoints once a save "
            "completes), or save to another disk.",
        )
        return e if full is None else full

    def write(self, group: Any, device: torch.device | None) -> None:
        """Write every rank's files, then commit (rank 0), agreeing over ``group``."""
        try:
            codes = agree(group, device, "save_checkpoint", self.write_rank_files, self.undo)
            agree(group, device, "save_checkpoint", lambda: self.finish(codes), self.undo)
        except Exception as e:
            raised = self.retold(e)
            if raised is e:
                raise
            raise raised from e

    def _metadata(self, rank_sizes: list[int], sequence: int) -> dict[str, Any]:
        """The checkpoint's metadata; writes the rank-0-only files on the way (rank 0).

        Gathers the checksums: every rank file's and residuals file's (left by its writer,
        then removed), the buffers', and those of the whole ``.pt`` files.
        """
        tmp, world, buffers = self.tmp, len(rank_sizes), self.buffers
        files = {rank_file(r, world): size for r, size in enumerate(rank_sizes)}
        tensor_sums: dict[str, dict[str, list[str]]] = {}
        file_sums: dict[str, str] = {}
        written = [rank_file(r, world) for r in range(world)]
        if self.residuals:  # every rank wrote its own
            written += [residuals_file(r) for r in range(self.ranks)]
        for name in written:
            left = tmp / checksum_file(name)
            tensor_sums[name] = json.loads(left.read_bytes())
            left.unlink()
            files.setdefault(name, (tmp / name).stat().st_size)
        for r in range(self.ranks):
            file_sums[extra_file(r)] = buffer_checksum((tmp / extra_file(r)).read_bytes())
        entries: dict[str, Any] = {}
        for p in self.params:
            split = p.group.splits[p.index]
            blocks = self.tp if split.is_split else 1  # the first tp rank's file, else each's
            pieces = [
                [rank_file(r * self.tp + t, world), at + pc.start, at + pc.stop]
                for t, at in ((t, t * split.block_numel) for t in range(blocks))
                for r, pc in p.group.layout.owners(p.index)
            ]
            entries[p.name] = {
                "shape": list(p.shape),
                "dtype": dtype_name(p.group.dtype),
                "pieces": pieces,
            }
            if split.is_split:
                entries[p.name]["split"] = [split.dim, split.parts]
        with SafetensorsWriter(
            tmp / BUFFERS,
            [(k, tuple(v.shape), v.dtype) for k, v in buffers.items()],
            {"format": "pt"},
        ) as w:
            for v in buffers.values():
                w.write(v)
            files[BUFFERS] = w.close()
        tensor_sums[BUFFERS] = w.checksums
        optimizer = None
        if self.plans:
            summaries = []  # each writing owner's whole-stepped state, left for rank 0
            for r in range(world) if any(plan.whole for plan in self.plans) else ():
                left = tmp / owned_file(r)
                summaries.append(torch.load(io.BytesIO(left.read_bytes()), weights_only=True))
                left.unlink()
            saved, optimizer = optimizer_record(self.plans, self.listed, summaries)
            buffer = io.BytesIO()
            torch.save(saved, buffer)
            files[OPTIMIZER] = write_file(tmp / OPTIMIZER, buffer.getvalue())
            file_sums[OPTIMIZER] = buffer_checksum(buffer.getvalue())
        split = any("split" in entry for entry in entries.values())
        return {
            "format": FORMAT,
            "version": VERSION if split else UNSPLIT_VERSION,
            "saved_at_ns": time.time_ns(),
            "sequence": sequence,
            "name": self.target.name,
            "world_size": world,
            "ranks": self.ranks,
            "files": files,
            "params": entries,
            "buffers": {
                k: {"shape": list(v.shape), "dtype": dtype_name(v.dtype)}
                for k, v in buffers.items()
            },
            "optimizer": optimizer,
            "checksums": {"tensors": tensor_sums, "files": file_sums},
            "residuals": self.residual_layout,
        }


def _filled() -> None:
    """A blocking save's snapshot: nothing to wait for."""


def _entries(tensors: list[tuple[str, Tensor]]) -> list[Entry]:
    return [(key, (t.numel(),), t.dtype) for key, t in tensors]
