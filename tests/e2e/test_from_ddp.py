"""Process tier: a DDP script adopts shardwrap by its wrap line; each trap works or is refused.

``tests/e2e/scripts/ddp_style.py``, in the shape of nanoGPT's ``train.py``, runs under
``torchrun`` on 2 ranks with DDP, then with shardwrap (only the wrap line differs). Proves:

- as the DDP script is (a seed per rank, ``raw_model = model.module``, gradient accumulation
  with ``require_backward_grad_sync``, evaluation and saving on the master rank alone), shardwrap
  stops it at the master's evaluation, on both ranks, naming ``if master_process:`` and
  docs/ddp.md; with evaluation on every rank (docs/ddp.md's first change) it stops at the
  master's ``torch.save(checkpoint, ...)`` of ``raw_model.state_dict()``, naming
  ``full_state_dict`` and ``full_optimizer_state_dict``;
- with both changes it trains exactly as DDP does: the same loss at every iteration, rank 0's
  weights copied over the other rank's seed, ``model.module`` the model, one reduction per
  iteration (none in the micro-batches before the last), and a ``ckpt.pt`` whose model and
  optimizer states equal DDP's, key for key.

And ``tests/e2e/scripts/accelerate_no_trainer.py``, the loop of transformers'
``run_clm_no_trainer.py`` on a sharded Llama: without ``ACCELERATE_USE_CPU=1`` (accelerate then
sees one process) ``prepare`` refuses on both ranks, naming it; with it the run ends with the
example's ``save_pretrained(..., save_function=accelerator.save)``, which writes the trained
model.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_from_ddp.py``
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import transformers

from tests.support.launch import launch, torchrun

SCRIPT = "tests/e2e/scripts/ddp_style.py"


def _failure(out: Path, *args: str) -> str:
    proc = launch(SCRIPT, str(out), "shardwrap", *args)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    return output


@pytest.mark.process
def test_a_ddp_script_stops_at_each_line_to_change_then_trains_as_ddp(tmp_path: Path) -> None:
    ddp, sharded = tmp_path / "ddp", tmp_path / "shardwrap"
    for folder in (ddp, sharded, tmp_path / "as is", tmp_path / "eval"):
        folder.mkdir()

    # the DDP script as it is: the master's evaluation is where both ranks stop
    output = _failure(tmp_path / "as is")
    for rank in (0, 1):
        assert f"[rank{rank}]: RuntimeError: shardwrap: ranks are at different steps" in output
    assert re.search(r"\[rank0\]:\s+File .*ddp_style.py\", line \d+, in estimate_loss", output)
    assert "for a forward without grad" in output
    assert "if master_process:" in output and "docs/ddp.md" in output
    # evaluated on every rank: the master's save of raw_model.state_dict() is where it stops
    output = _failure(tmp_path / "eval", "eval")
    assert re.search(r"\[rank0\]:\s+torch.save\(checkpoint, out_dir / \"ckpt.pt\"\)", output)
    assert "[rank0]: TypeError: shardwrap: saving this rank's piece" in output
    assert "model.full_state_dict(rank0_only=True)" in output
    assert "shardwrap.full_optimizer_state_dict(model, optimizer" in output

    torchrun(SCRIPT, str(ddp), "ddp")
    proc = launch(SCRIPT, str(sharded), "shardwrap", "eval,save")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "rank 0's were copied to every rank" in proc.stderr  # the seed per rank
    want = json.loads((ddp / "result.json").read_text())
    got = json.loads((sharded / "result.json").read_text())
    assert not want["raw_model_is_model"] and got["raw_model_is_model"]
    torch.testing.assert_close(got["losses"], want["losses"], atol=1e-6, rtol=0)
    # require_backward_grad_sync: a reduction at each iteration's last micro-batch only
    assert got["reduced"][0::2] == [0] * len(want["losses"])
    assert all(n > 0 for n in got["reduced"][1::2])

    saved, reference = (torch.load(f / "ckpt.pt", weights_only=True) for f in (sharded, ddp))
    assert saved["iter_num"] == reference["iter_num"] == 6
    assert list(saved["model"]) == list(reference["model"])
    torch.testing.assert_close(saved["model"], reference["model"], atol=1e-6, rtol=0)
    torch.testing.assert_close(saved["optimizer"], reference["optimizer"], atol=1e-6, rtol=0)


@pytest.mark.process
def test_accelerate_example_is_refused_without_its_processes_then_saves_its_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = "tests/e2e/scripts/accelerate_no_trainer.py"
    monkeypatch.delenv("ACCELERATE_USE_CPU", raising=False)
    proc = launch(script, str(tmp_path))
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-3000:]
    for rank in (0, 1):
        assert f"[rank{rank}]: ValueError: accelerate sees one process" in output
    assert "ACCELERATE_USE_CPU=1" in output and "Accelerator(cpu=True)" in output
    assert not (tmp_path / "model").exists()

    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    torchrun(script, str(tmp_path))
    trained = torch.load(tmp_path / "trained.pt", weights_only=True)
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(loaded.state_dict(), trained, atol=0, rtol=0)
