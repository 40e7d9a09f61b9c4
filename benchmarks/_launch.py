"""What every benchmark shares: the checkout it runs from, its launches in fresh processes, where
its reports go and what they record of the machine and the code.

Every measurement runs in fresh processes, so that memory high-water marks are its own: training
under ``torchrun --standalone`` (a free port each time), anything else as a plain Python child.
Each runs from the checkout's root, which it can import (``shardwrap``, ``examples``), with one
thread per process (``OMP_NUM_THREADS=1``), as the reports state. A script imports this module
from its own folder, which Python puts first on the path of ``python benchmarks/<script>.py``.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def results_dir(benchmark: str) -> Path:
    """The folder of ``benchmark``'s reports, ``benchmarks/results/<benchmark>/``, indexed in
    ``benchmarks/results/README.md``."""
    return HERE / "results" / benchmark


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))


def limited(cmd: list[str], rate: str) -> list[str]:
    """``cmd`` in a network namespace of its own whose loopback, the ranks' only link, sends at
    most ``rate`` (``tc``'s units: ``2gbit``): a token bucket of 256 KB, packets queued at most
    50 ms. Needs root (``unshare -n``); other processes' traffic does not share the link.
    """
    shape = f"tc qdisc add dev lo root tbf rate {rate} burst 256kb latency 50ms"
    return [
        "unshare",
        "-n",
        "bash",
        "-c",
        f'ip link set lo up && {shape} && exec "$@"',
        "bash",
    ] + cmd


def torchrun(
    script: str | Path,
    *args: str,
    nproc: int = 2,
    timeout: float | None = None,
    capture: bool = True,
    check: bool = False,
    rate: str | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` under ``torchrun --standalone`` on ``nproc`` ranks.

    Its output is captured, or with ``capture=False`` goes to this terminal as it comes; with
    ``check`` a failed run raises ``CalledProcessError``, and past ``timeout`` seconds any run
    raises ``TimeoutExpired``. With ``rate`` the ranks talk over a link of that rate
    (:func:`limited`).
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", str(script), *args]
    if rate is not None:
        cmd = limited(cmd, rate)
    return subprocess.run(
        cmd,
        cwd=ROOT,
        env=_env(),
        capture_output=capture,
        text=True,
        timeout=timeout,
        check=check,
    )


def torchrun_json(
    script: str | Path, *args: str, nproc: int = 2, timeout: float | None = None
) -> dict[str, Any]:
    """Run ``script *args OUT`` under :func:`torchrun`, ``OUT`` a fresh file for rank 0 to
    write its result into as JSON; return that result, or where the run failed ``{"error":
    ...}`` with the last lines of its error output. Past ``timeout`` seconds it raises
    ``TimeoutExpired``."""
    fd, name = tempfile.mkstemp(prefix=f"{Path(script).stem}-", suffix=".json")
    os.close(fd)
    out = Path(name)
    try:
        run = torchrun(script, *args, str(out), nproc=nproc, timeout=timeout)
        if run.returncode != 0:
            tail = (run.stderr or "").strip().splitlines()[-3:]
            return {"error": " / ".join(tail)}
        return json.loads(out.read_text())
    finally:
        out.unlink(missing_ok=True)


def python(script: str | Path, *args: str) -> subprocess.CompletedProcess[str]:
    """Run ``script`` in a fresh Python process, its output captured; a failure raises
    ``CalledProcessError``."""
    cmd = [sys.executable, str(script), *args]
    return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, check=True)


def run_once(
    method: str,
    config: dict[str, Any],
    nproc: int,
    timeout: float | None,
    rate: str | None = None,
) -> dict[str, Any]:
    """Train ``method`` once in ``_worker.py`` under torchrun (over a link of ``rate``, see
    :func:`limited`); return rank 0's result.

    Raises:
        RuntimeError: the run printed no result; the message holds its exit code and the end
            of its output.
        subprocess.TimeoutExpired: the run took longer than ``timeout`` seconds.
    """
    proc = torchrun(
        HERE / "_worker.py", method, json.dumps(config), nproc=nproc, timeout=timeout, rate=rate
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT ") :])
    raise RuntimeError(
        f"{method} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-12000:]}"
    )


def end_ranks() -> None:
    """Destroy this rank's default process group, its threads joined, so that the process exits
    cleanly; a launched rank's last call.

    A DDP or FSDP2 run on gloo under torch 2.13 can abort as its process exits ("terminate
    called without an active exception", exit code -6; 4 launches of 20 on the test machine): a
    gloo thread releases a finished reduction, which holds a Python object, after the interpreter
    has begun to shut down. Collecting garbage first frees the models the caller no longer
    holds, and with them their hold on the group, so that destroying it joins its threads while
    the interpreter still runs. The caller drops its own references to such models first.
    """
    gc.collect()
    dist.destroy_process_group()


def hardware() -> str:
    """The GPU's name, or ``cpu<cores>``: the part of a report's file name that says where it
    ran."""
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0).replace(" ", "-").lower()
    return f"cpu{os.cpu_count()}"


def commit() -> str:
    """The checked-out commit, for the report (``unknown`` outside a git checkout, or where
    git is not installed, as on a bare GPU machine)."""
    try:
        proc = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    return proc.stdout.strip() or "unknown"
