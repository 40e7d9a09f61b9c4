"""The folder checkpoints are saved into: which of its entries are shardwrap's, and deleting old
ones (``keep_last``)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .files import LATEST, LOGBOOK, few, remove_folder, restore_moved_aside, surviving
from .format import METADATA, metadata_of, own_files

__all__ = ["completed", "prune", "refuse_to_replace", "restore_all_moved_aside", "saves_in"]


def saves_in(folder: Path) -> list[str]:
    """What of shardwrap's own saves ``folder`` holds, each said for an error message: a
    checkpoint, checkpoints (a ``latest`` pointer, checkpoint folders), a Logbook's run."""
    if not folder.is_dir():
        return []
    found = []
    if metadata_of(folder) is not None:
        found.append(f"a shardwrap checkpoint ({METADATA})")
    if (folder / LATEST).is_file():
        found.append(f"a '{LATEST}' pointer to checkpoints")
    inside = sorted(c.name for c in folder.iterdir() if metadata_of(c) is not None)
    if inside:
        found.append(f"checkpoints {few(inside)}")
    if (folder / LOGBOOK).is_file():
        found.append(f"a Logbook's run ({LOGBOOK})")
    return found


def refuse_to_replace(target: Path) -> None:
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
    meta = metadata_of(folder)
    if meta is None and names:
        saves = saves_in(folder)
        held = "; ".join(saves) if saves else few(names)
        hint = f", e.g. {target / 'step-000100'}" if (folder / LATEST).is_file() else ""
        raise ValueError(
            f"save_checkpoint: {target} is not a shardwrap checkpoint: it holds {held}, which "
            f"replacing it would delete. Save to a folder path that does not exist yet{hint}"
        )
    foreign = [n for n in names if meta is not None and n not in own_files(meta)]
    if foreign:
        raise ValueError(
            f"save_checkpoint: {target} is a checkpoint that also holds {few(foreign)}, which "
            "it did not write and replacing it would delete. Move them out of it, or save to "
            "another path"
        )


def completed(folder: Path) -> list[tuple[int, int, Path]]:
    """The complete checkpoints in ``folder``: (save sequence, save time, path), oldest first.

    Order is the sequence each save took as it completed; the clock only orders checkpoints
    written before saves were numbered, all of which come first.
    """
    found = []
    for child in folder.iterdir() if folder.is_dir() else ():
        if child.name.startswith("."):
            continue
        meta = metadata_of(child)
        if meta is not None:
            sequence, saved = meta.get("sequence", 0), meta.get("saved_at_ns", 0)
            if isinstance(sequence, int) and isinstance(saved, int):
                found.append((sequence, saved, child))
    return sorted(found)


def restore_all_moved_aside(folder: Path) -> None:
    """Put back every checkpoint of ``folder`` that a killed replacing save left moved aside."""
    for child in folder.iterdir():
        if child.name.startswith(".") and child.name.endswith(".old"):
            restore_moved_aside(folder / child.name[1 : -len(".old")])


def prune(folder: Path, keep_last: int, newest: Path) -> None:
    """Delete all but the last ``keep_last`` completed checkpoints, and leftovers (rank 0).

    ``newest``, the save just completed and what ``latest`` names, is never deleted.
    """
    for child in folder.iterdir():
        if child.name.startswith(".") and child.name.endswith((".partial", ".deleting", ".old")):
            shutil.rmtree(child)
    done = [path for _, _, path in completed(folder) if path != newest]
    for path in done[: max(0, len(done) - (keep_last - 1))]:
        remove_folder(path)
