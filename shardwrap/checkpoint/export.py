"""Consolidated export to safetensors, streamed one flat group at a time.

Design note. :func:`export` declares every tensor's name, shape and dtype up front (they
are known without gathering), splits them into files by size as Hugging Face does, then
gathers one flat group at a time and rank 0 streams its parameters into the open file: peak
memory stays near one unit, never the whole model. A ``transformers`` model gets its
``config.json`` and loses tied duplicates exactly as ``save_pretrained`` drops them, so
``from_pretrained(folder)`` loads it. Other models keep every ``state_dict`` key, tied
duplicates written twice, so a plain ``load_state_dict`` is strict-clean.

The folder is the user's as much as the model's: ``tokenizer.save_pretrained(out)`` then
``model.save_pretrained(out)`` is the habit. So the files are written into a temporary folder
beside it and moved in one by one; nothing is deleted but the stale weight files of a previous
export, and a folder holding shardwrap's other saves (checkpoints, a Logbook's run) is refused.

``shardwrap.checkpoint.pretrained`` reads such a folder back.
"""

from __future__ import annotations

import json
import os
import re
import sys
from contextlib import suppress
from pathlib import Path

import torch
from torch import Tensor, nn

from ..engine.shards.param_index import Param
from .entry import wrapped_root
from .files import (
    Entry,
    SafetensorsWriter,
    agree,
    agree_path,
    begin_folder,
    commit_folder,
    few,
    fsync_path,
    full_disk_error,
    partial_path,
    remove_folder,
    safetensors_nbytes,
    surviving,
    tensor_nbytes,
    write_file,
)
from .folder import refuse_a_file_above, refuse_foreign_scratch, saves_in
from .format import persistent_buffers

__all__ = ["CONFIGS", "INDEX", "WEIGHTS", "export", "is_transformers_model", "write_export"]

WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
CONFIGS = ("config.json", "generation_config.json")
SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")  # a file of a sharded export


def _parse_size(size: int | str) -> int:
    """Bytes from an int or a string such as ``"5GB"`` or ``"500MiB"`` (Hugging Face's units),
    at least 1 (``True`` is not a size)."""
    if isinstance(size, int) and not isinstance(size, bool):
        if size < 1:
            raise ValueError(f"max_shard_size must be at least 1 byte, got {size}; e.g. '5GB'")
        return size
    if not isinstance(size, str):
        raise ValueError(
            f"max_shard_size: cannot read {size!r}; write e.g. '5GB', '500MiB' or an int"
        )
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT])(i?)B\s*", size, flags=re.IGNORECASE)
    if match is None:
        raise ValueError(
            f"max_shard_size: cannot read {size!r}; write e.g. '5GB', '500MiB' or an int"
        )
    base = 1024 if match.group(3) else 1000
    size = int(float(match.group(1)) * base ** "KMGT".index(match.group(2).upper()) * base)
    if size < 1:
        raise ValueError(f"max_shard_size must be at least 1 byte, got {size!r}; e.g. '5GB'")
    return size


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (a model of it means it is imported)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def _hf_dropped(model: nn.Module, state: dict[str, Tensor]) -> set[str]:
    """The tied keys ``save_pretrained`` leaves out, for a ``transformers`` model (else none)."""
    if not is_transformers_model(model):
        return set()
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # Stand-ins that alias exactly where the real entries are the same tensor: the shards
    # of one flat group share storage, which the function would take for ties.
    stand_ins: dict[int, Tensor] = {}
    fake = {k: stand_ins.setdefault(id(v), torch.empty(1)) for k, v in state.items()}
    return set(state) - set(remove_tied_weights_from_state_dict(dict(fake), model))


def _split(entries: list[Entry], limit: int) -> list[list[Entry]]:
    """Consecutive entries per file, a new file whenever the next one would pass ``limit``."""
    files: list[list[Entry]] = [[]]
    size = 0
    for entry in entries:
        n = tensor_nbytes(entry[1], entry[2])
        if files[-1] and size + n > limit:
            files.append([])
            size = 0
        files[-1].append(entry)
        size += n
    return files


def _file_name(i: int, n: int) -> str:
    return WEIGHTS if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class _Stream:
    """Rank 0's writers, one file after another; a write error is kept, not raised, so that
    rank 0 goes on taking part in the gathers its peers issue."""

    def __init__(self, folder: Path, files: list[list[Entry]]) -> None:
        self._folder, self._files = folder, files
        self._file = -1
        self._left = 0
        self._writer: SafetensorsWriter | None = None
        self.error: Exception | None = None

    def put(self, tensor: Tensor) -> None:
        if self.error is not None:
            return
        try:
            while self._left == 0:
                self._next_file()
            assert self._writer is not None
            self._writer.write(tensor)
            self._left -= 1
        except Exception as e:  # re-raised by finish(), after the gathers
            self._fail(e)

    def _fail(self, error: Exception) -> None:
        """Keep ``error`` and close the open file: deleted while open, it would hold its space."""
        self.error = error
        if self._writer is not None:
            with suppress(Exception):  # a full disk may fail its last flush too
                self._writer.abandon()

    def _next_file(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._file += 1
        entries = self._files[self._file]
        name = _file_name(self._file, len(self._files))
        self._writer = SafetensorsWriter(self._folder / name, entries, {"format": "pt"})
        self._left = len(entries)

    def finish(self) -> None:
        """Close the last file (creating any still unopened, if empty); raise a kept error."""
        if self.error is None:
            try:
                while self._file < len(self._files) - 1:
                    self._next_file()
                assert self._writer is not None
                self._writer.close()
            except Exception as e:
                self._fail(e)
        if self.error is not None:
            raise self.error


def export(path: str | Path, model: nn.Module, *, max_shard_size: int | str = "5GB") -> Path:
    """Write the whole model as consolidated safetensors, one unit in memory at a time.

    Writes into the folder ``path`` ``model.safetensors``, or, above ``max_shard_size``,
    ``model-00001-of-0000N.safetensors`` files and ``model.safetensors.index.json``, named
    as Hugging Face names them. For a ``transformers`` model it also writes ``config.json``
    (and ``generation_config.json``), so ``AutoModel.from_pretrained(path)`` loads it; any
    model loads it with ``load_state_dict(safetensors.torch.load_file(...))`` or
    :func:`load_pretrained`. Rank 0 writes; every rank must call it (each unit is gathered
    in turn).

    Every file is written and fsynced under a temporary name first, so none is ever seen half
    written; then:

    1. a new ``path`` appears whole, in one rename;
    2. into a folder that exists, the files are moved in one by one and replace those of the
       same names, and everything else there (a tokenizer saved beside the model, a user's
       notes) stays. Of a previous export, only the weight files this one did not write go:
       ``model-NNNNN-of-NNNNN.safetensors`` files, and ``model.safetensors`` or the index of
       the other layout. While the files are moved in (renames, no data written) the folder
       holds no weights entry, so nothing loads two exports mixed.

    Args:
        path: the folder to write: new, or one of the model's own and its user's files.
        model: a model wrapped with :class:`ShardedModule`.
        max_shard_size: the most bytes per file, an int or a string such as ``"5GB"``.

    Returns:
        ``path``, as a ``Path``.

    Raises:
        ValueError: ``path`` is a file, or holds a shardwrap checkpoint, checkpoints or a
            Logbook's run; on every rank, before anything is written.
        OSError: a full disk or quota (``errno`` ``ENOSPC`` or ``EDQUOT``), on every rank,
            naming the export, the bytes it needs and those free, once its temporary files
            are deleted; ``path`` is as it was.
    """
    return write_export(path, model, max_shard_size, "export")


def write_export(
    path: str | Path, model: nn.Module, max_shard_size: int | str, caller: str
) -> Path:
    """:func:`export`, its errors naming ``caller`` (``save_pretrained`` calls it too)."""
    model, root = wrapped_root(model, "export")
    limit = _parse_size(max_shard_size)
    target = agree_path(root.mesh.control, root.mesh.control_device, caller, path)
    tmp = partial_path(target)
    rank = root.mesh.rank
    params = root.params
    state = nn.Module.state_dict(model, keep_vars=True)
    bad = [k for k, v in state.items() if not isinstance(v, Tensor)]
    if bad:
        raise ValueError(f"{caller}: the state dict holds non-tensor entries {few(bad)}")
    dropped = _hf_dropped(model, state)
    keys_of: dict[int, list[str]] = {}
    for k, v in state.items():
        if k not in dropped:
            keys_of.setdefault(id(v), []).append(k)
    entries = [(k, p.shape, p.group.dtype) for p in params for k in keys_of.get(id(p.shard), [])]
    buffers = persistent_buffers(model, params)
    entries += [(k, tuple(v.shape), v.dtype) for k, v in buffers.items() if k not in dropped]
    files = _split(entries, limit)
    names = [_file_name(i, len(files)) for i in range(len(files))]
    needed = sum(safetensors_nbytes(f, {"format": "pt"}) for f in files)
    by_group: dict[int, list[Param]] = {}
    for p in params:
        by_group.setdefault(id(p.group), []).append(p)

    def prepare() -> int:
        _refuse(target, caller, [*names, INDEX, WEIGHTS, *CONFIGS])
        if rank == 0:
            begin_folder(target)
        return 0

    def write() -> int:
        stream = _Stream(tmp, files) if rank == 0 else None
        for unit in root.units:
            for g in unit.groups:
                with unit.readable(g) as views:
                    if stream is None:
                        continue
                    for p in by_group[id(g)]:
                        for _ in keys_of.get(id(p.shard), []):
                            stream.put(views[p.index])
        if stream is not None:
            for k, v in buffers.items():
                if k not in dropped:
                    stream.put(v)
            stream.finish()
        return 0

    def finish() -> int:
        if rank == 0:
            if len(files) > 1:
                weight_map = {k: names[i] for i, f in enumerate(files) for k, _, _ in f}
                total = sum(tensor_nbytes(shape, dtype) for _, shape, dtype in entries)
                index = {"metadata": {"total_size": total}, "weight_map": weight_map}
                write_file(
                    tmp / INDEX, (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
                )
            config = getattr(model, "config", None)
            if config is not None and hasattr(config, "save_pretrained"):
                config.save_pretrained(tmp)
                generation = getattr(model, "generation_config", None)
                if generation is not None:
                    generation.save_pretrained(tmp)
                for written in tmp.glob("*.json"):
                    fsync_path(written)
            if os.path.lexists(target):
                _move_in(tmp, target)
            else:
                commit_folder(tmp, target)
        return 0

    def undo() -> None:
        if rank == 0:
            remove_folder(tmp)

    control, device = root.mesh.control, root.mesh.control_device
    try:
        agree(control, device, caller, prepare, undo)
        agree(control, device, caller, write, undo)
        agree(control, device, caller, finish, undo)
    except Exception as e:
        full = full_disk_error(
            e,
            caller,
            target,
            needed,
            f"{target} is as it was. Free space there, or export to another disk.",
        )
        if full is None:
            raise
        raise full from e
    return target


def _refuse(target: Path, caller: str, names: list[str]) -> None:
    """Raise unless an export may write into ``target``: new, or a folder holding none of
    shardwrap's other saves and no folder where the export writes a file."""
    refuse_a_file_above(target, caller)
    refuse_foreign_scratch(target, caller)
    folder = surviving(target)
    if os.path.lexists(folder) and not folder.is_dir():
        raise ValueError(f"{caller}: {target} is a file; give a folder to write the model into")
    saves = saves_in(folder)
    if saves:
        raise ValueError(
            f"{caller}: {target} holds {'; '.join(saves)}, which an export must not mix "
            "with. Export into another folder: a new one, or one without checkpoints or a "
            "Logbook's run"
        )
    blocking = [n for n in names if (folder / n).is_dir()]
    if blocking:
        raise ValueError(
            f"{caller}: {target} holds folders named {few(blocking)}, where the export writes "
            "files. Move them, or export into another folder"
        )


def _move_in(tmp: Path, target: Path) -> None:
    """Move an export's files from ``tmp`` into the folder ``target`` (rank 0), as
    :func:`export` says: old weights entries first, the new one last, stale shards after."""
    written = sorted(c.name for c in tmp.iterdir())
    entry = INDEX if INDEX in written else WEIGHTS
    for name in (INDEX, WEIGHTS):
        (target / name).unlink(missing_ok=True)
    fsync_path(target)
    for name in sorted(written, key=lambda n: n == entry):
        os.replace(tmp / name, target / name)
    fsync_path(target)
    for child in target.iterdir():
        if SHARD.fullmatch(child.name) and child.name not in written and not child.is_dir():
            child.unlink()
    fsync_path(target)
    remove_folder(tmp)
