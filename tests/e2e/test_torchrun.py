"""Process tier: shardwrap under a real ``torchrun`` launch, one process per rank.

Proves that the default process group, gloo between processes and the launcher's
environment work end to end, with parameter parity against a plain model trained on the
whole global batch, at stages 2 and 3, hybrid sharding over a 2 x 2 ``DeviceMesh``, and the
shape-aware optimizers Muon and Adafactor (against gradient accumulation over the slices), and
compressed communication (int8 gathers and reductions, each step checked against the formats'
bounds in the ranks themselves, ``tests/support/compression.py``). Run:
``pytest -m process tests/e2e/test_torchrun.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import torchrun


@pytest.mark.process
@pytest.mark.parametrize(
    ("nproc", "wrap"),
    [
        (2, {}),
        (4, {}),
        (2, {"compile": True, "checkpoint_activations": True}),  # inductor, real compiler
        (2, {"stage": 2}),
        (4, {"hybrid": [2, 2], "stage": 1}),
        (4, {"hybrid": [2, 2]}),
        (2, {"optimizer": "muon"}),
        (4, {"optimizer": "adafactor", "stage": 2}),
    ],
    ids=[
        "2",
        "4",
        "2-compiled-checkpointed",
        "2-stage2",
        "2x2-stage1",
        "2x2-stage3",
        "2-muon",
        "4-adafactor-stage2",
    ],
)
def test_parity_under_torchrun(tmp_path: Path, nproc: int, wrap: dict) -> None:
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/torchrun_parity.py", str(out), json.dumps(wrap), nproc=nproc)
    result = json.loads(out.read_text())
    assert result["world_size"] == nproc
    assert result["keys_match"]
    assert result["max_param_diff"] < (1e-4 if wrap.get("optimizer") == "muon" else 1e-5)
    for loss, ref in zip(result["losses"], result["reference_losses"]):
        assert loss == pytest.approx(ref, abs=1e-5)
    if "hybrid" in wrap:
        assert 'dimensions ("replicate", "shard"), got 2-D with names' in result["refused"]


@pytest.mark.process
def test_compressed_training_under_torchrun(tmp_path: Path) -> None:
    # every step is checked in the ranks themselves (tests/support/compression.py)
    out = tmp_path / "result.json"
    torchrun("tests/e2e/scripts/torchrun_compression.py", str(out), nproc=2)
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    packed, exact = result["bytes"]["int8"], result["bytes"]["exact"]
    for kind in ("all_gather", "reduce_scatter"):
        assert 0.25 * exact[kind] < packed[kind] < 0.27 * exact[kind]
