"""Sharded checkpoints: every rank writes its own pieces; any world size and policy loads them.

Design note. Nothing on disk depends on the world size or the ``auto_wrap`` policy that
wrote it: every tensor is keyed by the parameter's original (canonical) name and by an
element range ``[start, stop)`` of the flattened parameter. Rank ``r`` writes the pieces its
shards hold, with no collective beyond three small agreements (see
:func:`~shardwrap._storage.agree`); rank 0 adds the metadata, which it computes from the
flat layouts without asking anyone. A loading rank intersects its own pieces (for its world
size and policy) with the saved ranges and reads only those bytes, memory-mapped. A folder::

    metadata.json                     names, full shapes, dtypes, which file holds which range
    rank-00000-of-00002.safetensors   rank 0's pieces, 1-D: model/NAME and optim/KEY/NAME
    rank-00001-of-00002.safetensors
    buffers.safetensors               buffers (BatchNorm statistics), from rank 0
    optimizer.pt                      optimizer class, param_groups by name, scalar state
    extra-00000.pt, extra-00001.pt    each rank's ``**extra``

Optimizer state is split by shape: a tensor shaped like the 1-D shard parameter (Adam's
moments, SGD's momentum) is sharded like the parameter; a 0-d tensor or a number (``step``)
is a scalar, equal on every rank, saved once by rank 0. Any other state (a factored or
matrix preconditioner) has no meaning per element range and is refused at save time.
"""

from __future__ import annotations

import io
import json
import shutil
import time
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ._collectives import group_rank, group_size
from ._root import Phase, Root
from ._storage import (
    LATEST,
    Entry,
    SafetensorsWriter,
    agree,
    begin_folder,
    commit_folder,
    partial_path,
    remove_folder,
    write_file,
    write_latest,
)
from ._unit import FlatGroup

__all__ = ["latest_checkpoint", "load_checkpoint", "save_checkpoint"]

FORMAT = "shardwrap.checkpoint"
VERSION = 1
METADATA = "metadata.json"
BUFFERS = "buffers.safetensors"
OPTIMIZER = "optimizer.pt"


@dataclass(frozen=True)
class Param:
    """One parameter as this rank holds it: its flat group and its index in it."""

    name: str
    group: FlatGroup
    index: int

    @property
    def shard(self) -> nn.Parameter:  # 1-D, this rank's piece (possibly empty)
        return self.group.shard_params[self.index]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.group.shapes[self.index])


def wrapped_root(model: nn.Module, caller: str) -> Root:
    root = getattr(model, "_shardwrap_root", None)
    if not isinstance(root, Root):
        raise TypeError(
            f"{caller} takes a model wrapped with ShardedModule, got {type(model).__name__}"
        )
    if root.phase is not Phase.IDLE:
        raise RuntimeError(f"{caller} cannot run during forward or backward")
    return root


def flat_params(root: Root) -> list[Param]:
    return [
        Param(name, g, i) for u in root.units for g in u.groups for i, name in enumerate(g.names)
    ]


def persistent_buffers(model: nn.Module, params: list[Param]) -> dict[str, Tensor]:
    """The persistent buffers of the state dict (everything that is not a parameter)."""
    shard_ids = {id(p.shard) for p in params}
    return {
        k: v
        for k, v in nn.Module.state_dict(model, keep_vars=True).items()
        if isinstance(v, Tensor) and id(v) not in shard_ids
    }


def _rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def _extra_file(rank: int) -> str:
    return f"extra-{rank:05d}.pt"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint that ``folder/latest`` points to, or ``None`` if there is none yet."""
    pointer = Path(folder) / LATEST
    if not pointer.is_file():
        return None
    return Path(folder) / pointer.read_text().strip()


def _resolve(path: Path) -> Path:
    if (path / METADATA).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"load_checkpoint: no checkpoint at {path}: it holds neither {METADATA} nor a "
            f"'{LATEST}' pointer (no save to it has completed yet)"
        )
    if not (latest / METADATA).is_file():
        raise FileNotFoundError(
            f"load_checkpoint: {path / LATEST} points to {latest}, which has no {METADATA}"
        )
    return latest


# save --------------------------------------------------------------------------------


@dataclass
class _OptimizerPlan:
    """What one rank saves of the optimizer: sharded tensors, and scalars and groups for rank 0."""

    cls: str  # the optimizer's class name
    sharded: dict[str, dict[str, Tensor]]  # name -> state key -> 1-D piece
    scalars: dict[str, dict[str, Any]]  # name -> state key -> 0-d tensor or number
    groups: list[dict[str, Any]]  # hyperparameters, "params": names


def _names_by_id(model: nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def _plan_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> _OptimizerPlan:
    names = _names_by_id(model)
    plan = _OptimizerPlan(type(optimizer).__name__, {}, {}, [])
    for group in optimizer.param_groups:
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        group_names = []
        for p in group["params"]:
            if id(p) not in names:
                raise ValueError(
                    "save_checkpoint: the optimizer holds a parameter that is not one of the "
                    f"model's (shape {tuple(p.shape)}); build it from model.parameters() after "
                    "wrapping"
                )
            name = names[id(p)]
            group_names.append(name)
            sharded, scalars = {}, {}
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.ndim == 1 and value.numel() == p.numel():
                    sharded[key] = value
                elif (isinstance(value, Tensor) and value.ndim == 0) or isinstance(
                    value, (int, float, bool)
                ):
                    scalars[key] = value
                else:
                    raise ValueError(
                        f"save_checkpoint: optimizer state '{key}' of '{name}' is a "
                        f"{type(value).__name__} of shape {tuple(getattr(value, 'shape', ()))}, "
                        "neither shaped like the parameter nor a scalar; only elementwise "
                        "optimizers (SGD, Adam, AdamW, Adagrad, RMSprop, ...) can be saved sharded"
                    )
            if sharded or scalars or p in optimizer.state:
                plan.sharded[name], plan.scalars[name] = sharded, scalars
        plan.groups.append({**hyper, "params": group_names})
    return plan


def save_checkpoint(
    path: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    keep_last: int | None = None,
    **extra: Any,
) -> Path:
    """Save a sharded checkpoint that loads at any world size and ``auto_wrap`` policy.

    Every rank writes its own pieces of the parameters and of the optimizer state, in
    parallel and without gathering; rank 0 writes the metadata. The save is atomic: files go
    to a temporary folder next to ``path``, are fsynced, and the folder is renamed to
    ``path`` once every rank is done; then ``path.parent/latest`` is pointed at it. A save
    killed before that leaves the previous checkpoint and pointer intact. Call on every rank.

    Args:
        path: the checkpoint folder to create (replaced if it exists), e.g. ``ckpt/step-1000``.
        model: a model wrapped with :class:`ShardedModule`.
        optimizer: an optimizer over ``model.parameters()``; its per-parameter state, scalar
            state (``step``) and ``param_groups`` hyperparameters are saved by parameter name.
        keep_last: once the new checkpoint is complete, delete all but the newest
            ``keep_last`` checkpoints in ``path.parent`` (and leftovers of killed saves).
        **extra: anything ``torch.load(weights_only=True)`` reads back (step, scheduler and
            data-loader state dicts, RNG states), saved per rank; see :func:`load_checkpoint`.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        ValueError: optimizer state that is not elementwise, or an optimizer parameter that
            is not the model's; raised on every rank before anything is written.
    """
    root = wrapped_root(model, "save_checkpoint")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    target = Path(path)
    group, device = root.group, root.device
    rank, world = group_rank(group), group_size(group)
    params = flat_params(root)
    tmp = partial_path(target)
    opt_plan: _OptimizerPlan | None = None

    def prepare() -> int:
        nonlocal opt_plan
        if optimizer is not None:
            opt_plan = _plan_optimizer(model, optimizer)
        if rank == 0:
            begin_folder(target)
        return 0

    def write_rank_files() -> int:
        entries: list[Entry] = []
        tensors: list[Tensor] = []
        for p in params:
            if p.shard.numel() == 0:
                continue
            entries.append((f"model/{p.name}", (p.shard.numel(),), p.shard.dtype))
            tensors.append(p.shard)
            for key, value in (opt_plan.sharded.get(p.name, {}) if opt_plan else {}).items():
                entries.append((f"optim/{key}/{p.name}", (value.numel(),), value.dtype))
                tensors.append(value)
        with SafetensorsWriter(tmp / _rank_file(rank, world), entries, {"format": "pt"}) as w:
            for t in tensors:
                w.write(t)
            size = w.close()
        buffer = io.BytesIO()
        torch.save(extra, buffer)
        write_file(tmp / _extra_file(rank), buffer.getvalue())
        return size

    def finish(sizes: list[int]) -> int:
        if rank == 0:
            metadata = _metadata(model, params, opt_plan, sizes, tmp)
            write_file(tmp / METADATA, json.dumps(metadata, indent=1).encode())
            commit_folder(tmp, target)
            write_latest(target.parent, target.name)
            if keep_last is not None:
                _prune(target.parent, keep_last)
        return 0

    agree(group, device, "save_checkpoint", prepare)
    sizes = agree(group, device, "save_checkpoint", write_rank_files)
    agree(group, device, "save_checkpoint", lambda: finish(sizes))
    return target


def _metadata(
    model: nn.Module,
    params: list[Param],
    opt_plan: _OptimizerPlan | None,
    rank_sizes: list[int],
    tmp: Path,
) -> dict[str, Any]:
    """The checkpoint's metadata; writes the rank-0-only files on the way (rank 0)."""
    world = len(rank_sizes)
    files = {_rank_file(r, world): size for r, size in enumerate(rank_sizes)}
    entries: dict[str, Any] = {}
    for p in params:
        pieces = [
            [_rank_file(r, world), pc.start, pc.stop] for r, pc in p.group.layout.owners(p.index)
        ]
        entries[p.name] = {
            "shape": list(p.shape),
            "dtype": _dtype_name(p.group.dtype),
            "pieces": pieces,
        }
    buffers = persistent_buffers(model, params)
    with SafetensorsWriter(
        tmp / BUFFERS, [(k, tuple(v.shape), v.dtype) for k, v in buffers.items()], {"format": "pt"}
    ) as w:
        for v in buffers.values():
            w.write(v)
        files[BUFFERS] = w.close()
    optimizer = None
    if opt_plan is not None:
        saved = {"class": opt_plan.cls, "param_groups": opt_plan.groups, "state": opt_plan.scalars}
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        files[OPTIMIZER] = write_file(tmp / OPTIMIZER, buffer.getvalue())
        optimizer = {"state_keys": {n: sorted(s) for n, s in opt_plan.sharded.items()}}
    return {
        "format": FORMAT,
        "version": VERSION,
        "saved_at_ns": time.time_ns(),
        "world_size": world,
        "files": files,
        "params": entries,
        "buffers": {
            k: {"shape": list(v.shape), "dtype": _dtype_name(v.dtype)} for k, v in buffers.items()
        },
        "optimizer": optimizer,
    }


def _prune(folder: Path, keep_last: int) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints, and leftovers (rank 0)."""
    found = []
    for child in folder.iterdir():
        if child.name.startswith(".") and child.name.endswith((".partial", ".deleting", ".old")):
            shutil.rmtree(child)
            continue
        try:
            meta = json.loads((child / METADATA).read_text())
        except (OSError, ValueError):
            continue
        if meta.get("format") == FORMAT:
            found.append((meta["saved_at_ns"], child))
    found.sort(reverse=True)
    for _, child in found[keep_last:]:
        remove_folder(child)


# load --------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
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
            state and hyperparameters are replaced. ``None`` loads the model alone.

    Returns:
        The ``**extra`` this rank saved; a rank beyond the saving world size gets rank 0's.

    Raises:
        FileNotFoundError: no checkpoint at ``path``, or a missing file.
        ValueError: a truncated or corrupt file; a model whose parameter or buffer names or
            shapes differ (all differences named); an optimizer of another class or with
            other parameter groups, or one given for a checkpoint saved without.
    """
    root = wrapped_root(model, "load_checkpoint")
    params = flat_params(root)
    with ExitStack() as files:
        loader: _Loader | None = None

        def prepare() -> int:
            nonlocal loader
            loader = _Loader(Path(path), model, params, optimizer, group_rank(root.group), files)
            return 0

        agree(root.group, root.device, "load_checkpoint", prepare)
        assert loader is not None
        loader.apply()
        return loader.extra


Read = tuple[str, int, int, int]  # file, saved piece's start, overlap [lo, hi) in the parameter


class _Loader:
    """One rank's view of a checkpoint, validated on construction; :meth:`apply` loads it."""

    def __init__(
        self,
        path: Path,
        model: nn.Module,
        params: list[Param],
        optimizer: torch.optim.Optimizer | None,
        rank: int,
        stack: ExitStack,
    ) -> None:
        self.folder = _resolve(path)
        self.meta = _read_metadata(self.folder)
        self.params = params
        self.buffers = persistent_buffers(model, params)
        self.optimizer = optimizer
        self._stack = stack
        self._handles: dict[str, Any] = {}
        self._keys: dict[str, set[str]] = {}
        self._names = _names_by_id(model)
        self._check_model()
        self.saved_optimizer = self._check_optimizer() if optimizer is not None else None
        self.reads = {p.name: self._plan_reads(p) for p in params}
        if self.buffers:
            self._open(BUFFERS)
            missing = [k for k in self.buffers if k not in self._keys[BUFFERS]]
            if missing:
                raise ValueError(
                    f"load_checkpoint: {self.folder / BUFFERS} lacks buffers {few(missing)}"
                )
        saved_world = self.meta["world_size"]
        self.extra = self._load_pt(_extra_file(rank if rank < saved_world else 0), sized=False)

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

    def _check_optimizer(self) -> dict[str, Any]:
        assert self.optimizer is not None
        if self.meta["optimizer"] is None:
            raise ValueError(
                f"load_checkpoint: {self.folder} was saved without an optimizer; pass "
                "optimizer=None to load the model alone"
            )
        saved = self._load_pt(OPTIMIZER, sized=True)
        cls = type(self.optimizer).__name__
        if saved["class"] != cls:
            raise ValueError(
                f"load_checkpoint: optimizer mismatch: the checkpoint holds {saved['class']} "
                f"state, got {cls}"
            )
        if any(id(p) not in self._names for g in self.optimizer.param_groups for p in g["params"]):
            raise ValueError(
                "load_checkpoint: the optimizer holds a parameter that is not one of the model's"
            )
        current = [[self._names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]
        groups = saved["param_groups"]
        if len(groups) != len(current):
            raise ValueError(
                f"load_checkpoint: optimizer mismatch: the checkpoint has {len(groups)} parameter "
                f"groups, the optimizer {len(current)}"
            )
        for j, (mine, theirs) in enumerate(zip(current, groups)):
            if set(mine) != set(theirs["params"]):
                raise ValueError(
                    f"load_checkpoint: optimizer mismatch in parameter group {j}: only in the "
                    f"checkpoint {few(sorted(set(theirs['params']) - set(mine)))}, only in the "
                    f"optimizer {few(sorted(set(mine) - set(theirs['params'])))}"
                )
        return saved

    def _open(self, file: str) -> Any:
        """A memory-mapped handle on ``file``, checked against its recorded size."""
        if file not in self._handles:
            path = self._sized(file)
            try:
                self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
            except Exception as e:
                raise ValueError(f"load_checkpoint: {path} is corrupt: {e}") from e
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
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:
            raise ValueError(f"load_checkpoint: cannot read {path}: {e}") from e

    def _plan_reads(self, p: Param) -> list[Read]:
        """The saved ranges overlapping this rank's piece of ``p``, their headers checked."""
        piece = p.group.pieces[p.index]
        keys = [f"model/{p.name}"]
        if self.optimizer is not None:
            keys += [
                f"optim/{k}/{p.name}" for k in self.meta["optimizer"]["state_keys"].get(p.name, [])
            ]
        reads = []
        for file, start, stop in self.meta["params"][p.name]["pieces"]:
            lo, hi = max(piece.start, start), min(piece.stop, stop)
            if lo >= hi:
                continue
            handle = self._open(file)
            for key in keys:
                if key not in self._keys[file] or handle.get_slice(key).get_shape() != [
                    stop - start
                ]:
                    raise ValueError(
                        f"load_checkpoint: {self.folder / file} lacks '{key}' of "
                        f"{stop - start} elements"
                    )
            reads.append((file, start, lo, hi))
        return reads

    # loading -------------------------------------------------------------------------

    def _read(self, key: str, p: Param, out: Tensor) -> None:
        """Fill ``out`` (this rank's piece of ``p``) with the saved tensor ``key``."""
        first = p.group.pieces[p.index].start
        for file, start, lo, hi in self.reads[p.name]:
            out[lo - first : hi - first].copy_(
                self._open(file).get_slice(key)[lo - start : hi - start]
            )

    def apply(self) -> None:
        with torch.no_grad():
            for p in self.params:
                self._read(f"model/{p.name}", p, p.shard)
            for k, v in self.buffers.items():
                v.copy_(self._open(BUFFERS).get_tensor(k))
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_state_dict())

    def _optimizer_state_dict(self) -> dict[str, Any]:
        """The optimizer's own ``state_dict`` format, for the current parameters' pieces."""
        assert self.optimizer is not None and self.saved_optimizer is not None
        by_name = {p.name: p for p in self.params}
        keys, scalars = self.meta["optimizer"]["state_keys"], self.saved_optimizer["state"]
        state: dict[int, dict[str, Any]] = {}
        groups = []
        index = 0
        for group, saved in zip(self.optimizer.param_groups, self.saved_optimizer["param_groups"]):
            ids = []
            for param in group["params"]:
                name = self._names[id(param)]
                if name in keys or name in scalars:
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


def _read_metadata(folder: Path) -> dict[str, Any]:
    path = folder / METADATA
    try:
        meta = json.loads(path.read_text())
    except ValueError as e:
        raise ValueError(f"load_checkpoint: {path} is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path} is not a shardwrap checkpoint's metadata")
    if meta.get("version") != VERSION:
        raise ValueError(
            f"load_checkpoint: {path} has format version {meta.get('version')}; this "
            f"shardwrap reads {VERSION}"
        )
    return meta


def few(items: list[str], limit: int = 8, quote: bool = True) -> str:
    """``items`` for an error message, at most ``limit`` of them."""
    shown = ", ".join(f"'{i}'" if quote else i for i in items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
