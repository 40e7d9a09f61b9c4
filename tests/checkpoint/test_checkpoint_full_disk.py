"""A checkpoint or an export onto a full disk: a named error, its space given back, nothing lost.

Proves at 2 ranks (threads):

- on a real full disk (a tmpfs mounted with room for one checkpoint and a half; the tests skip
  only where mounting is impossible, which needs root), ``save_checkpoint`` raises on every
  rank an ``OSError`` with ``errno`` ``ENOSPC`` naming the checkpoint, the bytes it needs (the
  tensor and extra files' exact sizes) and those free (what ``shutil.disk_usage`` says once
  the save's temporary files are deleted), and the fix; when any rank's call returns, the
  ``.partial`` folder is gone and its space free again; ``latest`` and the previous checkpoint
  are intact and load; after freeing space as the error says, the same save succeeds;
- the same for ``export`` onto a full disk: the previous export there is unchanged;
- a full disk met on one rank only (rank 1's writes raise ``ENOSPC``) is named on both;
- a full disk met while writing the new ``latest`` pointer leaves no ``.latest.tmp`` behind
  (before, an empty one stayed);
- any other ``OSError`` met on one rank only (a folder it may not write into) is an ``OSError``
  with that ``errno`` on every rank, so that ``except OSError`` runs on each alike (before, the
  others raised a ``RuntimeError``, and a fallback save on the failing rank alone waited out the
  timeout); a file where a parent folder should be is refused on every rank naming it.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_full_disk.py -q``
"""

from __future__ import annotations

import copy
import errno
import gc
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, export, latest_checkpoint, load_checkpoint, save_checkpoint
from shardwrap.checkpoint import files, save
from shardwrap.checkpoint.files import PeerOSError, SafetensorsWriter
from tests.support.models import GPT, Block, make_batch
from tests.support.ranks import run_ranks

WORLD = 2
PAGE = 4096  # tmpfs allocates whole pages per file


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Any]:
    """``mount(bytes)``: a tmpfs of that size at ``tmp_path/disk``, unmounted afterwards."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = []

    def mount(size: int) -> Path:
        size = -(-size // PAGE) * PAGE
        run = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here (needs root): {run.stderr.strip()}")
        mounted.append(disk)
        return disk

    try:
        yield mount
    finally:
        gc.collect()  # memory maps of loaded files
        for folder in mounted:  # fails while a file there is still open: nothing may be
            subprocess.run(["umount", str(folder)], check=True, capture_output=True)


def _train(m: Any, opt: torch.optim.Optimizer, pg: ProcessGroup, step: int) -> None:
    idx, targets = make_batch(step, 8)
    idx, targets = idx.chunk(WORLD)[pg.rank()], targets.chunk(WORLD)[pg.rank()]
    m(idx, targets).backward()
    opt.step()
    opt.zero_grad()


def _footprint(folder: Path) -> int:
    """Bytes the files under ``folder`` take on a tmpfs: whole pages each."""
    return sum(-(-f.stat().st_size // PAGE) * PAGE for f in folder.rglob("*") if f.is_file())


def _bytes_in(message: str, before: str) -> int:
    """The byte count that follows ``before`` in ``message``."""
    found = re.search(re.escape(before) + r" ([\d,]+) bytes \(", message)
    assert found, message
    return int(found.group(1).replace(",", ""))


def _model() -> GPT:
    torch.manual_seed(0)
    return GPT(width=48, heads=4)


def test_a_checkpoint_onto_a_full_disk(tmp_path: Path, small_disk: Any) -> None:
    model = _model()
    probe = tmp_path / "probe"

    def save_once(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        _train(m, opt, pg, 0)
        save_checkpoint(probe / "step-1", m, opt, step=1)

    run_ranks(WORLD, save_once)
    one = _footprint(probe)
    disk = small_disk(one + one // 2)  # room for one checkpoint and a half
    ckpt = disk / "ckpt"
    partial = ckpt / ".step-2.partial"

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Any]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        _train(m, opt, pg, 0)
        save_checkpoint(ckpt / "step-1", m, opt, step=1)
        saved = m.full_state_dict()
        _train(m, opt, pg, 1)
        free = shutil.disk_usage(disk).free
        with pytest.raises(OSError) as error:
            save_checkpoint(ckpt / "step-2", m, opt, step=2)
        seen = {  # as this rank's call returns
            "errno": error.value.errno,
            "message": str(error.value),
            "partial": partial.exists(),
            "free_again": shutil.disk_usage(disk).free == free,
            "latest": latest_checkpoint(ckpt),
        }
        fresh = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        seen["extra"] = load_checkpoint(ckpt, fresh)
        torch.testing.assert_close(fresh.full_state_dict(), saved, atol=0, rtol=0)
        pg.barrier().wait()
        if rank == 0:  # the fix the error names: free space there
            shutil.rmtree(ckpt / "step-1")
        pg.barrier().wait()
        save_checkpoint(ckpt / "step-2", m, opt, step=2)
        seen["retried"] = latest_checkpoint(ckpt)
        return seen

    step1 = ckpt / "step-1"
    for rank, seen in enumerate(run_ranks(WORLD, fn)):
        message = seen["message"]
        assert seen["errno"] == errno.ENOSPC, message
        assert f"save_checkpoint: no space left on device while saving {ckpt / 'step-2'}" in message
        assert "Free space there" in message and "save to another disk" in message
        assert not seen["partial"] and seen["free_again"], rank
        assert seen["latest"] == step1 and seen["extra"] == {"step": 1}
        assert seen["retried"] == ckpt / "step-2"
    # the probe's files hold the same tensors and extras: the bytes needed are theirs
    written = [f for f in (probe / "step-1").iterdir() if f.suffix in (".safetensors", ".pt")]
    tensor_files = sum(f.stat().st_size for f in written if f.name != "optimizer.pt")
    assert _bytes_in(message, "it needs at least") == tensor_files


def test_an_export_onto_a_full_disk_keeps_the_previous_one(tmp_path: Path, small_disk: Any) -> None:
    model = _model()
    size = sum(v.nbytes for v in model.state_dict().values())
    disk = small_disk(size + size // 2 + 8 * PAGE)
    out = disk / "out"

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Any]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        export(out, m)
        pg.barrier().wait()
        before = {f.name: f.read_bytes() for f in out.iterdir()}
        free = shutil.disk_usage(disk).free
        with pytest.raises(OSError) as error:
            export(out, m)
        return {
            "errno": error.value.errno,
            "message": str(error.value),
            "unchanged": {f.name: f.read_bytes() for f in out.iterdir()} == before,
            "leftovers": sorted(p.name for p in disk.iterdir()),
            "free_again": shutil.disk_usage(disk).free == free,
        }

    for seen in run_ranks(WORLD, fn):
        message = seen["message"]
        assert seen["errno"] == errno.ENOSPC, message
        assert f"export: no space left on device while saving {out}" in message
        assert f"{out} is as it was" in message
        assert seen["unchanged"] and seen["free_again"] and seen["leftovers"] == ["out"]
        assert _bytes_in(message, "it needs at least") == (out / "model.safetensors").stat().st_size


def test_a_full_disk_on_one_rank_is_named_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    write = SafetensorsWriter.write

    def full_on_rank_1(self: SafetensorsWriter, tensor: Tensor) -> None:
        if self.path.parent.name == ".step-2.partial" and self.path.name.startswith("rank-00001"):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, tensor)

    monkeypatch.setattr(SafetensorsWriter, "write", full_on_rank_1)

    def fn(rank: int, pg: ProcessGroup) -> tuple[int, str, bool]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        save_checkpoint(tmp_path / "step-1", m, opt, step=1)
        with pytest.raises(OSError) as error:
            save_checkpoint(tmp_path / "step-2", m, opt, step=2)
        return error.value.errno, str(error.value), (tmp_path / ".step-2.partial").exists()

    (n0, message0, partial0), (n1, message1, partial1) = run_ranks(WORLD, fn)
    assert n0 == n1 == errno.ENOSPC
    assert "(met on rank(s) [1])" in message0 and "met on rank" not in message1
    assert not partial0 and not partial1
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]


def test_a_full_disk_at_the_latest_pointer_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    write_file = files.write_file

    def full_at_latest(path: Path, data: bytes) -> int:
        if path.name == ".latest.tmp" and (tmp_path / "step-1").exists():
            path.write_bytes(data[:1])
            raise OSError(errno.ENOSPC, "No space left on device")
        return write_file(path, data)

    monkeypatch.setattr(files, "write_file", full_at_latest)

    def fn(rank: int, pg: ProcessGroup) -> int | None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        save_checkpoint(tmp_path / "step-1", m, step=1)
        with pytest.raises(OSError) as error:
            save_checkpoint(tmp_path / "step-2", m, step=2)
        return error.value.errno

    assert run_ranks(WORLD, fn) == [errno.ENOSPC] * WORLD
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-1"]


def test_an_os_error_on_one_rank_is_an_os_error_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    begin = save.begin_folder

    def read_only(target: Path) -> Path:
        if target.parent.name == "read-only":
            raise PermissionError(errno.EACCES, "Permission denied", str(target.parent))
        return begin(target)

    monkeypatch.setattr(save, "begin_folder", read_only)

    def fn(rank: int, pg: ProcessGroup) -> tuple[type, str]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        try:
            save_checkpoint(tmp_path / "read-only" / "step-1", m, step=1)
        except OSError as e:
            assert e.errno == errno.EACCES
            caught = type(e), str(e)
            save_checkpoint(tmp_path / "fallback" / "step-1", m, step=1)  # every rank: no wait
        return caught

    (kind0, _), (kind1, message1) = run_ranks(WORLD, fn, timeout=30)
    assert kind0 is PermissionError and kind1 is PeerOSError
    assert "failed on rank(s) [0] with permission denied (errno 13)" in message1
    assert latest_checkpoint(tmp_path / "fallback") == tmp_path / "fallback" / "step-1"


def test_a_file_where_a_parent_folder_should_be_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "ckpt").write_text("not a folder")
    model = _model()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        for call in (save_checkpoint, export):
            with pytest.raises(ValueError, match=r"ckpt is a file, not a folder, so no folder"):
                call(tmp_path / "ckpt" / "run" / "step-1", m)

    run_ranks(WORLD, fn)
    assert (tmp_path / "ckpt").read_text() == "not a folder"
