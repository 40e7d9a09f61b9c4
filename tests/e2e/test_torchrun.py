"""Process tier: shardwrap under a real ``torchrun`` launch, one process per rank.

Proves that the default process group, gloo between processes and the launcher's
environment work end to end, with parameter parity against a plain model trained on the
whole global batch, at stages 2 and 3, hybrid sharding over a 2 x 2 ``DeviceMesh``, and the
shape-aware optimizers Muon and Adafactor (against gradient accumulation over the slices), and
compressed communication (int8 gathers and reductions, each step checked against the formats'
bounds in the ranks themselves, ``tests/support/compression.py``), ``torch.compile(model)`` of
the wrapped model (its hooks outside the graphs), and a compiled training step (forward and
``loss.backward()`` in one compiled function, the backward hooks kept out of it too). The
parity cases with the same number of ranks share one launch. Run:
``pytest -m process tests/e2e/test_torchrun.py``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.launch import torchrun

# Each case by its id: its ranks and extra ShardedModule arguments (as torchrun_parity.py reads).
CASES = {
    "2": (2, {}),
    "4": (4, {}),
    "2-compiled-checkpointed": (2, {"compile": True, "checkpoint_activations": True}),  # inductor
    "2-torch-compile": (2, {"torch_compile": "aot_eager"}),  # the wrapped model, compiled
    "2-compiled-step": (2, {"compile_step": "aot_eager"}),  # forward and backward, compiled
    "2-stage2": (2, {"stage": 2}),
    "2x2-stage1": (4, {"hybrid": [2, 2], "stage": 1}),
    "2x2-stage3": (4, {"hybrid": [2, 2]}),
    "2-muon": (2, {"optimizer": "muon"}),
    "4-adafactor-stage2": (4, {"optimizer": "adafactor", "stage": 2}),
}


@pytest.mark.process
@pytest.mark.parametrize("nproc", [2, 4])
def test_parity_under_torchrun(tmp_path: Path, nproc: int) -> None:
    """The cases with ``nproc`` ranks, in one launch that runs them in turn (a launch costs more
    than a case), each checked by name."""
    ids = [i for i, (n, _) in CASES.items() if n == nproc]
    out = tmp_path / "results.json"
    wraps = json.dumps([CASES[i][1] for i in ids])
    torchrun("tests/e2e/scripts/torchrun_parity.py", str(out), wraps, nproc=nproc, timeout=400)
    results = json.loads(out.read_text())
    assert len(results) == len(ids)
    for case, result in zip(ids, results):
        wrap = CASES[case][1]
        assert result["world_size"] == nproc, case
        assert result["keys_match"], case
        bound = 1e-4 if wrap.get("optimizer") == "muon" else 1e-5
        assert result["max_param_diff"] < bound, (case, result["max_param_diff"])
        for loss, ref in zip(result["losses"], result["reference_losses"]):
            assert loss == pytest.approx(ref, abs=1e-5), case
        if "hybrid" in wrap:
            refusal = 'dimensions ("replicate", "shard"), got 2-D with names'
            assert refusal in result["refused"], case


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
