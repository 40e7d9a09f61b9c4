"""Reading a logbook back: the run that survived, what was abandoned, a summary, the plots.

``logbook.jsonl`` is append-only. After a rollback or a resume the run repeats step numbers;
the lines written for the abandoned steps stay in the file. Reading replays it in order: a
``rollback`` to step ``c`` or a ``resumed`` from step ``c`` moves every step after ``c`` from
the surviving path to an abandoned segment, and a later line for a step replaces an earlier one.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..checkpoint.files import LOGBOOK

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "Run",
    "draw",
    "dumps",
    "loss_figure",
    "read",
    "require_matplotlib",
    "summary",
    "system_figure",
]

_GIB = 2.0**30


def dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"))


@dataclass
class Run:
    """One run folder's logbook, replayed."""

    folder: Path
    steps: list[dict[str, Any]]  # the surviving path, by step
    abandoned: list[list[dict[str, Any]]]  # runs of steps that a rollback or resume dropped
    events: list[dict[str, Any]] = field(default_factory=list)

    def count(self, kind: str) -> int:
        return sum(e["event"] == kind for e in self.events)


def read(folder: Path) -> Run:
    """Replay ``folder/logbook.jsonl``. A last line cut short by a crash is ignored.

    Raises:
        FileNotFoundError: no logbook in ``folder``.
    """
    path = Path(folder) / LOGBOOK
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no logbook here; give the folder a Logbook wrote to")
    alive: dict[int, dict[str, Any]] = {}
    run = Run(Path(folder), [], [])
    lines = path.read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) - 1:
                break  # the line being written when the run died
            raise ValueError(f"{path}: line {n + 1} is not JSON: {line[:80]!r}") from None
        if "event" not in record:
            alive[record["step"]] = record
            continue
        if "spike_step" in record:  # a logbook written before spikes carried one step
            record["step"] = record.pop("spike_step")
        run.events.append(record)
        back_to = {"rollback": record.get("to_step"), "resumed": record.get("step")}
        to = back_to.get(record["event"])
        if to is not None:
            dropped = sorted(s for s in alive if s > to)
            if dropped:
                run.abandoned.append([alive.pop(s) for s in dropped])
    run.steps = [alive[s] for s in sorted(alive)]
    return run


def summary(runs: list[Run]) -> str:
    """A table of each run's figures, one column per run."""
    columns = [_figures(run) for run in runs]
    names = list(columns[0])
    width = max(len(n) for n in names)
    head = [f"{'':<{width}}"] + [f"{str(run.folder):>24}" for run in runs]
    rows = ["  ".join(head)]
    rows += ["  ".join([f"{n:<{width}}"] + [f"{c[n]:>24}" for c in columns]) for n in names]
    return "\n".join(rows)


def _figures(run: Run) -> dict[str, str]:
    steps = run.steps
    if not steps:
        return {"steps": "0"}
    losses = [s["loss"] for s in steps]
    last = losses[-10:]
    peaks = [max(s["peak_memory"]) for s in steps if s.get("peak_memory")]
    skipped = sum(e.get("batches", 0) for e in run.events if e["event"] == "skipped")
    scales = [e["scale"] for e in run.events if e["event"] == "lr_scale"]
    return {
        "steps": f"{steps[-1]['step']:,}",
        "loss, first step": f"{losses[0]:.4f}",
        "loss, mean of last 10": f"{sum(last) / len(last):.4f}",
        "loss, lowest": f"{min(losses):.4f}",
        "tokens/s, median": f"{statistics.median(s['tokens_per_s'] for s in steps):,.0f}",
        "training seconds": f"{sum(s['seconds'] for s in steps):,.1f}",
        "peak memory, largest rank": f"{max(peaks) / _GIB:.2f} GiB" if peaks else "-",
        "checkpoints saved": str(run.count("checkpoint")),
        "spikes": str(run.count("spike")),
        "rollbacks": str(run.count("rollback")),
        "batches skipped": str(skipped),
        "learning-rate scale, lowest": f"{min(scales):g}" if scales else "1",
        "resumes": str(run.count("resumed")),
        "steps abandoned": str(sum(len(a) for a in run.abandoned)),
    }


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        raise ImportError(
            "Logbook plots need matplotlib: pip install matplotlib, or pass plot_every=None"
        ) from e


_MARKS = {  # event -> colour, label of a vertical line at its step
    "rollback": ("tab:orange", "rolled back to"),
    "resumed": ("tab:green", "resumed"),
}


def draw(folder: Path) -> None:
    """Write ``loss.png`` and ``system.png`` from ``folder``'s logbook."""
    run = read(folder)
    for figure, name in ((loss_figure(run), "loss.png"), (system_figure(run), "system.png")):
        figure.savefig(Path(folder) / name, dpi=90)


def loss_figure(run: Run) -> Figure:
    """Loss and gradient norm by step: the surviving path, steps abandoned in grey, spikes at
    their values, rollbacks and resumes as lines, checkpoints as ticks."""
    from matplotlib.figure import Figure

    x = [s["step"] for s in run.steps]
    fig = Figure(figsize=(8, 6))
    ax_loss, ax_grad = fig.subplots(2, 1, sharex=True)
    for ax, key, label in ((ax_loss, "loss", "loss"), (ax_grad, "grad_norm", "gradient norm")):
        for n, gone in enumerate(run.abandoned):
            ys = _finite([s[key] for s in gone])
            ax.plot(
                [s["step"] for s in gone], ys, color="0.7", lw=0.8, label="abandoned" * (n == 0)
            )
        ax.plot(x, _finite([s[key] for s in run.steps]), color="tab:blue", lw=1, label=label)
        spikes = [e for e in run.events if e["event"] == "spike"]
        if spikes:
            ax.scatter(
                [e["step"] for e in spikes],
                _finite([e[key] for e in spikes]),
                marker="x",
                color="tab:red",
                zorder=3,
                label="spike (not applied)",
            )
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        _mark_events(ax, run)
    ax_grad.set_yscale("log")
    ax_grad.set_xlabel("step")
    ax_loss.set_title(f"{run.folder.resolve().name}: grey, steps abandoned by a rollback")
    lines = ax_loss.get_lines() + ax_loss.collections
    handles = {h.get_label(): h for h in lines if not h.get_label().startswith("_")}
    ax_loss.legend(handles.values(), handles.keys(), fontsize=8, loc="upper right")
    fig.tight_layout()
    return fig


def system_figure(run: Run) -> Figure:
    """Throughput, the learning rate applied (a rollback's backoff included) and each rank's
    peak memory by step. The memory axis starts at zero, so that its scale shows what a drift
    weighs against the whole (a zoomed axis makes a few MB look like a leak)."""
    from matplotlib.figure import Figure

    x = [s["step"] for s in run.steps]
    fig = Figure(figsize=(8, 7))
    ax_tok, ax_lr, ax_mem = fig.subplots(3, 1, sharex=True)
    ax_tok.plot(x, [s["tokens_per_s"] for s in run.steps], lw=1)
    ax_tok.set_ylabel("tokens/s, all ranks")
    ax_lr.plot(x, [s["lr"] for s in run.steps], lw=1, color="tab:purple")
    ax_lr.set_ylabel("learning rate")
    ranks = len(run.steps[0]["peak_memory"]) if run.steps else 0
    for r in range(ranks):
        ax_mem.plot(x, [s["peak_memory"][r] / _GIB for s in run.steps], lw=1, label=f"rank {r}")
    ax_mem.set_ylim(bottom=0)
    ax_mem.set_ylabel("peak memory (GiB)")
    ax_mem.set_xlabel("step")
    if ranks:
        ax_mem.legend(fontsize=8, ncol=min(ranks, 8), loc="lower right")
    for ax in (ax_tok, ax_lr, ax_mem):
        ax.grid(alpha=0.3)
    fig.tight_layout()
    return fig


def _mark_events(ax: Any, run: Run) -> None:
    for event in run.events:
        kind = event["event"]
        if kind in _MARKS:
            colour, label = _MARKS[kind]
            ax.axvline(event["step"], color=colour, ls="--", lw=1, label=label)
    saved = [e["step"] for e in run.events if e["event"] == "checkpoint"]
    if saved:
        ax.scatter(
            saved,
            [0] * len(saved),
            transform=ax.get_xaxis_transform(),
            marker="|",
            color="0.4",
            s=40,
            label="checkpoint",
            clip_on=False,
        )


def _finite(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]
