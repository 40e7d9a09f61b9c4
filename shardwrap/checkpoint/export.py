"""Consolidated export to safetensors, streamed one flat group at a time, and loading it back.

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

:func:`load_pretrained` reads such a folder (or a downloaded Hugging Face one) into a sharded
model: each rank reads only the rows that cover its pieces, memory-mapped.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from collections.abc import Mapping
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..engine.shards.param_index import Param
from ..engine.shards.split import Split
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
    is_plain_name,
    partial_path,
    remove_folder,
    safetensors_nbytes,
    surviving,
    tensor_nbytes,
    write_file,
)
from .folder import refuse_a_file_above, refuse_foreign_scratch, saves_in
from .format import persistent_buffers

__all__ = ["export", "load_pretrained", "write_export"]

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


def _hf_dropped(model: nn.Module, state: dict[str, Tensor]) -> set[str]:
    """The tied keys ``save_pretrained`` leaves out, for a ``transformers`` model (else none)."""
    transformers = sys.modules.get("transformers")  # a model of it means it is imported
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return set()
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    # Stand-ins that alias exactly where the real entries are the same tensor: the shards
    # of one flat group share storage, which the function would take for ties.
    stand_ins: dict[int, Tensor] = {}
    fake = {k: stand_ins.setdefault(id(v), torch.empty(1)) for k, v in state.items()}
    return set(state) - set(remove_tied_weights_from_state_dict(dict(fake), model))


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]] | None:
    """A ``transformers`` model's checkpoint renamings and its converters (which merge saved
    tensors into one, a mixture of experts' per-expert weights), as ``from_pretrained``
    applies them since transformers 5; ``None`` for any other model."""
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without checkpoint conversions
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return renamings, [t for t in transforms if isinstance(t, WeightConverter)]


def _model_names(model: nn.Module, keys: list[str], own: Mapping[str, Any]) -> dict[str, str]:
    """Each saved key's name in the model: itself, or for a ``transformers`` model the name
    its checkpoint renamings give it (some models are saved under their original checkpoint
    names, which ``from_pretrained`` renames as it loads). A key that transformers would merge
    with others keeps its own name: see :func:`_converted_names`."""
    names = {k: k for k in keys}
    conversions = _conversions(model)
    if conversions is None:
        return names
    from transformers.core_model_loading import rename_source_key

    present = dict.fromkeys(own, True)
    prefix = getattr(model, "base_model_prefix", None) or None
    for k in keys:
        if k not in own:
            renamed, merged = rename_source_key(k, *conversions, prefix, present)
            if merged is None:
                names[k] = renamed
    return names


def _converted_names(model: nn.Module) -> str:
    """Why a ``transformers`` model's own folder may still not match it: keys that
    ``from_pretrained`` merges as it loads, which ``load_pretrained`` does not. Empty for any
    other model."""
    conversions = _conversions(model)
    if conversions is None or not conversions[1]:
        return ""
    name = type(model).__name__
    return (
        f". transformers saves a {name} with weights that from_pretrained merges as it loads "
        "(a mixture of experts' per-expert weights into one tensor); load_pretrained reads "
        f"whole tensors only. Load it with {name}.from_pretrained(path) before wrapping (then "
        "ShardedModule(model, ...)); or once so, then shardwrap.export(path, model) from the "
        "wrapped model: export writes the model's own tensors, which load_pretrained reads"
    )


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


# loading -----------------------------------------------------------------------------


def _open(stack: ExitStack, path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"load_pretrained: {path} is missing")
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except Exception as e:
        raise ValueError(f"load_pretrained: {path} is corrupt: {e}") from e


def _weight_files(folder: Path, stack: ExitStack) -> tuple[dict[str, str], dict[str, Any]]:
    """Tensor name -> file name, from the index or the single weights file; file -> handle."""
    if (folder / INDEX).is_file():
        where = _weight_map(folder / INDEX)
        outside = sorted({str(f) for f in where.values() if not is_plain_name(f)})
        if outside:
            raise ValueError(
                f"load_pretrained: {folder / INDEX} names files outside {folder}: {outside}; "
                "an index names weight files beside it"
            )
        return where, {f: _open(stack, folder / f) for f in sorted(set(where.values()))}
    if not (folder / WEIGHTS).is_file():
        raise FileNotFoundError(f"load_pretrained: {folder} holds neither {INDEX} nor {WEIGHTS}")
    handle = _open(stack, folder / WEIGHTS)
    return {k: WEIGHTS for k in handle.keys()}, {WEIGHTS: handle}


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``: tensor name to the file beside it that holds it.

    Raises:
        ValueError: naming the index and what is wrong: not JSON (or nested too deep), no
            ``weight_map``, or one that is not a mapping of names to file names.
    """
    try:
        parsed = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(
            f"load_pretrained: {index} is corrupt: {e!r}. Export the model again, or delete "
            "the index where the folder holds one model.safetensors"
        ) from None
    where = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(where, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in where.items()
    ):
        raise ValueError(
            f'load_pretrained: {index} is corrupt: its "weight_map" must map each tensor\'s '
            f"name to the file that holds it, got {type(where).__name__}. Export the model "
            "again, or fix the index"
        )
    return where


def _rows(
    handle: Any, key: str, shape: tuple[int, ...], start: int, stop: int, block: Any = None
) -> Tensor:
    """Elements ``[start, stop)`` of the flattened tensor ``key``, reading whole rows only; of
    its block ``block = (split, index)`` (a tensor-parallel rank's, ``engine/shards/split.py``)
    where given."""
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:stop]
    split, index = block if block is not None else (Split(shape), 0)
    rows = split.block_shape
    row = math.prod(rows[1:])
    first, last = start // row, -(-stop // row)
    at = [slice(None)] * len(shape)
    if split.is_split and split.dim == 0:
        at[0] = slice(index * rows[0] + first, index * rows[0] + last)
    else:
        at[0] = slice(first, last)
        if split.is_split:
            assert split.dim is not None
            n = rows[split.dim]
            at[split.dim] = slice(index * n, (index + 1) * n)
    stored = handle.get_slice(key)[tuple(at)]
    return stored.reshape(-1)[start - first * row : stop - first * row]


def load_pretrained(path: str | Path, model: nn.Module, *, strict: bool = True) -> None:
    """Load a folder written by :func:`export` (or ``save_pretrained``) into a sharded model.

    Each rank reads only the rows of each tensor that cover its own pieces, memory-mapped,
    so no rank holds the whole model. A tied parameter loads from any of its names.
    Everything is checked on every rank before anything is modified. Call on every rank.

    Args:
        path: the folder, with ``model.safetensors`` or ``model.safetensors.index.json``.
        model: a model wrapped with :class:`ShardedModule`, at any world size and policy.
        strict: raise on names missing from the files or unknown to the model; with
            ``False`` such parameters keep their values and unknown names are ignored.

    Raises:
        FileNotFoundError: no weights in ``path``, or a file named by the index is missing.
        ValueError: names (with ``strict``) or shapes that differ, or a corrupt file.
    """
    model, root = wrapped_root(model, "load_pretrained")
    folder = agree_path(root.mesh.control, root.mesh.control_device, "load_pretrained", path)
    params = root.params
    buffers = persistent_buffers(model, params)
    state = nn.Module.state_dict(model, keep_vars=True)
    with ExitStack() as stack:
        plan: dict[str, tuple[Any, str]] = {}  # canonical name or buffer key -> (handle, key)

        def prepare() -> int:
            saved_at, handles = _weight_files(folder, stack)
            name_of = _model_names(model, list(saved_at), state)
            where = {name_of[k]: f for k, f in saved_at.items()}
            saved_key = {name_of[k]: k for k in saved_at}
            keys_of: dict[int, list[str]] = {}
            for k, v in state.items():
                keys_of.setdefault(id(v), []).append(k)
            wanted = [(p.name, p.shape, keys_of[id(p.shard)]) for p in params]
            wanted += [(k, tuple(v.shape), [k]) for k, v in buffers.items()]
            missing, shapes = [], []
            for name, shape, keys in wanted:
                found = next((k for k in keys if k in where), None)
                if found is None:
                    missing.append(name)
                    continue
                handle, key = handles[where[found]], saved_key[found]
                if key not in handle.keys():
                    raise ValueError(
                        f"load_pretrained: {folder / INDEX} says {folder / where[found]} holds "
                        f"'{key}', which that file lacks: the index and the weights are of "
                        "different exports. Export the model again"
                    )
                saved = tuple(handle.get_slice(key).get_shape())
                if saved != shape:
                    shapes.append(f"'{key}': file {saved}, model {shape}")
                plan[name] = (handle, key)
            unexpected = [saved_key[k] for k in where if k not in state]
            problems = [f"shape mismatch: {few(shapes, quote=False)}"] if shapes else []
            if strict and missing:
                problems.append(f"missing from the files: {few(missing)}")
            if strict and unexpected:
                problems.append(f"not in the model: {few(unexpected)}")
            if problems:
                raise ValueError(
                    f"load_pretrained: {folder} does not match the model; "
                    + "; ".join(problems)
                    + (_converted_names(model) if missing or unexpected else "")
                )
            return 0

        agree(root.mesh.control, root.mesh.control_device, "load_pretrained", prepare)
        with torch.no_grad():
            for p in params:
                piece = p.group.pieces[p.index]
                if p.name in plan and piece.numel > 0:
                    handle, key = plan[p.name]
                    spec = p.group.specs[p.index]
                    block = (spec.split, spec.index) if spec is not None else None
                    p.shard.copy_(_rows(handle, key, p.shape, piece.start, piece.stop, block))
            for k, v in buffers.items():
                if k in plan:
                    v.copy_(plan[k][0].get_tensor(plan[k][1]))
