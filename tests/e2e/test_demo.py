"""The demo, ``examples/train_gpt.py``, end to end under ``torchrun``.

Proves that the example trains on a ``--data`` folder with two ranks and that its Logbook
keeps the run folder: one logbook line per step with the samples each rank drew, the plots,
checkpoints, the exported model, a summary and a sample, and that a finished run rewound to an
earlier checkpoint and resumed by hand (``--resume``) repeats its steps exactly. Fault tier: a
rank SIGKILLed under ``torchrun --max-restarts=1``, after which torchrun restarts both ranks and
the demo, with no ``--name``, resumes its own run from its latest checkpoint and ends with
exactly the losses of the same run left alone. A tiny configuration keeps each to seconds;
``make demo`` is the real run. The run's default name, in process: ``tests/test_demo.py``.
Run: ``pytest -m "process or faults" tests/e2e/test_demo.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shardwrap
from shardwrap.runs.runlog import read
from tests.support.launch import ROOT, launch

TINY = ("--batch", "2", "--context", "16", "--width", "16", "--depth", "2", "--heads", "2")

STEPS = 6


@pytest.mark.process
def test_demo_keeps_a_logbook(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "sub").mkdir(parents=True)
    (data / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    (data / "sub" / "b.py").write_text("def f(x):\n    return x + 1\n" * 40)
    common = (*TINY, "--sample-bytes", "8", "--name", "smoke", "--save-every", "3")
    common += ("--data", str(data), "--out-dir", str(tmp_path))
    proc = launch("examples/train_gpt.py", "--steps", str(STEPS), *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "sample (temperature 0.8, top-20):" in proc.stdout
    assert "loss, mean of last 10" in proc.stdout

    run = tmp_path / "smoke"
    book = read(run)
    assert [s["step"] for s in book.steps] == list(range(1, STEPS + 1))
    assert all(len(s["samples"]) == 2 and len(s["samples"][0]) == 2 for s in book.steps)
    assert [e["event"] for e in book.events] == ["started"] + ["checkpoint"] * 3
    for png in ("loss.png", "system.png"):
        assert (run / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step-{STEPS:08d}"
    assert (run / "model" / "model.safetensors").is_file()


def _children(parent: int) -> list[int]:
    """The pids whose parent is ``parent`` (Linux ``/proc``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:  # ended meanwhile
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == parent:
                found.append(int(entry.name))
    return found


def _rank_pid(agent: int, rank: int) -> int | None:
    """The pid of the worker that torchrun's agent ``agent`` runs as ``rank``, if it runs one."""
    for pid in _children(agent):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    return None


@pytest.mark.faults
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank in /proc")
def test_a_restarted_demo_resumes_its_own_run(tmp_path: Path) -> None:
    steps, save_every = 40, 3
    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    common = (*TINY, "--steps", str(steps), "--save-every", str(save_every))
    common += ("--sample-bytes", "4", "--data", str(data))
    whole = launch("examples/train_gpt.py", *common, "--out-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr

    # The launch line docs/operations.md gives for restarts, with no --name.
    out = tmp_path / "restarted"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += ["--max-restarts=1", "examples/train_gpt.py", *common, "--out-dir", str(out)]
    with subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as agent:
        try:
            # Kill rank 1 once the run has a checkpoint past its initial weights.
            deadline = time.monotonic() + 120
            while not list(out.glob(f"*/checkpoints/step-{save_every:08d}/metadata.json")):
                assert agent.poll() is None and time.monotonic() < deadline, agent.stdout.read()
                time.sleep(0.01)
            victim = _rank_pid(agent.pid, 1)
            assert victim is not None
            os.kill(victim, signal.SIGKILL)
            output, _ = agent.communicate(timeout=180)
        finally:
            agent.kill()
    assert agent.returncode == 0, output[-5000:]
    assert "torchrun restart 1 of at most 1; a restart resumes it" in output, output[-5000:]

    (run,) = out.iterdir()  # one run folder: the restart found its own
    assert run.name.startswith("gpt-")
    book = read(run)
    (resumed,) = [e for e in book.events if e["event"] == "resumed"]
    assert save_every <= resumed["step"] < steps  # from a checkpoint saved before the kill
    assert resumed["checkpoint"] == f"step-{resumed['step']:08d}"
    (reference,) = [read(folder) for folder in (tmp_path / "whole").iterdir()]
    assert [s["step"] for s in book.steps] == list(range(1, steps + 1))
    assert [s["loss"] for s in book.steps] == [s["loss"] for s in reference.steps]
    assert [s["samples"] for s in book.steps] == [s["samples"] for s in reference.steps]
    assert (run / "model" / "model.safetensors").is_file()


@pytest.mark.process
def test_demo_resumes_from_its_latest_checkpoint(tmp_path: Path) -> None:
    """Rewind a finished run to its step-3 checkpoint and resume: steps 4-6 repeat exactly."""
    from shardwrap.runs.runlog import read
    from tests.support.launch import torchrun

    data = tmp_path / "data.txt"
    data.write_text("the quick brown fox jumps over the lazy dog\n" * 40)
    tiny = "--steps 6 --batch 2 --context 16 --width 16 --depth 2 --heads 2 --sample-bytes 4"
    args = [*tiny.split(), "--data", str(data), "--out-dir", str(tmp_path)]
    args += ["--save-every", "3", "--name", "run"]
    torchrun("examples/train_gpt.py", *args)
    run = tmp_path / "run"
    checkpoints = run / "checkpoints"
    assert shardwrap.latest_checkpoint(checkpoints) == checkpoints / "step-00000006"
    assert (run / "model" / "model.safetensors").is_file()
    (checkpoints / "latest").write_text("step-00000003\n")
    torchrun("examples/train_gpt.py", *args, "--resume")
    book = read(run)  # the first run's steps 4-6 are abandoned by the resume
    assert [e["event"] for e in book.events if e["event"] != "checkpoint"] == [
        "started",
        "resumed",
    ]
    (abandoned,) = book.abandoned
    assert [s["step"] for s in abandoned] == [4, 5, 6]
    assert [s["loss"] for s in abandoned] == [s["loss"] for s in book.steps[3:]]
    assert [s["samples"] for s in abandoned] == [s["samples"] for s in book.steps[3:]]
