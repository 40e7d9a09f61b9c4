"""A checkpoint save SIGKILLed half-way, in a process of its own, leaves the previous checkpoint
whole and loadable: the atomic save of ``tests/checkpoint/test_checkpoint.py`` under a real kill
(``tests/e2e/scripts/checkpoint_killed.py``). An interpreter that exits while a non-blocking save
writes completes it first (``tests/e2e/scripts/checkpoint_at_exit.py``).

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest -m process tests/e2e/test_checkpoint.py``
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import shardwrap
from shardwrap import ShardedModule, load_checkpoint
from tests.support.launch import ROOT
from tests.support.models import GPT, Block


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _assert_close(got: dict[str, Tensor], expected: dict[str, Tensor], atol: float = 0.0) -> None:
    assert list(got) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(got[key], value, atol=atol, rtol=0.0, msg=key)


@pytest.mark.process
def test_save_killed_mid_write_leaves_previous_checkpoint_loadable(tmp_path: Path) -> None:
    """A real process, SIGKILLed while its second save is half written."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "e2e" / "scripts" / "checkpoint_killed.py"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.strip() == "writing":
                break
        else:
            pytest.fail(f"the script ended early:\n{proc.stderr.read() if proc.stderr else ''}")
        partial = tmp_path / ".step-2.partial"
        assert any(f.stat().st_size > 0 for f in partial.iterdir())  # half written, not complete
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert shardwrap.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    assert not (tmp_path / "step-2").exists()
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    torch.manual_seed(5)
    m = ShardedModule(GPT(width=96, depth=4), auto_wrap=Block)
    assert load_checkpoint(tmp_path, m, _sgd(m.parameters())) == {"step": 1}
    _assert_close(m.full_state_dict(), expected)


@pytest.mark.process
def test_interpreter_exit_waits_for_a_background_save(tmp_path: Path) -> None:
    """The main thread ends while a non-blocking save still writes: the exit completes it."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    script = ROOT / "tests" / "e2e" / "scripts" / "checkpoint_at_exit.py"
    proc = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "pending", proc.stdout + proc.stderr
    assert shardwrap.latest_checkpoint(tmp_path) == tmp_path / "step-1"
    torch.manual_seed(0)
    m = ShardedModule(GPT(width=48, depth=2), auto_wrap=Block)
    assert load_checkpoint(tmp_path, m) == {"step": 1}
    _assert_close(m.full_state_dict(), torch.load(tmp_path / "expected.pt", weights_only=True))
