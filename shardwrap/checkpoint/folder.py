"""The folder checkpoints are saved into: which of its entries are shardwrap's, and deleting old
ones (``keep_last``) without touching anything else.

Design note. The folder is shared with whoever else writes there: a person copying a
checkpoint aside, a symbolic link to the best one, a notes file, a run's logbook. shardwrap
counts as its own only what it can tell it wrote: a folder itself (never a link) holding
shardwrap's ``metadata.json`` as a regular file and nothing but the files that metadata
names, under the name it was saved as (a copy or a renamed checkpoint is the user's); its
hidden leftovers (``.NAME.partial``, ``.NAME.deleting``, ``.NAME.old``) only where they are
folders themselves holding nothing but files named as a save names its own. Everything else
is left alone. Pruning runs after the new
checkpoint is committed, so nothing found there may fail the save: an old checkpoint that
cannot be deleted, or holds a file it did not write, is kept and named in a warning.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from .files import (
    LATEST,
    LOGBOOK,
    few,
    left_by_shardwrap,
    remove_folder,
    restore_moved_aside,
    scratch_paths,
    surviving,
)
from .format import METADATA, metadata_of, own_files

__all__ = [
    "check_latest",
    "completed",
    "delete_checkpoint",
    "prune",
    "refuse_a_file_above",
    "refuse_foreign_scratch",
    "refuse_to_replace",
    "restore_all_moved_aside",
    "saves_in",
]

_LEFTOVERS = (".partial", ".deleting", ".old")  # hidden folders a killed save or delete leaves


def saves_in(folder: Path) -> list[str]:
    """What of shardwrap's own saves ``folder`` holds, each said for an error message: a
    checkpoint, checkpoints (a ``latest`` pointer, checkpoint folders), a Logbook's run."""
    if not folder.is_dir():
        return []
    found = []
    if metadata_of(folder) is not None:
        found.append(f"a shardwrap checkpoint ({METADATA})")
    if os.path.lexists(folder / LATEST):
        found.append(f"a '{LATEST}' pointer to checkpoints")
    inside = sorted(c.name for c in folder.iterdir() if metadata_of(c) is not None)
    if inside:
        found.append(f"checkpoints {few(inside)}")
    if (folder / LOGBOOK).is_file():
        found.append(f"a Logbook's run ({LOGBOOK})")
    return found


def _foreign(folder: Path) -> list[str] | None:
    """The entries of checkpoint ``folder`` that it did not write (``[]``: none), or ``None``
    where ``folder`` is no checkpoint of shardwrap's."""
    meta = metadata_of(folder)
    if meta is None:
        return None
    return sorted(c.name for c in folder.iterdir() if c.name not in own_files(meta))


def refuse_to_replace(target: Path) -> None:
    """Raise unless a checkpoint saved at ``target`` would delete nothing it did not write:
    ``target`` (or the copy of it a killed replacing save moved aside) must be new, an empty
    folder, or a checkpoint holding only its own files; never a symbolic link (replacing the
    link would leave what it leads to behind)."""
    refuse_a_file_above(target, "save_checkpoint")
    refuse_foreign_scratch(target, "save_checkpoint")
    folder = surviving(target)
    if folder.is_symlink():
        raise ValueError(
            f"save_checkpoint: {folder} is a symbolic link; a checkpoint is saved as a folder of "
            "its own, never through a link. Save to a path that does not exist yet, e.g. "
            f"{target.parent / 'step-000100'}"
        )
    if not os.path.lexists(folder):
        return
    if not folder.is_dir():
        raise ValueError(
            f"save_checkpoint: {target} is a file, not a checkpoint folder; pass a folder "
            "path that does not exist yet, e.g. ckpt/step-000100"
        )
    names = sorted(c.name for c in folder.iterdir())
    foreign = _foreign(folder)
    if foreign is None and names:
        saves = saves_in(folder)
        held = "; ".join(saves) if saves else few(names)
        hint = f", e.g. {target / 'step-000100'}" if os.path.lexists(folder / LATEST) else ""
        raise ValueError(
            f"save_checkpoint: {target} is not a shardwrap checkpoint: it holds {held}, which "
            f"replacing it would delete. Save to a folder path that does not exist yet{hint}"
        )
    if foreign:
        raise ValueError(
            f"save_checkpoint: {target} is a checkpoint that also holds {few(foreign)}, which "
            "it did not write and replacing it would delete. Move them out of it, or save to "
            "another path"
        )


def refuse_a_file_above(target: Path, caller: str) -> None:
    """Raise where the nearest of ``target``'s parents that exists is not a folder: no folder
    can be made under it (the operating system's own error names only the path)."""
    above = next((p for p in target.parents if os.path.lexists(p)), None)
    if above is not None and not above.is_dir():
        raise ValueError(
            f"{caller}: {above} is a file, not a folder, so no folder can be made under it for "
            f"{target}. Move the file away, or save under another folder"
        )


def refuse_foreign_scratch(target: Path, caller: str) -> None:
    """Raise where a hidden folder that a save or an export to ``target`` would delete or move
    (its temporary folder, the copy of ``target`` it moves aside, their names while deleted)
    is someone else's: not a folder of files named as shardwrap names its own."""
    for path in scratch_paths(target):
        if os.path.lexists(path) and not left_by_shardwrap(path):
            if path.is_dir() and not path.is_symlink():
                names = sorted(c.name for c in path.iterdir())
                held = f"holds {few(names)}, which it did not write"
            else:
                held = "is not a folder of shardwrap's"
            raise ValueError(
                f"{caller}: {path} is named as shardwrap names the hidden folders it writes "
                f"{target} through, which it deletes or moves, but it {held}. Rename or move "
                "it, or save to another path"
            )


def check_latest(folder: Path) -> None:
    """Raise unless the save may replace ``folder/latest``: absent, or a regular file (what
    shardwrap writes). A link or a folder there is someone else's, which the save would
    replace or fail on after committing; refused before anything is written."""
    pointer = folder / LATEST
    if os.path.lexists(pointer) and (pointer.is_symlink() or not pointer.is_file()):
        kind = "a symbolic link" if pointer.is_symlink() else "not a regular file"
        raise ValueError(
            f"save_checkpoint: {pointer} is {kind}, where shardwrap keeps its pointer to the "
            "latest checkpoint (a small file it replaces at every save). Move it away (what it "
            "leads to is not touched), or save into another folder"
        )


def completed(folder: Path) -> list[tuple[int, int, Path]]:
    """The complete checkpoints in ``folder``: (save sequence, save time, path), oldest first.

    Order is the sequence each save took as it completed; the clock only orders checkpoints
    written before saves were numbered, all of which come first. Links are not checkpoints,
    nor is a folder under another name than its checkpoint was saved as (a copy of one kept
    aside, a renamed one: the user's); checkpoints saved before the name was recorded count.
    """
    found = []
    for child in folder.iterdir() if folder.is_dir() else ():
        if child.name.startswith("."):
            continue
        meta = metadata_of(child)
        if meta is not None and meta.get("name", child.name) == child.name:
            sequence, saved = meta.get("sequence", 0), meta.get("saved_at_ns", 0)
            if _plain_int(sequence) and _plain_int(saved):
                found.append((sequence, saved, child))
    return sorted(found)


def _plain_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _leftover(child: Path) -> bool:
    """Whether ``child`` is a hidden folder that a killed save or delete left: named so, and a
    folder itself holding nothing but files named as a save names its own."""
    return (
        child.name.startswith(".") and child.name.endswith(_LEFTOVERS) and left_by_shardwrap(child)
    )


def restore_all_moved_aside(folder: Path) -> None:
    """Put back every checkpoint of ``folder`` that a killed replacing save left moved aside."""
    for child in folder.iterdir():
        if _leftover(child) and child.name.endswith(".old"):
            if metadata_of(child) is not None:
                restore_moved_aside(folder / child.name[1 : -len(".old")])


def delete_checkpoint(path: Path, why: str) -> bool:
    """Delete the checkpoint ``path`` if it holds only what shardwrap wrote; else keep it and
    warn, naming it, what else it holds or the error, and the fix. Returns whether it went.

    ``why``: who deletes it, for the warning (``"keep_last"``, ``"Logbook"``).
    """
    foreign = _foreign(path)
    if foreign is None:  # a link, or not (or no longer) a checkpoint: not ours to delete
        return False
    if foreign:
        warnings.warn(
            f"{why}: kept the old checkpoint {path}: it also holds {few(foreign)}, which "
            "shardwrap did not write and does not delete. Move them out of it, or delete it "
            "yourself",
            stacklevel=3,
        )
        return False
    try:
        remove_folder(path)
    except OSError as e:
        warnings.warn(
            f"{why}: could not delete the old checkpoint {path} ({e}); the new checkpoint is "
            "complete. Delete it yourself, or fix its permissions",
            stacklevel=3,
        )
        return False
    return True


def prune(folder: Path, keep_last: int, newest: Path) -> None:
    """Delete leftovers and all but the last ``keep_last`` completed checkpoints (rank 0).

    ``newest``, the save just completed and what ``latest`` names, is never deleted; nothing
    shardwrap did not write is touched, and nothing here raises (see the note above).
    """
    for child in folder.iterdir():
        if _leftover(child):
            try:
                shutil.rmtree(child)
            except OSError as e:
                warnings.warn(
                    f"keep_last: could not delete {child}, left by an earlier save ({e})",
                    stacklevel=2,
                )
    done = [path for _, _, path in completed(folder) if path != newest]
    for path in done[: max(0, len(done) - (keep_last - 1))]:
        delete_checkpoint(path, "keep_last")
