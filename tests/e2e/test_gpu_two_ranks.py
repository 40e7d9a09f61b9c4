"""Two ranks on the one GPU (``torchrun --nproc_per_node=2``, both ranks on ``cuda:0``): what
each backend does with CUDA tensors there, and shardwrap over what it does.

A single GPU is all a GPU check gets here, and two ranks are where gathers, reductions and
buckets move data between ranks. NCCL refuses two ranks on one device (its communicator
checks for a duplicate GPU); gloo moves CUDA tensors for some operations through host memory
and refuses others. The ranks run ``tests/support/two_ranks.py``'s checks, each reported
precisely here:

- a backend operation that shardwrap issues on CUDA tensors (all-gather into a tensor,
  reduce-scatter with AVG, all-to-all, broadcast, all-reduce): passed, or skipped with the
  backend's own words where it refuses (or neither completes nor refuses within 30 s);
- each of shardwrap's collectives on CUDA tensors (the plain ones, the packed exchanges of
  buckets, the int8 ones) and training a GPT at stage 3 with and without buckets: equal to
  the values every rank can compute itself (the training: to the plain model on the whole
  batch, within 1e-5), or skipped naming the backend operation it needs and was refused; one
  that fails or hangs with every operation it needs granted is a failure.

``test_the_checks_on_cpu_tensors`` runs the same script over gloo on CPU tensors, where every
check of shardwrap must pass: the harness itself, in every run of the suite.

Run: ``.venv/bin/python -m pytest -m gpu tests/e2e/test_gpu_two_ranks.py -q -ra``
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.cuda import NEEDS_CUDA
from tests.support.launch import launch_bounded
from tests.support.two_ranks import CHECKS, judge, read

pytestmark = pytest.mark.process

SCRIPT = "tests/e2e/scripts/two_ranks_one_gpu.py"
TIMEOUT = 150  # s: every check of one backend, a refusal or two at 30 s each included
Run = tuple[list[dict[str, dict[str, Any]]], str]


def run(backend: str, device: str, folder: Path) -> Run:
    """Both ranks' records, and how the launch ended."""
    proc, cut = launch_bounded(SCRIPT, backend, device, str(folder / backend), timeout=TIMEOUT)
    if cut:
        ended = f"the launch was cut off after {TIMEOUT} s"
    else:
        tail = " / ".join((proc.stderr or "").strip().splitlines()[-2:])
        ended = f"the launch exited with {proc.returncode}" + (f": {tail}" if tail else "")
    return [read(folder / f"{backend}.rank{r}.jsonl") for r in range(2)], ended


@pytest.fixture(scope="module", params=["nccl", "gloo"])
def on_one_gpu(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() false)")
    backend = request.param
    return backend, run(backend, "cuda:0", tmp_path_factory.mktemp(backend))


@NEEDS_CUDA
@pytest.mark.gpu
@pytest.mark.timeout(TIMEOUT + 60)  # the first of a backend's tests waits for its launch
@pytest.mark.parametrize("check", [c.name for c in CHECKS])
def test_two_ranks_on_one_gpu(on_one_gpu: tuple[str, Run], check: str) -> None:
    backend, (ranks, ended) = on_one_gpu
    outcome = judge(ranks, check, ended)
    needs = next(c.needs for c in CHECKS if c.name == check)
    if outcome.status == "wrong":
        pytest.fail(f"{check} over {backend} on CUDA tensors, wrong: {outcome.message}")
    if outcome.status == "refused":
        pytest.skip(f"{backend} refuses {check} with two ranks on one GPU: {outcome.message}")
    if outcome.status == "unfinished":
        if needs and "started it" in outcome.message:  # shardwrap's own, with its needs granted
            pytest.fail(f"{check} over {backend} did not finish: {outcome.message}")
        pytest.skip(f"{backend}: {check} neither completed nor was refused: {outcome.message}")


def test_the_checks_on_cpu_tensors(tmp_path: Path) -> None:
    ranks, ended = run("gloo", "cpu", tmp_path)
    for check in CHECKS:
        outcome = judge(ranks, check.name, ended)
        if check.needs:  # shardwrap's: its exchanges on the CPU are gloo's point to point
            assert outcome.status == "ok", f"{check.name}: {outcome}"
        else:  # the backend's own: done, or refused in its words (gloo has no AVG)
            assert outcome.status in ("ok", "refused"), f"{check.name}: {outcome}"
            assert outcome.status == "ok" or outcome.message, check.name
