"""A checkpoint on disk: the names of its files, its metadata, and the ``latest`` pointer beside
it. ``save.py`` writes this format and ``load.py`` reads it; both import it from here.

A checkpoint folder (:mod:`shardwrap.checkpoint.save` says how each rank's part is cut)::

    metadata.json                     names, full shapes, dtypes, which file holds which range
    rank-00000-of-00002.safetensors   rank 0's pieces, 1-D: model/NAME and optim/KEY/NAME
    rank-00001-of-00002.safetensors
    buffers.safetensors               buffers (BatchNorm statistics), from rank 0
    optimizer.pt                      optimizer class, param_groups by name, scalar state
                                      (of each optimizer, for a list of them)
    extra-00000.pt, extra-00001.pt    each rank's ``**extra``
    residuals-00000.safetensors, ...  each rank's error-feedback residuals (compression only)

Everything read here comes from disk and is trusted for nothing: a metadata file that is not
a regular file, not JSON, nested past reason or of the wrong shape is refused naming the file,
and a ``latest`` pointer that is a symbolic link is never followed (its target's content would
end up in an error message).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.shards.param_index import Param
from .files import LATEST, is_plain_name, surviving

__all__ = [
    "BUFFERS",
    "FORMAT",
    "METADATA",
    "OPTIMIZER",
    "UNSPLIT_VERSION",
    "VERSION",
    "checksum_file",
    "dtype_name",
    "extra_file",
    "latest_checkpoint",
    "metadata_of",
    "owned_file",
    "own_files",
    "persistent_buffers",
    "rank_file",
    "read_metadata",
    "resolve_folder",
    "residuals_file",
]

FORMAT = "shardwrap.checkpoint"
# 2: content checksums of every stored tensor and file; 3: whole-stepped state; 4: tensor-
# parallel blocks (a parameter's "split"), written only where a parameter is split: a reader of
# 3 would take its stacked ranges for the parameter's own, and any other checkpoint stays 3.
# Residuals of error feedback (an optional "residuals" entry and files) need no new version: a
# reader that does not know them loads the rest, and its residuals start at zero as before
# they were saved.
VERSION = 4
UNSPLIT_VERSION = 3
METADATA = "metadata.json"
BUFFERS = "buffers.safetensors"
OPTIMIZER = "optimizer.pt"
_POINTER_BYTES = 4096  # a latest pointer holds one folder name; anything longer is not one
_SHOWN = 80  # characters of a malformed pointer quoted in its error


def rank_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


def extra_file(rank: int) -> str:
    return f"extra-{rank:05d}.pt"


def owned_file(rank: int) -> str:
    """Where a writing owner leaves its whole-stepped state's shapes and scalars for rank 0."""
    return f".optimizer-{rank:05d}.pt"


def residuals_file(rank: int) -> str:
    """Rank ``rank``'s error-feedback residuals (every rank's own: they differ per rank)."""
    return f"residuals-{rank:05d}.safetensors"


def checksum_file(name: str) -> str:
    """Where the writer of ``name`` leaves its tensors' checksums for rank 0 (merged into the
    metadata, then removed)."""
    return f".checksums-{name}.json"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def persistent_buffers(model: nn.Module, params: list[Param]) -> dict[str, Tensor]:
    """The persistent buffers of the state dict (everything that is not a parameter)."""
    shard_ids = {id(p.shard) for p in params}
    return {
        k: v
        for k, v in nn.Module.state_dict(model, keep_vars=True).items()
        if isinstance(v, Tensor) and id(v) not in shard_ids
    }


# what a folder holds -----------------------------------------------------------------------


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file itself: not a link, a folder, a FIFO or a device
    (reading a FIFO would block, and a link leads elsewhere)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return False


def _parse(path: Path) -> Any:
    """``path``'s JSON. Raises ``ValueError`` for text that is not JSON or nests too deep."""
    try:
        return json.loads(path.read_text())
    except RecursionError:
        raise ValueError("it nests deeper than JSON metadata can") from None


def metadata_of(folder: Path) -> dict[str, Any] | None:
    """The metadata of the checkpoint ``folder`` is, or ``None`` if it is none: a folder
    itself (not a link to one) holding shardwrap's ``metadata.json`` as a regular file."""
    if folder.is_symlink() or not _regular(folder / METADATA):
        return None
    try:
        meta = _parse(folder / METADATA)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == FORMAT else None


def own_files(meta: dict[str, Any]) -> set[str]:
    """The names in a checkpoint's folder that the checkpoint wrote, by its metadata."""
    files, ranks = meta.get("files"), meta.get("ranks", meta.get("world_size"))
    names = {METADATA, *(files if isinstance(files, dict) else ())}
    return names | {extra_file(r) for r in range(ranks if isinstance(ranks, int) else 0)}


def latest_checkpoint(folder: str | Path) -> Path | None:
    """The checkpoint that ``folder/latest`` points to, or ``None`` if there is none yet.

    Raises:
        ValueError: ``latest`` is not a pointer shardwrap wrote: a symbolic link (never
            followed), not a regular file, or not the name of a folder beside it.
    """
    pointer = Path(folder) / LATEST
    if not os.path.lexists(pointer):
        return None
    if pointer.is_symlink() or not _regular(pointer):
        kind = "a symbolic link" if pointer.is_symlink() else "not a regular file"
        raise ValueError(
            f"{pointer} is {kind}; shardwrap writes 'latest' as a small file naming a checkpoint "
            "folder beside it, and does not follow anything else. Delete it (what it leads to is "
            "not touched); the next save writes it again"
        )
    with open(pointer, "rb") as f:
        raw = f.read(_POINTER_BYTES + 1)
    name = raw.decode("utf-8", "replace").strip()
    if len(raw) > _POINTER_BYTES or not is_plain_name(name):
        shown = name[:_SHOWN] + ("..." if len(name) > _SHOWN else "")
        raise ValueError(
            f"{pointer} holds {shown!r}, not a checkpoint inside {folder}: a latest "
            "pointer holds the name of a folder beside it. Rewrite it or delete it."
        )
    return Path(folder) / name


def resolve_folder(path: Path) -> Path:
    """The checkpoint ``path`` names: a checkpoint folder, or a folder whose ``latest`` names
    one (a copy moved aside by a replacing save that was killed counts as the folder)."""
    path = surviving(path)
    if _regular(path / METADATA):
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise FileNotFoundError(
            f"load_checkpoint: no checkpoint at {path}: it holds neither {METADATA} nor a "
            f"'{LATEST}' pointer (no save to it has completed yet)"
        )
    latest = surviving(latest)
    if not _regular(latest / METADATA):
        raise FileNotFoundError(
            f"load_checkpoint: {path / LATEST} points to {latest}, which has no {METADATA}"
        )
    return latest


# reading the metadata ----------------------------------------------------------------------


def read_metadata(folder: Path) -> dict[str, Any]:
    """The checkpoint's metadata, its structure checked.

    Raises:
        ValueError: naming the file and what is wrong: not JSON, nested too deep, not
            shardwrap's, another format version, or an entry missing or of the wrong shape.
    """
    path = folder / METADATA
    try:
        meta = _parse(path)
    except ValueError as e:
        raise ValueError(f"load_checkpoint: {path} is corrupt: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"load_checkpoint: {path} is not a shardwrap checkpoint's metadata")
    if meta.get("version") not in range(2, VERSION + 1):
        raise ValueError(
            f"load_checkpoint: {path} has format version {meta.get('version')}; this "
            f"shardwrap reads 2 to {VERSION}"
        )
    problem = _metadata_problem(meta)
    if problem is not None:
        raise ValueError(f"load_checkpoint: {path} is malformed: {problem}")
    return meta


def _bad_int(v: object, least: int = 0) -> bool:
    return not isinstance(v, int) or isinstance(v, bool) or v < least


def _bad_file(v: object) -> bool:
    return not is_plain_name(v)


def _bad_shape(v: object) -> bool:
    return not isinstance(v, list) or any(_bad_int(d) for d in v)


def _metadata_problem(meta: dict[str, Any]) -> str | None:
    """What is wrong with the structure of a checkpoint's metadata, or ``None``.

    Every file it names must be a plain name inside the checkpoint's folder.
    """
    for key in ("world_size", "files", "params", "buffers", "optimizer", "checksums"):
        if key not in meta:
            return f'it lacks the "{key}" entry'
    if _bad_int(meta["world_size"], 1) or _bad_int(meta.get("ranks", 1), 1):
        return '"world_size" and "ranks" must be positive integers'
    files = meta["files"]
    if not isinstance(files, dict) or any(_bad_file(f) or _bad_int(n) for f, n in files.items()):
        return '"files" must map plain file names inside the folder to sizes in bytes'
    return (
        _params_problem(meta["params"])
        or _buffers_problem(meta["buffers"])
        or _optimizer_problem(meta["optimizer"])
        or _checksums_problem(meta["checksums"])
        or _residuals_problem(meta.get("residuals"))
    )


def _params_problem(params: object) -> str | None:
    if not isinstance(params, dict):
        return '"params" must map parameter names to their entries'
    for name, entry in params.items():
        if not isinstance(entry, dict) or _bad_shape(entry.get("shape")):
            return f'parameter "{name}" needs a "shape" (a list of sizes)'
        if not isinstance(entry.get("dtype"), str):
            return f'parameter "{name}" needs a "dtype" name'
        split = entry.get("split")
        if split is not None and not _good_split(split, entry["shape"]):
            return (
                f'parameter "{name}": "split" must be [dim, parts], a dimension of its shape '
                "that the parts divide"
            )
        pieces = entry.get("pieces")
        if not isinstance(pieces, list) or any(
            not isinstance(pc, list)
            or len(pc) != 3
            or _bad_file(pc[0])
            or _bad_int(pc[1])
            or _bad_int(pc[2], pc[1] if isinstance(pc[1], int) else 0)
            for pc in pieces
        ):
            return (
                f'parameter "{name}": "pieces" must be a list of [file, start, stop], the file '
                "a plain name inside the folder"
            )
    return None


def _good_split(split: object, shape: list[int]) -> bool:
    return (
        isinstance(split, list)
        and len(split) == 2
        and not _bad_int(split[0])
        and not _bad_int(split[1], 1)
        and split[0] < len(shape)
        and shape[split[0]] % split[1] == 0
    )


def _buffers_problem(buffers: object) -> str | None:
    if not isinstance(buffers, dict) or any(
        not isinstance(b, dict) or _bad_shape(b.get("shape")) or not isinstance(b.get("dtype"), str)
        for b in buffers.values()
    ):
        return '"buffers" must map buffer names to their "shape" and "dtype"'
    return None


def _optimizer_problem(optimizer: object) -> str | None:
    if optimizer is not None and (
        not isinstance(optimizer, dict)
        or not isinstance(optimizer.get("state_keys"), dict)
        or any(
            not isinstance(keys, list) or not all(isinstance(k, str) for k in keys)
            for keys in optimizer["state_keys"].values()
        )
    ):
        return '"optimizer" must be null or hold "state_keys": parameter name to key names'
    stepped = (optimizer or {}).get("stepped_whole", False)
    whole = (optimizer or {}).get("whole_state", {})
    if (
        not all(isinstance(b, bool) for b in (stepped if isinstance(stepped, list) else [stepped]))
        or not isinstance(whole, dict)
        or any(
            not isinstance(by_key, dict)
            or any(
                not isinstance(at, dict) or _bad_file(at.get("file")) or _bad_shape(at.get("shape"))
                for at in by_key.values()
            )
            for by_key in whole.values()
        )
    ):
        return (
            '"optimizer": "stepped_whole" must be true or false (a list of them for a list of '
            'optimizers), and "whole_state" map parameter names to key names to the "file" (a '
            'plain name inside the folder) and "shape"'
        )
    return None


def _checksums_problem(sums: object) -> str | None:
    if (
        not isinstance(sums, dict)
        or not isinstance(sums.get("tensors"), dict)
        or not isinstance(sums.get("files"), dict)
        or any(
            not isinstance(by_key, dict)
            or any(
                not isinstance(v, list) or len(v) != 2 or not all(isinstance(x, str) for x in v)
                for v in by_key.values()
            )
            for by_key in sums["tensors"].values()
        )
        or any(not isinstance(v, str) for v in sums["files"].values())
    ):
        return (
            '"checksums" must hold "tensors" (file to key to [dtype, checksum]) and "files" '
            "(file to checksum)"
        )
    return None


def _residuals_problem(residuals: object) -> str | None:
    if residuals is None:
        return None
    if (
        not isinstance(residuals, dict)
        or _bad_int(residuals.get("shard"), 1)
        or _bad_int(residuals.get("replicate"), 1)
        or not isinstance(residuals.get("groups"), list)
        or any(
            not isinstance(g, list) or not all(isinstance(n, str) for n in g)
            for g in residuals["groups"]
        )
    ):
        return (
            '"residuals" must be null or hold the "shard" and "replicate" sizes it was saved at '
            'and "groups": each reduced group\'s parameter names, in order'
        )
    return None
