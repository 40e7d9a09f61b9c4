"""Process tier: 2-D parallelism under a real ``torchrun`` launch, one process per rank.

``examples/train_gpt_tp.py`` at 4 ranks as dp=2 x tp=2 (``init_device_mesh`` over the default
group, as users build it): ``parallelize_module`` then ``ShardedModule`` over the mesh trains a
few steps with clipping over both axes, and ``export`` writes the whole model, which the plain
GPT loads with its own shapes. Run: ``pytest -m process tests/e2e/test_tensor_parallel.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from examples.train_gpt import GPT
from tests.support.launch import torchrun


@pytest.mark.process
def test_the_2d_example_trains_and_exports_the_whole_model(tmp_path: Path) -> None:
    size = {"--width": "32", "--depth": "1", "--heads": "2", "--context": "16"}
    args = [a for kv in size.items() for a in kv]
    out = tmp_path / "model"
    torchrun(
        "examples/train_gpt_tp.py",
        *("--tp", "2", "--steps", "3", "--batch", "2", "--out", str(out), *args),
        nproc=4,
    )
    model = GPT(width=32, depth=1, heads=2, context=16)
    model.load_state_dict(load_file(out / "model.safetensors"))  # whole shapes, every key
