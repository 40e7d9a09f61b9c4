"""Checkpoints edited by hand, consistently (sizes and checksums recomputed), so that only what a
tensor is stored as gives them away.

Proves, at 2 ranks, that every tensor a load reads is checked against the shape and dtype the
model or the optimizer's rule expects, from the file's header alone, before any memory is taken
for it and before anything changes, the error naming the file, the tensor, both shapes and the
fix:

- Muon's momentum and Adafactor's row variance stored at 4096 x 4096 for a 16 x 16 weight, in a
  sparse file (64 MiB of zeros that pass their checksum), are refused by the optimizer's rule
  (Muon's state is the matrix's shape; Adafactor's row variance is ``(rows, 1)``);
- a buffer stored as ``(1,)`` or ``(17,)`` for a ``(16,)`` buffer is refused (``(1,)`` used to
  be broadcast silently, ``(17,)`` to fail half-way through, after the parameters were written);
- a parameter's piece stored as integers is refused.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/checkpoint/test_checkpoint_crafted.py``
"""

from __future__ import annotations

import copy
import json
import math
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule, load_checkpoint, save_checkpoint
from shardwrap.checkpoint.checksum import tensor_checksum
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.stage3  # files on disk: the stage plays no part

WIDTH = 16
HUGE = (4096, 4096)  # 64 MiB of float32, for a 16 x 16 weight


class Net(nn.Module):
    """Two matrices, a bias and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(WIDTH, WIDTH)
        self.second = nn.Linear(WIDTH, WIDTH, bias=False)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, WIDTH))

    def forward(self, x: Tensor) -> Tensor:
        return self.second(torch.tanh(self.first(x))) * self.scale


def _muon(params: Any) -> list[torch.optim.Optimizer]:
    params = list(params)
    return [
        torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2),
        torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2),
    ]


def _adafactor(params: Any) -> list[torch.optim.Optimizer]:
    return [torch.optim.Adafactor(params, lr=1e-2)]


OPTIMIZERS: dict[str, tuple[Callable[[Any], list[torch.optim.Optimizer]], str]] = {
    "muon": (_muon, "momentum_buffer"),
    "adafactor": (_adafactor, "row_var"),
}

torch.manual_seed(0)
MODEL = Net()


def _wrap(pg: ProcessGroup) -> ShardedModule:
    return ShardedModule(copy.deepcopy(MODEL), auto_wrap=nn.Linear, process_group=pg)


def _save(folder: Path, make: Callable[[Any], list[torch.optim.Optimizer]]) -> None:
    def fn(rank: int, pg: ProcessGroup) -> None:
        m = _wrap(pg)
        opts = make(m.parameters())
        x = torch.randn(4, WIDTH, generator=torch.Generator().manual_seed(rank))
        m(x).square().mean().backward()
        for o in opts:
            o.step()
        save_checkpoint(folder, m, opts, step=1)

    run_ranks(2, fn)


def _refused(folder: Path, make: Callable[[Any], list[torch.optim.Optimizer]], *said: str) -> None:
    """A load at 2 ranks raises on both, the rank that met the problem naming it all, and leaves
    the model and the optimizers as they were."""

    def fn(rank: int, pg: ProcessGroup) -> str:
        m = _wrap(pg)
        opts = make(m.parameters())
        before = {k: v.clone() for k, v in m.full_state_dict().items()}
        before["scale"] = m.scale.clone()
        with pytest.raises((ValueError, RuntimeError)) as info:
            load_checkpoint(folder, m, opts)
        after = {**m.full_state_dict(), "scale": m.scale}
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert all(not o.state for o in opts)
        return str(info.value)

    errors = run_ranks(2, fn)
    named = [e for e in errors if all(s in e for s in said)]
    assert named, errors
    assert all(e in named or "failed on rank(s)" in e for e in errors), errors


# editing a checkpoint consistently ---------------------------------------------------------


def _metadata(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "metadata.json").read_text())


def _write_metadata(folder: Path, meta: dict[str, Any]) -> None:
    (folder / "metadata.json").write_text(json.dumps(meta))


def _replace(folder: Path, file: str, key: str, value: Tensor) -> None:
    """Store ``value`` as ``key`` of ``file``, its size and checksum recorded in the metadata."""
    tensors = load_file(folder / file)
    tensors[key] = value
    save_file(tensors, folder / file, metadata={"format": "pt"})
    meta = _metadata(folder)
    meta["files"][file] = (folder / file).stat().st_size
    name = {torch.float32: "F32", torch.int32: "I32"}[value.dtype]
    meta["checksums"]["tensors"][file][key] = [name, tensor_checksum(value.contiguous())]
    _write_metadata(folder, meta)


def _sparse(folder: Path, file: str, key: str, shape: tuple[int, ...]) -> None:
    """Store ``key`` of ``file`` as float32 zeros of ``shape`` without writing them (a hole in
    a sparse file), recorded in the metadata as a whole-stepped state of that shape."""
    path = folder / file
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    data = raw[8 + length :]
    order = sorted(
        (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
    )
    out: dict[str, Any] = {"__metadata__": header["__metadata__"]}
    at = 0
    for k in order:
        a, b = header[k]["data_offsets"]
        n = math.prod(shape) * 4 if k == key else b - a
        out[k] = {**header[k], "data_offsets": [at, at + n]}
        if k == key:
            out[k]["shape"] = list(shape)
        at += n
    head = json.dumps(out).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for k in order:
            a, b = out[k]["data_offsets"]
            if k == key:
                f.seek(b - a, 1)
            else:
                f.write(data[header[k]["data_offsets"][0] : header[k]["data_offsets"][1]])
        f.truncate(f.tell())
    meta = _metadata(folder)
    meta["files"][file] = path.stat().st_size
    meta["checksums"]["tensors"][file][key] = ["F32", "0" * 32]  # zeros: both sums stay 0
    name = key.split("/")[-1]
    meta["optimizer"]["whole_state"][name][key.split("/")[1]]["shape"] = list(shape)
    _write_metadata(folder, meta)


# the cases -----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_whole_stepped_state_of_a_shape_the_optimizer_never_makes_is_refused(
    tmp_path: Path, name: str
) -> None:
    make, key = OPTIMIZERS[name]
    folder = tmp_path / "ckpt"
    _save(folder, make)
    at = _metadata(folder)["optimizer"]["whole_state"]["second.weight"][key]
    _sparse(folder, at["file"], f"optim/{key}/second.weight", HUGE)
    assert (folder / at["file"]).stat().st_blocks * 512 < (folder / at["file"]).stat().st_size
    want = "(16, 16)" if name == "muon" else "(16, 1)"
    _refused(folder, make, "metadata.json", f"'{key}' of 'second.weight'", str(HUGE), want)


@pytest.mark.parametrize("stored", [(1,), (WIDTH + 1,)], ids=["broadcast", "longer"])
def test_a_buffer_stored_at_another_shape_is_refused(tmp_path: Path, stored: tuple[int]) -> None:
    folder = tmp_path / "ckpt"
    _save(folder, _adafactor)
    _replace(folder, "buffers.safetensors", "scale", torch.full(stored, 7.0))
    _refused(folder, _adafactor, "buffers.safetensors", "'scale'", str(stored), f"({WIDTH},)")


def test_a_parameter_stored_as_integers_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    _save(folder, _adafactor)
    file, key = "rank-00001-of-00002.safetensors", "model/first.weight"
    stored = load_file(folder / file)[key]
    _replace(folder, file, key, stored.round().to(torch.int32))
    _refused(folder, _adafactor, file, f"'{key}'", "I32", "float32")
