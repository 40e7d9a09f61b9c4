"""Scripts of this checkout in fresh processes under ``torchrun``, as the process and fault tiers
run them: from the checkout's root, which is importable (``shardwrap``, ``examples``,
``tests``), one thread per process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def launch(
    script: str, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` (a free port each time), however it ends."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240) -> None:
    """Run ``script`` under ``torchrun``; fail on error."""
    proc = launch(script, *args, nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"
