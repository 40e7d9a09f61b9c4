"""``make gpu-check``'s driver: the CUDA tier and the GPU benchmark in one run, one line per check
as it ends, a summary, and a Markdown report.

    python benchmarks/gpu_check.py                          # what make gpu-check runs
    python benchmarks/gpu_check.py --budget-s 300 --out /tmp/gpu

Three parts, each bounded in time, so that the whole run ends within ``--budget-s`` (7.5
minutes: with the environment's setup, 8 on one H100):

1. the CUDA tier: ``pytest -m gpu`` over ``tests/tiers/test_gpu*.py`` and
   ``tests/e2e/test_gpu*.py`` in a child process (at most ``--tier-s``), each test a check
   (``_checks_log.py`` writes each outcome as it comes, so a run cut off still names every
   test that ended, and the one that was running);
2. the 101M GPT's step at world size 1 (``gpu_step.py``, at most ``--step-s``): a check per
   method and precision;
3. the largest GPT at width 4096 that trains with its state in host memory
   (``gpu_capacity.py``): a check per method, each searching in half of the time left.

Where no CUDA device exists the tier's tests skip with their reasons, every benchmark check is
reported SKIPPED with its own, and the run exits 0: the CPU suite runs it so
(``tests/e2e/test_make_gpu_check.py``). A check fails where a test fails or a method errs;
a benchmark's goal missed is reported, not failed. The exit status is 1 if any check failed.

The report, ``gpu_check_<hardware>_<date>.md``, with its JSON and the tier's pytest output
beside it, goes to ``--out``: by default ``$OUT`` where that is set, else
``benchmarks/results/gpu_check/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from _gpu_report import environment, render
from _launch import ROOT, commit, hardware, results_dir
from gpu_capacity import METHODS as CAPACITY_METHODS
from gpu_capacity import available_bytes, search
from gpu_step import GOAL, METHODS, PRECISIONS

HERE = Path(__file__).resolve().parent
TIER = ["tests/tiers/test_gpu*.py", "tests/e2e/test_gpu*.py"]
NO_GPU = "needs a CUDA GPU (torch.cuda.is_available() false)"
MIN_SEARCH_S = 45  # s: two small trials and a larger one, at the least


@dataclass
class Check:
    """One line of the run: what was checked, how it ended, and what it said."""

    name: str
    outcome: str  # "passed", "failed" or "skipped"
    detail: str = ""
    seconds: float = 0.0

    def line(self) -> str:
        return f"{self.outcome.upper():8} {self.name}" + (f": {self.detail}" if self.detail else "")


class Run:
    """The checks so far, printed as each is added, and the deadline of the whole run."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.monotonic()
        self.budget_s = budget_s
        self.checks: list[Check] = []

    def add(self, check: Check) -> None:
        self.checks.append(check)
        print(check.line(), flush=True)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.start)


def child_env(threads: int) -> dict[str, str]:
    """The environment of every child: this checkout importable, ``benchmarks/`` too (the
    pytest plugin), gloo on the loopback interface (the hostname may resolve nowhere)."""
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{HERE}", PYTHONUNBUFFERED="1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env["OMP_NUM_THREADS"] = str(threads)
    return env


def bounded(cmd: list[str], timeout: float, env: dict[str, str], log: Path) -> int | None:
    """Run ``cmd`` with its output in ``log``; past ``timeout`` seconds kill it and every
    process it started. Its exit code, or ``None`` where it was cut off."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            return proc.wait(timeout=max(timeout, 1.0))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


# 1. the CUDA tier ----------------------------------------------------------------------


def run_tier(run: Run, limit_s: float, out_log: Path) -> None:
    """The tier's tests, each a check as its record comes (see ``_checks_log.py``)."""
    files = [str(p.relative_to(ROOT)) for pattern in TIER for p in sorted(ROOT.glob(pattern))]
    with tempfile.TemporaryDirectory() as tmp:
        records = Path(tmp) / "records.jsonl"
        env = child_env(1)
        env["SHARDWRAP_CHECKS_LOG"] = str(records)
        cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-p", "_checks_log"]
        cmd += ["-p", "no:cacheprovider", "-o", "timeout=150", *files]
        with out_log.open("w") as out:
            proc = subprocess.Popen(
                cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
            collected, ended, running, cut = _follow(run, proc, records, time.monotonic() + limit_s)
    if cut:
        for test in collected:
            if test not in ended:
                what = "was running" if test == running else "did not start"
                detail = f"{what} when the tier was cut off after {limit_s:.0f} s"
                run.add(Check(_short(test), "failed", detail))
    elif not ended and proc.returncode != 0:
        tail = " / ".join(out_log.read_text().strip().splitlines()[-3:])
        run.add(Check("CUDA tier", "failed", f"pytest exited with {proc.returncode}: {tail}"))


def _follow(
    run: Run, proc: subprocess.Popen[bytes], records: Path, deadline: float
) -> tuple[list[str], set[str], str | None, bool]:
    """Turn the plugin's records into checks as they come until pytest ends or the deadline
    passes (then pytest and its children are killed). Returns the tests collected, those that
    ended, the one that started last, and whether pytest was cut off."""
    collected: list[str] = []
    ended: set[str] = set()
    running: str | None = None
    offset = 0
    while True:
        cut = proc.poll() is None and time.monotonic() > deadline
        if cut:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        done = cut or proc.poll() is not None
        text = records.read_text() if records.exists() else ""
        complete = text[offset : text.rfind("\n") + 1] if "\n" in text[offset:] else ""
        offset += len(complete)
        for line in complete.splitlines():
            record = json.loads(line)
            if "collected" in record:
                collected = record["collected"]
            elif record["outcome"] == "started":
                running = record["test"]
            else:
                ended.add(record["test"])
                message, seconds = record.get("message", ""), record.get("seconds", 0.0)
                run.add(Check(_short(record["test"]), record["outcome"], message, seconds))
        if done:
            return collected, ended, running, cut
        time.sleep(0.5)


def _short(nodeid: str) -> str:
    return nodeid.removeprefix("tests/")


# 2. the 101M GPT's step ----------------------------------------------------------------


def run_step(run: Run, limit_s: float, out_log: Path) -> dict[str, Any]:
    """``gpu_step.py`` in a child; a check per method and precision."""
    names = [f"bench step {p}: {m}" for p in PRECISIONS for m in METHODS]
    if not torch.cuda.is_available():
        for name in names:
            run.add(Check(name, "skipped", NO_GPU))
        return {"skipped": NO_GPU}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "step.json"
        # a round starts only while a whole one still fits
        cmd = [sys.executable, str(HERE / "gpu_step.py"), str(out), "--limit-s", str(limit_s / 3)]
        began = time.monotonic()
        code = bounded(cmd, limit_s, child_env(os.cpu_count() or 1), out_log)
        seconds = time.monotonic() - began
        result = json.loads(out.read_text()) if out.exists() else None
    if result is None:
        said = "cut off" if code is None else f"exited with {code}"
        for name in names:
            run.add(Check(name, "failed", f"gpu_step.py {said} after {seconds:.0f} s"))
        return {"error": said}
    for precision, by_method in result["results"].items():
        plain = by_method.get("plain", {}).get("step_s")
        for method, entry in by_method.items():
            name = f"bench step {precision}: {method}"
            if "error" in entry:
                run.add(Check(name, "failed", entry["error"]))
            else:
                run.add(Check(name, "passed", step_detail(method, entry, plain)))
    return result


def step_detail(method: str, entry: dict[str, Any], plain: float | None) -> str:
    """One method's step in a line, judged against the goal where it is shardwrap's."""
    text = f"{entry['step_s'] * 1e3:.1f} ms, {entry['peak_bytes'] / 2**30:.2f} GiB peak"
    if plain:
        ratio = entry["step_s"] / plain
        text += f", {ratio:.3f}x plain"
        if method == "shardwrap":
            text += f" (goal at most {GOAL}x: {'met' if ratio <= GOAL else 'not met'})"
    return text


# 3. the largest GPT with its state in host memory --------------------------------------


def run_capacity(run: Run, reserve_s: float, folder: Path) -> dict[str, Any]:
    """The search of ``gpu_capacity.py`` for each method, each in half of the time left."""
    if not torch.cuda.is_available():
        for method in CAPACITY_METHODS:
            run.add(Check(f"bench capacity: {method}", "skipped", NO_GPU))
        return {"skipped": NO_GPU}
    results = {}
    for i, method in enumerate(CAPACITY_METHODS):
        share = (run.left() - reserve_s) / (len(CAPACITY_METHODS) - i)
        if share < MIN_SEARCH_S:
            said = f"not run: {share:.0f} s of the run's budget left for it, {MIN_SEARCH_S} needed"
            run.add(Check(f"bench capacity: {method}", "skipped", said))
            results[method] = {"skipped": said}
            continue
        began = time.monotonic()
        found = search(_trial_runner(method, folder), share, available_bytes())
        found["seconds"] = time.monotonic() - began
        results[method] = found
        run.add(capacity_check(method, found))
    return results


def _trial_runner(method: str, folder: Path) -> Callable[[int, float], dict[str, Any]]:
    """One trial of ``method`` in a process of its own, bounded in time."""

    def run_trial(depth: int, left: float) -> dict[str, Any]:
        out = folder / f"{method}-{depth}.json"
        log = folder / f"{method}-{depth}.log"
        cmd = [sys.executable, str(HERE / "gpu_capacity.py"), method, str(depth), str(out)]
        code = bounded(cmd, left, child_env(os.cpu_count() or 1), log)
        if out.exists():
            return json.loads(out.read_text())
        if code is None:
            return {"ok": False, "cut": True, "error": f"did not end within {left:.0f} s"}
        if code < 0:
            name = signal.Signals(-code).name
            said = " (by the kernel: out of host memory)" if code == -signal.SIGKILL else ""
            return {"ok": False, "error": f"killed by {name}{said}"}
        tail = " / ".join(log.read_text().strip().splitlines()[-2:])
        return {"ok": False, "error": f"exited with {code}: {tail}"}

    return run_trial


def capacity_check(method: str, found: dict[str, Any]) -> Check:
    name = f"bench capacity: {method}"
    trials = found["trials"]
    tried = ", ".join(f"{t['depth']} {'ok' if t['ok'] else 'failed'}" for t in trials)
    if found["largest"] is None:
        errors = "; ".join(t["error"] for t in trials if not t["ok"])
        return Check(name, "failed", f"no depth trained ({errors})", found["seconds"])
    best = next(t for t in trials if t["ok"] and t["depth"] == found["largest"])
    detail = (
        f"depth {best['depth']} trains ({best['params'] / 1e9:.2f}B parameters, "
        f"{best['tokens_per_s']:.0f} tokens/s, host peak {best['host_peak_bytes'] / 2**30:.1f} "
        f"GiB); stopped: {found['stopped']}; trials: {tried}"
    )
    return Check(name, "passed", detail, found["seconds"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_out = Path(os.environ["OUT"]) if os.environ.get("OUT") else results_dir("gpu_check")
    p.add_argument("--out", type=Path, default=default_out, help="where the report goes")
    p.add_argument("--budget-s", type=float, default=450.0, help="the whole run, at most")
    p.add_argument("--tier-s", type=float, default=210.0, help="the CUDA tier, at most")
    p.add_argument("--step-s", type=float, default=90.0, help="the step benchmark, at most")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{hardware()}_{datetime.date.today().isoformat()}"
    env = environment()
    print(f"gpu-check: {env['summary']}", flush=True)
    run = Run(args.budget_s)
    parts: dict[str, float] = {}
    began = time.monotonic()
    run_tier(run, min(args.tier_s, run.left()), args.out / f"{stem}_pytest.log")
    parts["CUDA tier"] = time.monotonic() - began
    began = time.monotonic()
    step = run_step(run, min(args.step_s, run.left()), args.out / f"{stem}_step.log")
    parts["step benchmark"] = time.monotonic() - began
    began = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        capacity = run_capacity(run, 15.0, Path(tmp))
    parts["capacity benchmark"] = time.monotonic() - began
    counts = {o: sum(c.outcome == o for c in run.checks) for o in ("passed", "failed", "skipped")}
    total = time.monotonic() - run.start
    report = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "environment": env,
        "counts": counts,
        "seconds": total,
        "parts": parts,
        "checks": [asdict(c) for c in run.checks],
        "step": step,
        "capacity": capacity,
    }
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=1))
    (args.out / f"{stem}.md").write_text(render(report))
    print(
        f"gpu-check: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {total:.0f} s; report: {args.out / stem}.md",
        flush=True,
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
