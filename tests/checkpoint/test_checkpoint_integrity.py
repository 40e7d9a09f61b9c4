"""Checkpoint contents damaged after the save are refused on load, before anything changes.

Every stored tensor's checksum and dtype, and every ``.pt`` file's checksum, are recorded in
``metadata.json`` when the checkpoint is written, and each rank checks all it reads before
writing anything. Proves, at world sizes 1 and 2 with a small GPT and AdamW state:

- 16 flipped bytes in a parameter piece or in an optimizer-state piece, a rank file's data
  filled with 0xFF (every value NaN), a header whose dtype says I32 where F32 was written, and a
  flipped byte in ``optimizer.pt`` or in an ``extra`` file are each refused on every rank,
  naming the file and the tensor, with the model and optimizer left as they were;
- an undamaged checkpoint loads at another world size (pieces read in part are checked whole);
- checksums taken on another thread (a background save's writer) leave the process's warning
  filters as the training thread set them;
- running out of memory while reading a file is said as such, never as damage.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_integrity.py -q``
"""

from __future__ import annotations

import copy
import json
import shutil
import struct
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed import ProcessGroup

import shardwrap.checkpoint.load
from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.checkpoint.checksum import Checksum, buffer_checksum
from tests.support.models import GPT, Block
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # files on disk: the stage plays no part

RANK_FILE = "rank-00001-of-00002.safetensors"


torch.manual_seed(0)
BASE = GPT()


def _trained(pg: ProcessGroup) -> tuple[ShardedModule, torch.optim.Optimizer]:
    model = ShardedModule(copy.deepcopy(BASE), auto_wrap=Block, process_group=pg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(pg.rank())
    x, y = (torch.randint(67, (2, 16), generator=g) for _ in range(2))
    model(x, y).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("integrity") / "ckpt"

    def fn(rank: int, pg: ProcessGroup) -> None:
        model, opt = _trained(pg)
        save_checkpoint(folder, model, opt, step=3)

    run_ranks(2, fn)
    return folder


def _header(path: Path) -> tuple[int, dict]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return 8 + length, json.loads(data[8 : 8 + length])


def _flip(path: Path, at: int, n: int = 16) -> None:
    data = bytearray(path.read_bytes())
    for i in range(at, at + n):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _flip_tensor(key_prefix: str) -> Callable[[Path], str]:
    def damage(folder: Path) -> str:
        path = folder / RANK_FILE
        base, header = _header(path)
        key = next(k for k, v in header.items() if k.startswith(key_prefix) and v["shape"][0] > 8)
        _flip(path, base + header[key]["data_offsets"][0])
        return key

    return damage


def _fill_ff(folder: Path) -> str:
    path = folder / RANK_FILE
    base, _ = _header(path)
    data = path.read_bytes()
    path.write_bytes(data[:base] + b"\xff" * (len(data) - base))
    return RANK_FILE


def _dtype_i32(folder: Path) -> str:
    path = folder / RANK_FILE
    data = path.read_bytes()
    at = data.index(b'"dtype":"F32"')
    path.write_bytes(data[:at] + b'"dtype":"I32"' + data[at + len(b'"dtype":"F32"') :])
    return "as I32, but it was written as F32"


def _flip_file(name: str) -> Callable[[Path], str]:
    def damage(folder: Path) -> str:
        _flip(folder / name, (folder / name).stat().st_size // 2, n=1)
        return f"{name} fails its checksum"

    return damage


torch.manual_seed(1)
OTHER = GPT()  # other weights, to load into

CASES = {
    "param-bytes": (_flip_tensor("model/"), "fails its checksum"),
    "optimizer-state-bytes": (_flip_tensor("optim/"), "fails its checksum"),
    "data-0xff": (_fill_ff, "fails its checksum"),
    "header-dtype": (_dtype_i32, "as I32, but it was written as F32"),
    "optimizer.pt": (_flip_file("optimizer.pt"), "optimizer.pt fails its checksum"),
    "extra": (_flip_file("extra-00001.pt"), "extra-00001.pt fails its checksum"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_damage_is_refused_and_changes_nothing(saved: Path, tmp_path: Path, case: str) -> None:
    damage, message = CASES[case]
    folder = tmp_path / "ckpt"
    shutil.copytree(saved, folder)
    named = damage(folder)

    def fn(rank: int, pg: ProcessGroup) -> None:
        model = ShardedModule(copy.deepcopy(OTHER), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = copy.deepcopy(model.full_state_dict())
        with pytest.raises((ValueError, RuntimeError)) as info:
            load_checkpoint(folder, model, opt)
        if rank == 1:  # the rank that reads the damaged file names it; the other names rank 1
            assert message in str(info.value) and (named in str(info.value) or "as I32" in named)
        else:
            assert "failed on rank(s) [1]" in str(info.value) or message in str(info.value)
        after = model.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert opt.state_dict()["state"] == {}

    run_ranks(2, fn)


def test_an_undamaged_checkpoint_loads_at_another_world_size(saved: Path) -> None:
    want = run_ranks(2, lambda rank, pg: _trained(pg)[0].full_state_dict())[0]
    model = ShardedModule(GPT(), auto_wrap=Block)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    assert load_checkpoint(saved, model, opt) == {"step": 3}
    torch.testing.assert_close(model.full_state_dict(), want, atol=0, rtol=0)


def test_checking_on_another_thread_leaves_the_warning_filters_alone(
    monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """A background save's writer checksums files while the training thread goes on: a
    checksum that swapped the process's warning filters for its own while the training thread
    entered and left ``catch_warnings`` put back that thread's stale ones, so later warnings
    went to a recorder no one reads."""
    inside, release = threading.Event(), threading.Event()
    add = Checksum.add_words

    def held(self: Checksum, words: Any, tail: bytes) -> None:
        inside.set()
        assert release.wait(30)
        add(self, words, tail)

    monkeypatch.setattr(Checksum, "add_words", held)
    filters, show = list(warnings.filters), warnings.showwarning
    with warnings.catch_warnings(record=True):  # the training thread's, entered first
        writer = threading.Thread(target=buffer_checksum, args=(bytes(64),))
        writer.start()
        assert inside.wait(30)
    release.set()  # the writer's checksum ends after the training thread left its own
    writer.join(30)
    assert warnings.filters == filters and warnings.showwarning is show
    warnings.warn("still heard", stacklevel=1)
    assert [str(w.message) for w in recwarn] == ["still heard"]


@pytest.mark.parametrize("reading", ["safetensors", "pt"])
def test_out_of_memory_while_loading_is_not_called_damage(
    saved: Path, monkeypatch: pytest.MonkeyPatch, reading: str
) -> None:
    """Rank 1 cannot map a rank file (what safetensors raises under a memory cap), or cannot
    unpickle ``optimizer.pt``: it says it ran out of memory and that the file is not known to
    be damaged (told "corrupt", a user might delete a good checkpoint); every rank raises and
    nothing changes."""
    out_of_memory = MemoryError("Cannot allocate memory (os error 12)")
    if reading == "safetensors":
        real = shardwrap.checkpoint.load.safe_open

        def mapped(path: Path, **kwargs: Any) -> Any:
            if threading.current_thread().name == "rank1" and "rank-" in Path(path).name:
                raise out_of_memory
            return real(path, **kwargs)

        monkeypatch.setattr(shardwrap.checkpoint.load, "safe_open", mapped)
    else:
        load = torch.load

        def unpickled(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread().name == "rank1":
                raise out_of_memory
            return load(*args, **kwargs)

        monkeypatch.setattr(torch, "load", unpickled)

    def fn(rank: int, pg: ProcessGroup) -> str:
        model = ShardedModule(copy.deepcopy(OTHER), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        before = copy.deepcopy(model.full_state_dict())
        with pytest.raises((MemoryError, RuntimeError)) as info:
            load_checkpoint(saved, model, opt)
        after = model.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        return str(info.value)

    errors = run_ranks(2, fn)
    assert "failed on rank(s) [1]" in errors[0]
    assert errors[1].startswith(f"load_checkpoint: out of memory while reading {saved}/"), errors
    assert "nothing is known to be wrong with the file, so do not delete it" in errors[1]
    assert "corrupt" not in errors[1]
