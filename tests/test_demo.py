"""The demo, ``examples/train_gpt.py``: its run's name and its compression flags, in process.

Proves the run's default name outside torchrun and under it (the same for every restart of one
launch), the refusal of restarts it could not resume, and that the compression flags ask for
shardwrap's ``Compression``. The demo itself, under ``torchrun``: ``tests/e2e/test_demo.py``;
its loss with compression: ``benchmarks/compressed_convergence.py``.
Run: ``pytest tests/test_demo.py``.
"""

from __future__ import annotations

import os
import re

import pytest

from examples.train_gpt import check_restarts, compression_of, parse_args, run_name
from shardwrap import Compression


@pytest.mark.stage3
def test_the_default_run_name_is_stable_across_restarts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name in [n for n in os.environ if n.startswith("TORCHELASTIC_")]:
        monkeypatch.delenv(name)
    args = parse_args([])
    assert re.fullmatch(r"gpt-\d{8}-\d{6}", run_name(args))  # outside torchrun: a new run
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "0")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "0b6e3f6c-4a2c-4c7e-9d11-2f1f0e6a8b90")
    assert re.fullmatch(r"gpt-\d{8}-\d{6}", run_name(args))  # no restart can happen
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    assert run_name(args) == "gpt-0b6e3f6c-4a2c-4c7e-9d11-2f1f0e6a8b90"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    assert run_name(args) == "gpt-job-42"
    assert run_name(parse_args(["--name", "mine"])) == "mine"

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    check_restarts(args)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in capsys.readouterr().err
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "False")
    check_restarts(args)
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun without a rendezvous id
    with pytest.raises(SystemExit, match="pass --name NAME, or launch torchrun with --standal"):
        check_restarts(args)
    check_restarts(parse_args(["--name", "mine"]))


@pytest.mark.stage3
def test_the_compression_flags_ask_for_shardwraps_compression() -> None:
    assert not compression_of(parse_args([])).enabled
    flags = ["--compress-params", "int8", "--compress-grads", "int4", "--no-error-feedback"]
    wanted = Compression(params="int8", grads="int4", error_feedback=False)
    assert compression_of(parse_args(flags)) == wanted
    assert compression_of(parse_args(flags[:4])).error_feedback
