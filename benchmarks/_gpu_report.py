"""``gpu_check.py``'s report: what the run used (the machine, the Python, torch and its CUDA
build) and its Markdown, from the run's JSON record, so that the report can be written again
from it."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import sys
from typing import Any

import torch
from _launch import ROOT

__all__ = ["environment", "render"]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _host_memory_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def environment() -> dict[str, Any]:
    """What this run uses, and a line saying it; the line warns where torch is not the
    release ``pyproject.toml`` admits (shardwrap reaches into internals that move between
    releases, so a run on another one proves that one)."""
    admitted = re.search(r'"torch>=([\d.]+),<([\d.]+)"', (ROOT / "pyproject.toml").read_text())
    low, high = admitted.groups() if admitted else ("?", "?")
    ours = tuple(int(x) for x in re.findall(r"\d+", torch.__version__)[:2])
    within = admitted is not None and (
        tuple(int(x) for x in low.split(".")[:2]) <= ours < tuple(int(x) for x in high.split("."))
    )
    env: dict[str, Any] = {
        "python": f"{platform.python_version()} ({sys.executable})",
        "torch": torch.__version__,
        "torch_admitted": f">={low},<{high}",
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "pytest": _version("pytest"),
        # TF32 matmuls (an environment may force them) would loosen fp32 parity on a GPU
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "cpu_cores": os.cpu_count(),
        "host_memory_gib": round(_host_memory_gib(), 1),
    }
    where = f"{env['cpu_cores']} cores, {env['host_memory_gib']} GiB"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["gpu"] = props.name
        env["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        if torch.distributed.is_nccl_available():
            env["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        where = f"{props.name} ({env['gpu_memory_gib']} GiB), {where}"
    else:
        where = f"no CUDA GPU, {where}"
    build = f"CUDA {env['cuda']}" if env["cuda"] else "no CUDA"
    summary = f"{where}; torch {env['torch']} ({build}); Python {platform.python_version()}"
    if not within:
        summary += (
            f"; NOTE: pyproject.toml admits torch {env['torch_admitted']}: this run checks "
            f"shardwrap on {env['torch']}"
        )
    env["summary"] = summary
    return env


def render(report: dict[str, Any]) -> str:
    """The report's Markdown."""
    env, counts = report["environment"], report["counts"]
    lines = [
        f"# make gpu-check: {env.get('gpu', 'no CUDA GPU')}, {report['date'][:10]}",
        "",
        f"`{report['command']}` at commit {report['commit']}, {report['date']}, on "
        f"{report['host']}: {counts['passed']} passed, {counts['failed']} failed, "
        f"{counts['skipped']} skipped in {report['seconds']:.0f} s ("
        + ", ".join(f"{part} {s:.0f} s" for part, s in report["parts"].items())
        + ").",
        "",
        "| | |",
        "|---|---|",
    ]
    for key in ("gpu", "gpu_memory_gib", "cpu_cores", "host_memory_gib", "python", "torch"):
        if key in env:
            lines.append(f"| {key.replace('_', ' ')} | {env[key]} |")
    lines += [
        f"| torch admitted by pyproject.toml | {env['torch_admitted']} |",
        f"| CUDA (torch's build) | {env['cuda'] or 'none'} |",
        f"| NCCL | {env.get('nccl', 'none')} |",
        f"| transformers | {env['transformers']} |",
        f"| pytest | {env['pytest']} |",
        "",
        env["summary"],
        "",
        "## Checks",
        "",
        "| check | outcome | detail | s |",
        "|---|---|---|---|",
    ]
    for c in report["checks"]:
        detail = c["detail"].replace("|", "\\|")
        lines.append(f"| `{c['name']}` | {c['outcome']} | {detail} | {c['seconds']:.1f} |")
    lines += _step(report["step"]) + _capacity(report["capacity"]) + _refused(report["checks"])
    return "\n".join(lines) + "\n"


def _step(step: dict[str, Any]) -> list[str]:
    lines = ["", "## The 101M GPT's step at world size 1", ""]
    if "results" not in step:
        return lines + [f"Not run: {step.get('skipped') or step.get('error')}."]
    cfg = step["config"]
    lines += [
        f"{step['params'] / 1e6:.1f}M parameters (width {cfg['width']}, {cfg['depth']} blocks), "
        f"batch {cfg['batch']} x {cfg['context']} bytes, AdamW; {step['rounds']} rounds of "
        f"{cfg['warmup']} warm-up and {cfg['steps']} timed steps; median step time, "
        "`max_memory_allocated` above the start. See `benchmarks/gpu_step.py`.",
    ]
    for precision, by_method in step["results"].items():
        plain = by_method.get("plain", {}).get("step_s")
        lines += [
            "",
            f"### {precision}",
            "",
            "| method | step (ms) | tokens/s | peak (GiB) | x plain | first loss |",
            "|---|---|---|---|---|---|",
        ]
        for method, e in by_method.items():
            if "error" in e:
                lines.append(f"| {method} | error: {e['error']} | | | | |")
                continue
            ratio = f"{e['step_s'] / plain:.3f}" if plain else ""
            lines.append(
                f"| {method} | {e['step_s'] * 1e3:.1f} | {e['tokens_per_s']:.0f} | "
                f"{e['peak_bytes'] / 2**30:.2f} | {ratio} | {e['losses'][0]:.5f} |"
            )
    return lines


def _capacity(capacity: dict[str, Any]) -> list[str]:
    lines = ["", "## The largest GPT with its training state in host memory", ""]
    if "skipped" in capacity:
        return lines + [f"Not run: {capacity['skipped']}."]
    lines += [
        "Width 4096, bf16 compute on fp32 masters, AdamW, batch 2 x 1024 bytes; the second "
        "step's time. See `benchmarks/gpu_capacity.py`.",
        "",
        "| method | largest depth | parameters | tokens/s | host peak (GiB) | GPU peak (GiB) | "
        "stopped | trials |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, found in capacity.items():
        if "skipped" in found:
            lines.append(f"| {method} | {found['skipped']} | | | | | | |")
            continue
        trials = "; ".join(
            f"{t['depth']}: " + ("ok" if t["ok"] else t["error"]) + f" ({t['wall_s']:.0f} s)"
            for t in found["trials"]
        ).replace("|", "\\|")
        best = next(
            (t for t in found["trials"] if t["ok"] and t["depth"] == found["largest"]), None
        )
        if best is None:
            lines.append(f"| {method} | none | | | | | {found['stopped']} | {trials} |")
            continue
        gpu = best.get("gpu_peak_bytes", 0) / 2**30
        lines.append(
            f"| {method} | {best['depth']} | {best['params'] / 1e9:.2f}B | "
            f"{best['tokens_per_s']:.0f} | {best['host_peak_bytes'] / 2**30:.1f} | {gpu:.1f} | "
            f"{found['stopped']} | {trials} |"
        )
    return lines


def _refused(checks: list[dict[str, Any]]) -> list[str]:
    """The backends' refusals with two ranks on one GPU, as the tier's skips said them."""
    said = [
        c["detail"]
        for c in checks
        if c["outcome"] == "skipped"
        and "test_gpu_two_ranks" in c["name"]
        and "refuses" in c["detail"]
    ]
    if not said:
        return []
    return ["", "## Refused with two ranks on one GPU", "", *(f"- {s}" for s in said)]
