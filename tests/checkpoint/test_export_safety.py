"""Saving never deletes what it did not write, and refuses a folder it would lose or mix into.

Proves at 2 ranks (threads), on real files:

- ``tokenizer.save_pretrained(out)`` (a real tokenizer, built from a vocabulary) and a user's
  notes, then ``model.save_pretrained(out)`` or ``shardwrap.export(out, model)``: the
  tokenizer's files and the notes stay byte for byte, and ``from_pretrained(out)`` loads both
  the model and the tokenizer;
- exporting again into the same folder at another ``max_shard_size`` (sharded, fewer shards,
  one file, sharded again) replaces the model's files: the stale weight files of the previous
  export go, nothing else (a user's ``model-notes.txt``, a ``.bin`` shard) does, and the
  folder loads as the model each time;
- ``export`` and ``save_pretrained`` into a checkpoint, a folder of checkpoints or a Logbook's
  run, and ``save_checkpoint`` onto a user's folder, a folder of checkpoints, a Logbook's run, a
  file, or a checkpoint holding a user's file are refused on every rank, naming the folder,
  what it holds and the fix, with nothing on disk changed; ``save_checkpoint`` still replaces
  a checkpoint and fills an empty folder.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_export_safety.py -q``
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import Logbook, ShardedModule, export, load_checkpoint, save_checkpoint
from tests.support.models import GPT, HF_VOCAB, Block, hf_gpt2_lm
from tests.support.ranks import run_ranks

WORLD = 2


def _tree(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` (relative) and its bytes (``None`` for a folder)."""
    return {
        str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
    }


def _tokenizer() -> Any:
    """A real fast tokenizer over the tiny models' vocabulary, built without downloading."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(HF_VOCAB - 1)} | {"[UNK]": HF_VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


@pytest.mark.parametrize("how", ["save_pretrained", "export"])
def test_a_tokenizer_and_notes_saved_first_stay(tmp_path: Path, how: str) -> None:
    from transformers import AutoTokenizer

    model, layer = hf_gpt2_lm()
    out = tmp_path / "out"
    _tokenizer().save_pretrained(out)
    (out / "notes.txt").write_text("lr 3e-4 diverged at step 900\n")
    before = _tree(out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(before)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        if how == "save_pretrained":
            m.save_pretrained(out)
        else:
            export(out, m)

    run_ranks(WORLD, fn)
    after = _tree(out)
    assert {k: after.get(k) for k in before} == before
    assert set(after) - set(before) == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
    }
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    loaded = type(model).from_pretrained(out)
    torch.testing.assert_close(loaded.state_dict(), model.state_dict(), atol=0, rtol=0)
    assert AutoTokenizer.from_pretrained(out)("w1 w5 w3").input_ids == [1, 5, 3]


def _model_files(folder: Path) -> list[str]:
    pattern = r"model(-\d{5}-of-\d{5})?\.safetensors(\.index\.json)?"
    return sorted(p.name for p in folder.iterdir() if re.fullmatch(pattern, p.name))


def _exported(folder: Path) -> dict[str, Tensor]:
    """Every tensor of an export, from its index's files or its one file."""
    files = _model_files(folder)
    state: dict[str, Tensor] = {}
    for name in files:
        if name.endswith(".safetensors"):
            state |= load_file(folder / name)
    return dict(sorted(state.items()))


def test_a_second_export_replaces_only_the_model_files(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = GPT()
    expected = dict(sorted(model.state_dict().items()))
    out = tmp_path / "out"
    out.mkdir()
    mine = {
        "notes.txt": b"mine\n",
        "model-notes.txt": b"named like the model, not a weight file\n",
        "pytorch_model-00001-of-00002.bin": b"another tool's shard, not shardwrap's\n",
        "tokenizer.json": b"{}\n",
    }
    for name, data in mine.items():
        (out / name).write_bytes(data)
    counts: list[int] = []

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        for size in ("20KB", "60KB", "5GB", "20KB"):
            export(out, m, max_shard_size=size)
            pg.barrier().wait()  # every rank sees this export's files before the next
            if rank == 0:
                files = _model_files(out)
                counts.append(len(files))
                tree = _tree(out)
                assert {k: tree[k] for k in mine} == mine
                assert set(tree) == set(mine) | set(files)
                torch.testing.assert_close(_exported(out), expected, atol=0, rtol=0)
            pg.barrier().wait()

    run_ranks(WORLD, fn)
    # sharded, fewer shards, one file and no index, sharded again: each time only its files
    assert counts[0] > counts[1] > 2 and counts[2] == 1 and counts[3] == counts[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _checkpoint_and_run_folders(tmp_path: Path) -> dict[str, Path]:
    """A checkpoint, the folder holding it with its ``latest`` pointer, a Logbook's run."""
    torch.manual_seed(0)
    model = GPT()

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        save_checkpoint(tmp_path / "ckpt" / "step-1", m, opt, step=1)
        Logbook(tmp_path / "run", m, opt, save_every=0, plot_every=None).close()

    run_ranks(WORLD, fn)
    return {
        "checkpoint": tmp_path / "ckpt" / "step-1",
        "checkpoints": tmp_path / "ckpt",
        "run": tmp_path / "run",
    }


REFUSED = {
    "checkpoint": r"holds a shardwrap checkpoint \(metadata\.json\)",
    "checkpoints": r"holds a 'latest' pointer to checkpoints; checkpoints 'step-1'",
    "run": r"holds a Logbook's run \(logbook\.jsonl\)",
}


@pytest.mark.parametrize("how", ["save_pretrained", "export"])
def test_a_folder_of_checkpoints_or_a_run_is_refused_for_an_export(
    tmp_path: Path, how: str
) -> None:
    folders = _checkpoint_and_run_folders(tmp_path)
    model, layer = hf_gpt2_lm()
    before = _tree(tmp_path)

    def fn(rank: int, pg: ProcessGroup) -> None:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=layer, process_group=pg)
        for kind, folder in folders.items():
            with pytest.raises(ValueError) as error:
                m.save_pretrained(folder) if how == "save_pretrained" else export(folder, m)
            message = str(error.value)
            assert message.startswith(f"{how}: {folder} ")
            assert re.search(REFUSED[kind], message), message
            assert "Export into another folder" in message

    run_ranks(WORLD, fn)
    assert _tree(tmp_path) == before


def test_save_checkpoint_refuses_a_folder_it_would_lose(tmp_path: Path) -> None:
    folders = _checkpoint_and_run_folders(tmp_path)
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine\n")
    (tmp_path / "a-file").write_text("mine\n")
    with_notes = tmp_path / "ckpt" / "step-2"
    torch.manual_seed(0)
    model = GPT()
    refused = {
        user: r"is not a shardwrap checkpoint: it holds 'notes\.txt', which replacing it "
        r"would delete\. Save to a folder path that does not exist yet$",
        folders["checkpoints"]: r"is not a shardwrap checkpoint: it holds a 'latest' pointer "
        r"to checkpoints; checkpoints 'step-1', .*e\.g\. .*ckpt/step-000100$",
        folders["run"]: r"is not a shardwrap checkpoint: it holds a Logbook's run",
        tmp_path / "a-file": r"is a file, not a checkpoint folder",
        with_notes: r"is a checkpoint that also holds 'notes\.txt', which it did not write",
    }

    def fn(rank: int, pg: ProcessGroup) -> dict[str, Any]:
        m = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        save_checkpoint(with_notes, m, opt, step=2)
        pg.barrier().wait()
        if rank == 0:
            (with_notes / "notes.txt").write_text("mine\n")
        pg.barrier().wait()
        before = _tree(tmp_path)
        for folder, match in refused.items():
            with pytest.raises(ValueError, match=match) as error:
                save_checkpoint(folder, m, opt, step=3)
            assert str(error.value).startswith(f"save_checkpoint: {folder} ")
        assert _tree(tmp_path) == before
        pg.barrier().wait()
        (tmp_path / "empty").mkdir(exist_ok=True)
        save_checkpoint(tmp_path / "empty", m, opt, step=4)  # nothing there to lose
        save_checkpoint(folders["checkpoint"], m, opt, step=5)  # a checkpoint is replaced
        fresh = ShardedModule(copy.deepcopy(model), auto_wrap=Block, process_group=pg)
        return {
            "empty": load_checkpoint(tmp_path / "empty", fresh),
            "replaced": load_checkpoint(folders["checkpoint"], fresh),
        }

    assert run_ranks(WORLD, fn) == [{"empty": {"step": 4}, "replaced": {"step": 5}}] * WORLD


def test_plain_model_without_config_keeps_a_users_config(tmp_path: Path) -> None:
    """A model that is not ``transformers``' writes no ``config.json``: the user's stays."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')

    def fn(rank: int, pg: ProcessGroup) -> None:
        export(out, ShardedModule(copy.deepcopy(model), process_group=pg))

    run_ranks(WORLD, fn)
    assert (out / "config.json").read_text() == '{"mine": true}\n'
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
