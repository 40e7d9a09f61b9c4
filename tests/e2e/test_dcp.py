"""Process tier: ``torch.distributed.checkpoint`` (DCP) saves and loads a sharded model exactly,
at every stage and tier, from and to FSDP2, at another world size. DCP needs the default
process group, so these run under ``torchrun``; what DCP is handed is tested in process
(``tests/checkpoint/test_dcp.py``).

``tests/e2e/scripts/dcp_round_trip.py`` (2 ranks) proves, for stages 1, 2 and 3, the disk
tier, AdamW, Muon with AdamW and Adafactor, saved with ``dcp.save``, ``dcp.async_save`` (both
of its stagers) and with the model given to DCP as it is: the loaded model and optimizer
state equal the state at the save, the resumed run's losses and final state equal the
uninterrupted run's (0 difference), and ``dcp_to_torch_save`` of the save equals
``full_state_dict()``. A shardwrap checkpoint converts to DCP (``load_checkpoint`` then
``dcp.save``) and back (``dcp.load`` then ``save_checkpoint``) exactly. DCP given
``model.state_dict()``'s pieces refuses them: by name to save and to stage, on its own size
check to load into.

``tests/e2e/scripts/dcp_reshard.py`` (saved at 2 ranks, loaded at 3) proves: FSDP2's checkpoint
loads into shardwrap and shardwrap's into FSDP2 (AdamW), and shardwrap's of Muon and of
Adafactor into shardwrap, each equal to the saver's whole state, and each trains on as the
same framework loaded from that whole state does, bit for bit.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_dcp.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import torchrun


@pytest.mark.process
def test_dcp_saves_and_loads_exactly_at_every_stage_and_tier(tmp_path: Path) -> None:
    torchrun("tests/e2e/scripts/dcp_round_trip.py", str(tmp_path), nproc=2, timeout=400)
    result = json.loads((tmp_path / "result.json").read_text())
    assert len(result["cases"]) == 10
    for case, distances in result["cases"].items():
        assert distances == dict.fromkeys(distances, 0.0), case
        assert set(distances) == {"loaded", "losses", "resumed", "dcp_to_torch_save"}, case
    assert result["converted"] == {"to_dcp": 0.0, "back": 0.0}
    saved, staged = result["refused"]["save"], result["refused"]["async_save_writer"]
    assert "torch.distributed.checkpoint was given this rank's piece" in saved
    assert "copies it into a plain tensor" in staged
    assert all("get_model_state_dict(model)" in said for said in (saved, staged))
    assert "Size mismatch between saved torch.Size([67, 36])" in result["refused"]["load"]


@pytest.mark.process
def test_dcp_checkpoints_move_between_fsdp2_and_shardwrap_and_world_sizes(tmp_path: Path) -> None:
    script = "tests/e2e/scripts/dcp_reshard.py"
    torchrun(script, "save", str(tmp_path), nproc=2, timeout=400)
    torchrun(script, "load", str(tmp_path), nproc=3, timeout=400)
    result = json.loads((tmp_path / "result.json").read_text())
    assert list(result) == [
        "fsdp2 -> shardwrap",
        "shardwrap -> fsdp2",
        "shardwrap-muon -> shardwrap",
        "shardwrap-adafactor -> shardwrap",
    ]
    for pair, distances in result.items():
        assert distances == {"loaded": 0.0, "losses": 0.0, "trained": 0.0}, pair
