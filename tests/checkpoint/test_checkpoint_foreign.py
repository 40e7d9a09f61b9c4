"""Anything in the folder of checkpoints that shardwrap did not write is left alone and never
breaks a save.

Proves, at 2 ranks (and the warnings at world size 1):

- among the checkpoints, a symbolic link to one, a link named like a leftover of a killed save,
  a file, a folder of the user's and a checkpoint holding a file the user put there: saves with
  ``keep_last=1`` complete, ``latest`` follows them, the older checkpoints are pruned, and every
  one of those entries is still there, the checkpoint holding a foreign file kept with a warning
  naming it (before, the first link made every later save raise "Cannot call rmtree on a
  symbolic link" after committing, and nothing was pruned);
- a ``latest`` that is a symbolic link is never followed: loads refuse it without quoting what
  it leads to, saves refuse it before writing anything (it stays as it was);
- ``metadata.json`` nested deeper than JSON can parse is refused naming the file, not with a
  bare ``RecursionError``;
- the user's folders named like a save's hidden ones (``.cache.old``, ``.eval.partial``,
  ``.x.deleting``) are left alone by ``keep_last``, which deletes only such folders holding
  nothing but files named as a save or an export names its own (before, it deleted every one,
  whatever it held); a save or an export whose own hidden folder (``.step-2.partial``) is the
  user's is refused on every rank before anything is written (before, it was deleted); every
  name a save and an export write passes that check;
- a copy of a checkpoint kept aside (``best``) or a renamed one is the user's: ``keep_last``
  prunes only folders under the name their checkpoint was saved as (before, it deleted the
  copy).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_foreign.py``
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, export, latest_checkpoint, load_checkpoint, save_checkpoint
from shardwrap.checkpoint.export import CONFIGS, INDEX, _file_name
from shardwrap.checkpoint.files import left_by_shardwrap
from shardwrap.checkpoint.format import (
    BUFFERS,
    METADATA,
    OPTIMIZER,
    checksum_file,
    extra_file,
    owned_file,
    rank_file,
    residuals_file,
)
from tests.support.models import GPT, Block
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # files on disk: the stage plays no part

torch.manual_seed(0)
MODEL = GPT(depth=1)


def _foreign(folder: Path) -> dict[str, str]:
    """Put the user's entries among checkpoints ``step-0`` and ``step-1``; what each is."""
    (folder / "best").symlink_to("step-1")
    (folder / ".mine.partial").symlink_to(folder / "mine")
    (folder / "notes.txt").write_text("mine")
    (folder / "mine").mkdir()
    (folder / "mine" / "data.txt").write_text("mine")
    (folder / "step-0" / "README").write_text("the run before the fix")
    return {
        "best": "link",
        ".mine.partial": "link",
        "notes.txt": "file",
        "mine": "folder",
        "step-0": "checkpoint with a foreign file",
    }


def test_entries_of_the_user_among_the_checkpoints_never_break_a_save(tmp_path: Path) -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block, process_group=pg)
        for step in range(2):
            save_checkpoint(tmp_path / f"step-{step}", m, step=step)
        if rank == 0:
            _foreign(tmp_path)
        pg.barrier().wait()
        for step in range(2, 5):
            done = save_checkpoint(tmp_path / f"step-{step}", m, blocking=step % 2 == 0,
                                   keep_last=1, step=step)  # fmt: skip
            if not isinstance(done, Path):
                done.wait()
            assert latest_checkpoint(tmp_path) == tmp_path / f"step-{step}"

    with pytest.warns(UserWarning, match=r"kept the old checkpoint .*step-0.*'README'"):
        run_ranks(2, fn)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".mine.partial", "best", "latest", "mine", "notes.txt", "step-0", "step-4"]
    )
    assert os.readlink(tmp_path / "best") == "step-1"  # left as it was, though step-1 is gone
    assert (tmp_path / "mine" / "data.txt").read_text() == "mine"
    assert (tmp_path / "step-0" / "README").is_file()
    m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block)
    assert load_checkpoint(tmp_path, m) == {"step": 4}


def test_a_latest_that_is_a_link_is_never_followed(tmp_path: Path) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("SECRET-TOKEN\n")
    folder = tmp_path / "ckpt"
    m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block)
    save_checkpoint(folder / "step-1", m, step=1)
    (folder / "latest").unlink()
    (folder / "latest").symlink_to(secret)
    for call in (lambda: latest_checkpoint(folder), lambda: load_checkpoint(folder, m)):
        with pytest.raises(ValueError, match="is a symbolic link") as info:
            call()
        assert "SECRET" not in str(info.value)
    with pytest.raises(ValueError, match=r"latest is a symbolic link.*Move it away"):
        save_checkpoint(folder / "step-2", m, step=2)
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-1"]
    assert os.readlink(folder / "latest") == str(secret)
    assert load_checkpoint(folder / "step-1", m) == {"step": 1}


def test_metadata_nested_too_deep_is_refused_naming_the_file(tmp_path: Path) -> None:
    m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block)
    save_checkpoint(tmp_path / "step-1", m, step=1)
    depth = 100_000
    (tmp_path / "step-1" / "metadata.json").write_text("[" * depth + "]" * depth)
    with pytest.raises(ValueError, match=r"metadata.json is corrupt: it nests deeper"):
        load_checkpoint(tmp_path / "step-1", m)


def _user_folder(path: Path) -> None:
    path.mkdir()
    (path / "results.json").write_text("mine")


def test_the_users_folders_named_like_a_saves_hidden_ones_are_left_alone(tmp_path: Path) -> None:
    def fn(rank: int, pg: ProcessGroup) -> str:
        m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block, process_group=pg)
        save_checkpoint(tmp_path / "step-1", m, step=1)
        if rank == 0:
            for name in (".cache.old", ".eval.partial", ".x.deleting", ".step-2.partial"):
                _user_folder(tmp_path / name)
            (tmp_path / ".step-0.partial").mkdir()  # a killed save's: its files only
            (tmp_path / ".step-0.partial" / rank_file(0, 2)).write_bytes(b"\0" * 8)
        pg.barrier().wait()
        with pytest.raises(ValueError) as info:
            save_checkpoint(tmp_path / "step-2", m, step=2)
        pg.barrier().wait()
        save_checkpoint(tmp_path / "step-3", m, keep_last=1, step=3)
        return str(info.value)

    for message in run_ranks(2, fn):
        assert ".step-2.partial is named as shardwrap names the hidden folders" in message
        assert "'results.json', which it did not write" in message
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".cache.old", ".eval.partial", ".step-2.partial", ".x.deleting", "latest",
                     "step-3"]  # fmt: skip
    for name in (".cache.old", ".eval.partial", ".step-2.partial", ".x.deleting"):
        assert (tmp_path / name / "results.json").read_text() == "mine"


def test_an_export_whose_hidden_folder_is_the_users_is_refused(tmp_path: Path) -> None:
    m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block)
    _user_folder(tmp_path / ".model.partial")
    with pytest.raises(ValueError, match=r"\.model\.partial is named as shardwrap names"):
        export(tmp_path / "model", m)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".model.partial"]


def test_every_name_a_save_or_an_export_writes_is_one_it_may_delete(tmp_path: Path) -> None:
    names = [METADATA, BUFFERS, OPTIMIZER, INDEX, *CONFIGS, _file_name(0, 1), _file_name(2, 3)]
    names += [rank_file(3, 4), extra_file(3), owned_file(3), residuals_file(3)]
    names += [checksum_file(rank_file(123456, 200000)), checksum_file(BUFFERS)]
    folder = tmp_path / ".step-1.partial"
    folder.mkdir()
    for name in names:
        (folder / name).write_bytes(b"")
        assert left_by_shardwrap(folder), name
    (folder / "notes.txt").write_bytes(b"")
    assert not left_by_shardwrap(folder)


def test_a_copy_of_a_checkpoint_kept_aside_is_not_pruned(tmp_path: Path) -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block, process_group=pg)
        for step in range(1, 5):
            save_checkpoint(tmp_path / f"step-{step}", m, keep_last=2, step=step)
            if step == 2 and rank == 0:
                shutil.copytree(tmp_path / "step-2", tmp_path / "best")
                shutil.copytree(tmp_path / "step-1", tmp_path / "first")
                shutil.rmtree(tmp_path / "step-1")
            pg.barrier().wait()

    run_ranks(2, fn)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best", "first", "latest", "step-3",
                                                           "step-4"]  # fmt: skip
    m = ShardedModule(copy.deepcopy(MODEL), auto_wrap=Block)
    assert load_checkpoint(tmp_path / "best", m) == {"step": 2}
