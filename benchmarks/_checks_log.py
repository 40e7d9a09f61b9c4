"""A pytest plugin for ``gpu_check.py``: one JSON line per test to the file that
``SHARDWRAP_CHECKS_LOG`` names, written as the test starts and as it ends, so that a run cut
off at its time limit still says which tests ended, how, and which one was running.

    SHARDWRAP_CHECKS_LOG=log.jsonl python -m pytest -p _checks_log ...   # benchmarks/ on the path

Records: first ``{"collected": [nodeid, ...]}``, the tests selected; per test ``{"test":
nodeid, "outcome": "started"}``, then ``{"test", "outcome": "passed" | "failed" | "skipped",
"seconds", "message"}``: the skip's reason, or the failure's first line. A module that fails
to import is a failed record of its own.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

_ENV = "SHARDWRAP_CHECKS_LOG"
_seen: dict[str, dict[str, Any]] = {}  # per test: its outcome so far, over its phases


def _write(record: dict[str, Any]) -> None:
    with open(os.environ[_ENV], "a") as log:
        log.write(json.dumps(record) + "\n")


def _message(report: pytest.TestReport | pytest.CollectReport) -> str:
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is not None:
        return str(crash.message).strip().splitlines()[0]
    text = report.longreprtext.strip()
    return text.splitlines()[-1] if text else ""


def pytest_collection_finish(session: pytest.Session) -> None:
    _write({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _write({"test": nodeid, "outcome": "started"})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """A test's outcome, written after its teardown: a failure in any phase fails it, a skip
    in setup (a ``skipif`` mark, a fixture's skip) or call skips it."""
    seen = _seen.setdefault(report.nodeid, {"outcome": "passed", "message": "", "seconds": 0.0})
    seen["seconds"] += report.duration
    if report.failed and seen["outcome"] != "failed":
        seen.update(outcome="failed", message=_message(report))
    elif report.skipped and seen["outcome"] == "passed":
        seen.update(outcome="skipped", message=_message(report))
    if report.when == "teardown":
        _write({"test": report.nodeid, **_seen.pop(report.nodeid)})


def pytest_collectreport(report: pytest.CollectReport) -> None:
    if report.failed:
        _write({"test": report.nodeid, "outcome": "failed", "message": _message(report)})
