"""Scripts of this checkout in fresh processes under ``torchrun``, as the process and fault tiers
run them: from the checkout's root, which is importable (``shardwrap``, ``examples``,
``tests``), one thread per process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks._launch import end_ranks  # noqa: F401  (a launched rank's last call)

ROOT = Path(__file__).resolve().parents[2]


def _command(script: str, args: tuple[str, ...], nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        script,
        *args,
    ]


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def launch(
    script: str, *args: str, nproc: int = 2, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` (a free port each time), however it ends."""
    cmd = _command(script, args, nproc)
    return subprocess.run(
        cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def launch_bounded(
    script: str, *args: str, nproc: int = 2, timeout: float = 240
) -> tuple[subprocess.CompletedProcess[str], bool]:
    """As :func:`launch`, but past ``timeout`` seconds every process of the launch is killed,
    torchrun's ranks with it (a rank hung in a collective would otherwise outlive a killed
    torchrun, holding its device). Returns the run and whether it was cut off."""
    cmd = _command(script, args, nproc)
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # the launch's own process group, to kill whole
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        cut = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        cut = True
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), cut


def torchrun(script: str, *args: str, nproc: int = 2, timeout: float = 240) -> None:
    """Run ``script`` under ``torchrun``; fail on error."""
    proc = launch(script, *args, nproc=nproc, timeout=timeout)
    assert proc.returncode == 0, f"{script} {args} failed:\n{proc.stdout}\n{proc.stderr}"


def say(line: str) -> None:
    """Print ``line`` from a launched rank in one write, so that ranks sharing the launcher's
    stdout cannot interleave two lines into one (``print`` writes the text and its newline
    apart)."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()
