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
  bare ``RecursionError``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_foreign.py``
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, latest_checkpoint, load_checkpoint, save_checkpoint
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
