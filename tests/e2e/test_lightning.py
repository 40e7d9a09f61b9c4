"""Lightning's ``Trainer`` with ``strategy="shardwrap"`` trains one ``LightningModule`` as with
Lightning's own DDP strategy, and resumes from a ``ModelCheckpoint`` at another world size
(``tests/e2e/scripts/lightning_parity.py``, two launches under torchrun).

- at 2 ranks, fp32, stages 1, 2 and 3: every step's global loss, over two epochs of 4 steps,
  equals DDP's (bit for bit, measured; asserted within 1e-6);
- ``gradient_clip_val``, ``accumulate_grad_batches`` and ``precision="bf16-mixed"`` take
  effect (the losses differ from the fp32 run's without them) and equal DDP's with them;
- the trained model validated by a new ``Trainer`` has DDP's validation loss;
- ``ModelCheckpoint`` writes one folder per epoch: a shardwrap checkpoint (every rank's
  pieces) and Lightning's own state; resumed from the first at 1 rank, the second epoch's losses
  are the 2-rank run's (within 1e-5: the global batch's gradient summed in another order).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_lightning.py``
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import torchrun

SCRIPT = "tests/e2e/scripts/lightning_parity.py"
STEPS = 8  # two epochs of 4


@pytest.mark.process
def test_trainer_matches_ddp_and_resumes_from_a_checkpoint_at_another_world_size(
    tmp_path: Path,
) -> None:
    torchrun(SCRIPT, "train", str(tmp_path / "train.json"), str(tmp_path))
    got = json.loads((tmp_path / "train.json").read_text())
    assert got["strategy"] == "ShardwrapStrategy"  # strategy="shardwrap" found by name
    for name in ("1", "2", "3", "clip", "accumulate", "bf16-mixed"):
        ddp, sharded = got[f"ddp-{name}"], got[f"shardwrap-{name}"]
        assert len(sharded) == STEPS, name
        assert sharded == pytest.approx(ddp, abs=1e-6, rel=0), name
    for name in ("clip", "accumulate", "bf16-mixed"):  # each changed the training
        assert max(abs(a - b) for a, b in zip(got[f"shardwrap-{name}"], got["ddp-3"])) > 1e-3, name
    ddp_validated, validated = got["validated"]  # a new Trainer reuses the sharded model
    assert validated == pytest.approx(ddp_validated, abs=1e-6, rel=0)
    folders = {f.split("/")[0] for f in got["checkpoints"]}
    assert folders == {"epoch=0-step=4.ckpt", "epoch=1-step=8.ckpt"}
    for folder in folders:
        assert {
            f"{folder}/lightning.pt",
            f"{folder}/shardwrap/metadata.json",
            f"{folder}/shardwrap/rank-00000-of-00002.safetensors",
            f"{folder}/shardwrap/rank-00001-of-00002.safetensors",
        } <= set(got["checkpoints"])

    torchrun(SCRIPT, "resume", str(tmp_path / "resume.json"), str(tmp_path), nproc=1)
    resumed = json.loads((tmp_path / "resume.json").read_text())["resumed"]
    assert resumed == pytest.approx(got["shardwrap-3"][STEPS // 2 :], abs=1e-5, rel=0)
