"""Checkpoints that are malformed, point outside their folder, or are pruned by a wrong clock.

Proves, at world size 1 and 2 with a small GPT:

- ``keep_last`` keeps the last saves in the order they completed, whatever the clock says, and
  never deletes the checkpoint ``latest`` names;
- ``save_checkpoint`` refuses ``extra`` values that ``load_checkpoint`` could not read back,
  naming the key, before anything is written; and options of another type or out of range
  (``blocking="False"``, ``keep_last=True``, ``max_shard_size=True``) alike;
- a ``metadata.json`` missing an entry or holding one of the wrong shape is refused naming the
  file and what is wrong, never a bare ``KeyError``;
- file names in ``metadata.json``, a ``latest`` pointer and an export's index that lead
  outside their folder are refused;
- an export's index whose ``weight_map`` is not a mapping, is missing, names a file that lacks
  the tensor, or nests too deep is refused on every rank naming the index and the fix;
- hyperparameters in ``optimizer.pt`` of another kind than the optimizer's (a string ``lr``)
  are refused on every rank before anything changes.

Run:
``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_validation.py -q``
"""

from __future__ import annotations

import argparse
import copy
import json
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.distributed import ProcessGroup

from shardwrap import (
    ShardedModule,
    export,
    latest_checkpoint,
    load_checkpoint,
    load_pretrained,
    save_checkpoint,
)
from shardwrap.checkpoint.checksum import buffer_checksum
from shardwrap.checkpoint.files import PeerFailed
from tests.support.models import GPT, Block
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # files on disk: the stage plays no part


def _model() -> ShardedModule:
    torch.manual_seed(0)
    return ShardedModule(GPT(), auto_wrap=Block)


# pruning -----------------------------------------------------------------------------


def test_keep_last_follows_the_order_of_saves_not_the_clock(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model()
    clock = iter([5_000, 4_000, 3_000, 2_000])  # the clock steps back at every save
    monkeypatch.setattr(time, "time_ns", lambda: next(clock))
    for step in range(4):
        save_checkpoint(tmp_path / f"step-{step}", model, keep_last=2, step=step)
        assert latest_checkpoint(tmp_path) == tmp_path / f"step-{step}"
        assert load_checkpoint(tmp_path, model) == {"step": step}
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == ["step-2", "step-3"]


def test_keep_last_one_keeps_the_save_just_made(tmp_path: Path) -> None:
    model = _model()
    for step in range(3):
        save_checkpoint(tmp_path / f"step-{step}", model, keep_last=1, step=step)
    assert [p.name for p in tmp_path.iterdir() if p.is_dir()] == ["step-2"]


# extra values ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "named"),
    [
        (np.random.default_rng(0).bit_generator.state, None),  # plain dicts: accepted
        (np.random.get_state(), "numpy.ndarray"),
        (argparse.Namespace(lr=0.1), "argparse.Namespace"),
    ],
    ids=["numpy-generator-state", "numpy-legacy-state", "namespace"],
)
def test_extra_that_would_not_load_back_is_refused_at_save(
    tmp_path: Path, value: Any, named: str | None
) -> None:
    model = _model()
    if named is None:
        save_checkpoint(tmp_path / "ckpt", model, rng=value)
        assert load_checkpoint(tmp_path / "ckpt", model)["rng"] == value
        return
    with pytest.raises(TypeError, match=f"extra 'rng' .*{named}.*would not load back"):
        save_checkpoint(tmp_path / "ckpt", model, rng=value, step=3)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / ".ckpt.partial").exists()


def test_refused_extra_raises_on_every_rank_before_writing(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        value = argparse.Namespace(seed=rank) if rank == 1 else rank
        with pytest.raises((TypeError, RuntimeError)) as info:
            save_checkpoint(tmp_path / "ckpt", m, args=value)
        assert ("extra 'args'" if rank == 1 else "failed on rank(s) [1]") in str(info.value)

    run_ranks(2, fn, timeout=30.0)
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("blocking", [True, False])
def test_a_path_that_differs_across_ranks_is_refused_on_every_rank(
    tmp_path: Path, blocking: bool
) -> None:
    """A save (blocking or not), a load and a ``load_pretrained`` given a path built from the
    rank: every rank raises naming it, before anything is written or read (before: a
    ``FileNotFoundError`` for another rank's temporary file on one rank and ``PeerFailed`` on
    the others, and a ``load_pretrained`` would have loaded each rank's own weights); nothing is
    left behind, and a save to one path then works."""
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        for call in (
            lambda: save_checkpoint(tmp_path / f"tag-{rank}", m, blocking=blocking),
            lambda: load_checkpoint(tmp_path / f"tag-{rank}", m),
            lambda: load_pretrained(tmp_path / f"export-{rank}", m),
        ):
            with pytest.raises(ValueError, match="the ranks passed different paths") as info:
                call()
            assert f"-{rank}'" in str(info.value) and "not from the rank" in str(info.value)
        handle = save_checkpoint(tmp_path / "tag", m, blocking=blocking)
        if not blocking:
            handle.wait()

    run_ranks(2, fn, timeout=30.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "tag"]


def test_an_empty_or_missing_path_is_refused_on_every_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``save_checkpoint("")`` would have been the working folder (a save from an empty one
    tried to rename it aside: ``OSError: Device or resource busy``), ``None`` gave Python's bare
    ``TypeError``: a save, a load, an export and a ``load_pretrained`` given an empty path or
    ``None`` on one rank raise on every rank, naming it, before anything is written; the
    working folder is left empty."""
    torch.manual_seed(0)
    model = GPT()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        for bad, error, words in (("", ValueError, "the path is empty"), (None, TypeError, "None")):
            for call in (save_checkpoint, load_checkpoint, export, load_pretrained):
                path = bad if rank == 1 else work / "ckpt"
                with pytest.raises((error, PeerFailed)) as info:
                    call(path, m)
                if rank == 1:
                    assert isinstance(info.value, error) and words in str(info.value)
                else:
                    assert "rank(s) [1]" in str(info.value)

    run_ranks(2, fn, timeout=30.0)
    assert list(work.iterdir()) == []


# options ----------------------------------------------------------------------------------

OPTIONS = {
    "blocking-string": (
        "save",
        {"blocking": "False"},
        TypeError,
        "blocking must be True or False, got 'False'",
    ),
    "keep-last-string": ("save", {"keep_last": "3"}, ValueError, "keep_last must be None or an"),
    "keep-last-bool": ("save", {"keep_last": True}, ValueError, "of at least 1 (the checkpoints"),
    "shard-size-bool": ("export", {"max_shard_size": True}, ValueError, "cannot read True"),
    "shard-size-zero": ("export", {"max_shard_size": "0GB"}, ValueError, "at least 1 byte"),
}


@pytest.mark.parametrize("case", list(OPTIONS))
def test_options_of_another_type_or_out_of_range_are_refused(tmp_path: Path, case: str) -> None:
    """On every rank, before anything is written, naming the option and the value; before,
    ``blocking="False"`` saved blocking, ``keep_last=True`` kept one, ``max_shard_size=True``
    wrote a file per tensor and a string ``keep_last`` raised a bare ``TypeError``."""
    call, options, error, message = OPTIONS[case]
    torch.manual_seed(0)
    base = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        with pytest.raises(error, match=re.escape(message)):
            if call == "save":
                save_checkpoint(tmp_path / "ckpt", m, **options)
            else:
                export(tmp_path / "out", m, **options)

    run_ranks(2, fn, timeout=30.0)
    assert list(tmp_path.iterdir()) == []


# malformed metadata --------------------------------------------------------------------


def _edit_metadata(folder: Path, edit: Any) -> None:
    path = folder / "metadata.json"
    meta = json.loads(path.read_text())
    edit(meta)
    path.write_text(json.dumps(meta))


def _first_param(meta: dict[str, Any]) -> dict[str, Any]:
    return next(iter(meta["params"].values()))


MALFORMED = {
    "no-params": (lambda m: m.pop("params"), 'lacks the "params" entry'),
    "pieces-string": (
        lambda m: _first_param(m).update(pieces="rank-00000-of-00001.safetensors"),
        '"pieces" must be a list of',
    ),
    "pieces-short": (lambda m: _first_param(m).update(pieces=[["x"]]), '"pieces" must be'),
    "world-size-zero": (lambda m: m.update(world_size=0), '"world_size" and "ranks" must be'),
    "state-keys": (lambda m: m.update(optimizer={"state_keys": 3}), '"optimizer" must be'),
    "piece-outside": (
        lambda m: _first_param(m)["pieces"][0].__setitem__(0, "../other/rank.safetensors"),
        "a plain name inside the folder",
    ),
    "piece-absolute": (
        lambda m: _first_param(m)["pieces"][0].__setitem__(0, "/tmp/rank.safetensors"),
        "a plain name inside the folder",
    ),
    "file-outside": (
        lambda m: m["files"].update({"../x.safetensors": 1}),
        '"files" must map plain file names',
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_metadata_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    save_checkpoint(tmp_path / "ckpt", model, opt)
    edit, message = MALFORMED[case]
    _edit_metadata(tmp_path / "ckpt", edit)
    before = model.full_state_dict()
    with pytest.raises(ValueError, match="malformed") as info:
        load_checkpoint(tmp_path / "ckpt", model, opt)
    assert str(tmp_path / "ckpt" / "metadata.json") in str(info.value)
    assert message in str(info.value)
    after = model.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_latest_pointing_outside_its_folder_is_refused(tmp_path: Path) -> None:
    model = _model()
    save_checkpoint(tmp_path / "other" / "step-1", model)
    save_checkpoint(tmp_path / "run" / "step-1", model)
    for target in ("../other/step-1", str(tmp_path / "other" / "step-1")):
        (tmp_path / "run" / "latest").write_text(target + "\n")
        with pytest.raises(ValueError, match="not a checkpoint inside"):
            load_checkpoint(tmp_path / "run", model)


def test_export_index_naming_files_outside_is_refused(tmp_path: Path) -> None:
    model = _model()
    export(tmp_path / "mine", model, max_shard_size="20KB")
    export(tmp_path / "other", model)
    index_path = tmp_path / "mine" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../other/model.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(ValueError, match="names files outside"):
        load_pretrained(tmp_path / "mine", model)


def _swap_files(index: dict[str, Any]) -> None:
    """Say each tensor is in a file it is not in (two files' entries swapped)."""
    where = index["weight_map"]
    first, second = sorted(set(where.values()))[:2]
    for key, file in where.items():
        where[key] = {first: second, second: first}.get(file, file)


MALFORMED_INDEX = {
    "weight-map-list": (lambda i: i.update(weight_map=list(i["weight_map"])), "got list"),
    "no-weight-map": (lambda i: i.pop("weight_map"), "got NoneType"),
    "key-not-in-file": (_swap_files, "which that file lacks"),
}


@pytest.mark.parametrize("case", [*MALFORMED_INDEX, "nested-too-deep"])
def test_a_malformed_export_index_is_refused_naming_it(tmp_path: Path, case: str) -> None:
    """On every rank, naming the index and the fix; never a bare ``AttributeError``, a
    ``SafetensorError`` without the file's name, or a ``RecursionError``."""
    export(tmp_path / "mine", _model(), max_shard_size="20KB")
    index_path = tmp_path / "mine" / "model.safetensors.index.json"
    if case == "nested-too-deep":
        index_path.write_text("[" * 100_000 + "]" * 100_000)
        message = "is corrupt"
    else:
        index = json.loads(index_path.read_text())
        edit, message = MALFORMED_INDEX[case]
        edit(index)
        index_path.write_text(json.dumps(index))
    torch.manual_seed(0)
    base = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        with pytest.raises(ValueError, match="load_pretrained: ") as info:
            load_pretrained(tmp_path / "mine", m)
        assert str(index_path) in str(info.value) and message in str(info.value)
        assert "Export the model again" in str(info.value)

    run_ranks(2, fn, timeout=30.0)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda o: next(iter(o["state"].values())).update(step=[1, 2]), '"step" of'),
        (lambda o: o.update(param_groups="all"), '"param_groups" must be a list'),
        (lambda o: o.update(state=[]), '"state" must map'),
    ],
    ids=["step-list", "groups-string", "state-list"],
)
def test_malformed_optimizer_state_changes_nothing(tmp_path: Path, edit: Any, message: str) -> None:
    """Refused during validation, before the model or the optimizer is written."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randint(67, (2, 16)), torch.randint(67, (2, 16))
    model(x, y).backward()
    opt.step()
    save_checkpoint(tmp_path / "ckpt", model, opt)
    path = tmp_path / "ckpt" / "optimizer.pt"
    saved = torch.load(path, weights_only=True)
    edit(saved)
    torch.save(saved, path)
    data = path.read_bytes()

    def record(meta: dict[str, Any]) -> None:  # as if it had been saved so: past size, checksum
        meta["files"]["optimizer.pt"] = len(data)
        meta["checksums"]["files"]["optimizer.pt"] = buffer_checksum(data)

    _edit_metadata(tmp_path / "ckpt", record)
    other = _model()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-3)
    before = other.full_state_dict()
    with pytest.raises(ValueError, match="optimizer.pt is malformed") as info:
        load_checkpoint(tmp_path / "ckpt", other, other_opt)
    assert message in str(info.value)
    after = other.full_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert other_opt.state_dict()["state"] == {}


def _resaved_optimizer(folder: Path, edit: Any) -> None:
    """Edit ``folder``'s ``optimizer.pt`` as if it had been saved so (size, checksum)."""
    path = folder / "optimizer.pt"
    saved = torch.load(path, weights_only=True)
    edit(saved)
    torch.save(saved, path)
    data = path.read_bytes()

    def record(meta: dict[str, Any]) -> None:
        meta["files"]["optimizer.pt"] = len(data)
        meta["checksums"]["files"]["optimizer.pt"] = buffer_checksum(data)

    _edit_metadata(folder, record)


HYPERPARAMETERS = {
    "lr-string": (lambda g: g.update(lr="0.1"), "sets 'lr' of parameter group 0 to '0.1' (a str)"),
    "betas-three": (lambda g: g.update(betas=(0.9, 0.99, 0.5)), "sets 'betas'"),
    "amsgrad-string": (lambda g: g.update(amsgrad="no"), "sets 'amsgrad'"),
}


@pytest.mark.parametrize("case", list(HYPERPARAMETERS))
def test_hyperparameters_of_another_kind_are_refused_before_anything_changes(
    tmp_path: Path, case: str
) -> None:
    """A string ``lr`` was loaded as is, and the next step failed."""
    edit, message = HYPERPARAMETERS[case]
    torch.manual_seed(0)
    base = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        save_checkpoint(tmp_path / "ckpt", m, opt)
        if rank == 0:
            _resaved_optimizer(tmp_path / "ckpt", lambda o: edit(o["param_groups"][0]))
        pg.barrier().wait()
        with pytest.raises((ValueError, RuntimeError)) as info:
            load_checkpoint(tmp_path / "ckpt", m, opt)
        assert str(tmp_path / "ckpt" / "optimizer.pt") in str(info.value)
        assert message in str(info.value) and "where AdamW holds" in str(info.value)
        assert opt.param_groups[0]["lr"] == 1e-3

    run_ranks(2, fn, timeout=30.0)


def test_a_groups_own_entries_load_back_and_what_would_not_is_refused_at_save(
    tmp_path: Path,
) -> None:
    """Entries a parameter group holds beyond its optimizer's options (a scheduler's
    ``initial_lr``, a 0-d tensor where ``lr`` is one; the user's own notes, a dict) were saved,
    then refused by ``load_checkpoint`` as written by other code, where the fresh optimizer
    lacked them: the scheduler was built after the load, as torch allows. Now they load back,
    as ``optimizer.load_state_dict`` takes them; an entry that would not (an object of the
    user's) is refused at the save, on every rank, before anything is written."""
    torch.manual_seed(0)
    base = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        opt = torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2))
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)
        opt.param_groups[0]["notes"] = {"layer": 0, "tags": ["all", 1.5]}
        opt.step()
        sched.step()
        save_checkpoint(tmp_path / "ckpt", m, opt, scheduler=sched.state_dict())
        fresh = torch.optim.AdamW(m.parameters(), lr=torch.tensor(1e-2))
        extra = load_checkpoint(tmp_path / "ckpt", m, fresh)
        group = fresh.param_groups[0]
        assert group["notes"] == {"layer": 0, "tags": ["all", 1.5]}
        assert torch.equal(group["initial_lr"], torch.tensor(1e-2))
        resumed = torch.optim.lr_scheduler.StepLR(fresh, 1, 0.5)
        resumed.load_state_dict(extra["scheduler"])
        assert torch.equal(group["lr"], opt.param_groups[0]["lr"])
        assert group["lr"].item() == pytest.approx(5e-3)
        opt.param_groups[0]["notes"] = object()
        with pytest.raises(ValueError, match=r"group 0 holds 'notes' = <object object .*load back"):
            save_checkpoint(tmp_path / "other", m, opt)
        assert not (tmp_path / "other").exists()

    run_ranks(2, fn, timeout=30.0)


# a save killed between its two renames -------------------------------------------------


def test_resave_killed_between_renames_loses_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replacing ``ckpt/step`` moves the old copy aside, then renames the new one in: a kill in
    between leaves no ``ckpt/step``. Loads find the copy moved aside; the next save puts it
    back before replacing it, so the last complete checkpoint is never deleted."""
    import shardwrap.checkpoint.files as storage

    model = _model()
    save_checkpoint(tmp_path / "step", model, keep_last=1, version=1)
    real_rename, calls = storage.os.rename, []

    def killed_after_moving_aside(src: Any, dst: Any) -> None:
        calls.append(Path(dst).name)
        if Path(src).name == ".step.partial":  # the second rename: the "kill"
            raise KeyboardInterrupt
        real_rename(src, dst)

    monkeypatch.setattr(storage.os, "rename", killed_after_moving_aside)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path / "step", model, keep_last=1, version=2)
    monkeypatch.setattr(storage.os, "rename", real_rename)
    assert ".step.old" in calls and not (tmp_path / "step").exists()

    assert load_checkpoint(tmp_path, model) == {"version": 1}  # via latest
    assert load_checkpoint(tmp_path / "step", model) == {"version": 1}
    save_checkpoint(tmp_path / "other", model, keep_last=2, version=3)  # prunes: keeps step
    assert load_checkpoint(tmp_path / "step", model) == {"version": 1}
    save_checkpoint(tmp_path / "step", model, keep_last=1, version=4)
    assert load_checkpoint(tmp_path, model) == {"version": 4}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step"]
