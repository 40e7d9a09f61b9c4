"""The logbook and rollback past loss spikes, in process (ranks as threads).

Proves that a run fed a corrupted batch at a known position detects the spike before the
optimizer applies it, rolls back to the last checkpoint before the suspect window, skips the
batches from there to the spike, lowers the learning rate and goes on, and that what it then
trains is exactly plain training on the batches and learning rates its logbook records for
the steps that survived (SGD with momentum, parameters within 1e-5). Also: a spike the run
cannot get past stops it with a clear error; a resumed run continues the same logbook; the
summary and plots are drawn from the file; bad options (out of range or of another type) are
refused on every rank before any collective; a
link among the checkpoints is left alone; a list of optimizers (Muon and AdamW) trains, saves
and resumes exactly.
Checkpoints are saved in the background (the default) except where ``blocking_saves=True``.
The end-to-end run under torchrun, against the same run without bad batches, is in
``tests/e2e/test_logbook_torchrun.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/runs/test_logbook.py -q``
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from shardwrap import ShardedModule
from shardwrap.logbook import Logbook, Spikes, main
from shardwrap.runs.runlog import read, system_figure
from shardwrap.runs.spikes import SpikeCheck
from tests.support.models import GPT, Block
from tests.support.ranks import run_ranks
from tests.support.stream import CONTEXT, VOCAB, stream

SPIKES = Spikes(window=20, min_history=10, suspect=5, lr_recover=10)
LR = 0.2


def train(
    base: nn.Module,
    folder: Path,
    steps: int,
    bad: frozenset[int] = frozenset(),
    world_size: int = 2,
    **options: object,
) -> list[dict[str, Tensor]]:
    """Train ``steps`` steps on every rank under a Logbook; return each rank's full state."""

    def rank_main(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
        model = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
        options.setdefault("spikes", SPIKES)
        with Logbook(folder, model, opt, save_every=10, plot_every=None, **options) as book:
            for _ in book.steps(steps):
                x, y = stream(book.position, rank, bad)
                loss = model(x, y)
                loss.backward()
                book.step(loss, tokens=x.numel(), samples=[book.position])
        return model.full_state_dict()

    return run_ranks(world_size, rank_main, timeout=120)


def replay(base: nn.Module, folder: Path, world_size: int = 2) -> nn.Module:
    """Plain training on the surviving steps' recorded positions and learning rates."""
    model = copy.deepcopy(base)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    for record in read(folder).steps:
        batches = [stream(record["position"], r) for r in range(world_size)]
        x, y = (torch.cat(t) for t in zip(*batches))
        for group in opt.param_groups:
            group["lr"] = record["lr"]
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
    return model


def events(folder: Path) -> list[dict]:
    return [e for e in read(folder).events if e["event"] not in ("checkpoint", "started")]


@pytest.fixture(scope="module")
def base() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab=VOCAB, context=CONTEXT)


def test_rollback_then_trains_exactly_the_recorded_batches(tmp_path: Path, base: nn.Module) -> None:
    states = train(base, tmp_path, 45, bad=frozenset({30}))
    spike, rollback, skipped, lowered, restored = events(tmp_path)
    assert (spike["event"], spike["step"]) == ("spike", 31)  # the step not applied
    lines = (tmp_path / "logbook.jsonl").read_text().splitlines()
    (written,) = [json.loads(line) for line in lines if '"event":"spike"' in line]
    assert set(written) == {"event", "step", "loss", "grad_norm", "reason", "time"}
    assert "loss" in spike["reason"]
    # The last checkpoint at least `suspect` (5) steps before the spike: step 20.
    assert (rollback["event"], rollback["to_step"], rollback["retry"]) == ("rollback", 20, 1)
    assert (skipped["positions"], skipped["batches"]) == ([20, 31], 11)
    assert (lowered["event"], lowered["scale"]) == ("lr_scale", 0.5)
    assert (restored["event"], restored["scale"], restored["step"]) == ("lr_scale", 1.0, 40)

    run = read(tmp_path)
    assert [s["step"] for s in run.steps] == list(range(1, 46))
    positions = [s["position"] for s in run.steps]
    assert positions == list(range(20)) + list(range(31, 56))
    assert all(s["samples"] == [[s["position"]]] * 2 for s in run.steps)
    lrs = [s["lr"] / LR for s in run.steps]
    assert lrs[:20] == [1.0] * 20
    # Halved from the rollback to the spike's step (31), then back to the schedule over
    # lr_recover (10) steps.
    assert lrs[20:31] == [0.5] * 11 and lrs[40:] == [1.0] * 5
    assert lrs[31] == pytest.approx(0.55) and lrs[39] == pytest.approx(0.95)
    assert [len(a) for a in run.abandoned] == [10]

    reference = replay(base, tmp_path).state_dict()
    for state in states:
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.stage3
def test_normal_noise_triggers_no_rollback(tmp_path: Path, base: nn.Module) -> None:
    train(base, tmp_path, 45, keep_last=1)
    assert events(tmp_path) == []
    # Beside the newest, the one a spike in the next step would roll back to is kept.
    saved = sorted(p.name for p in (tmp_path / "checkpoints").glob("step-*"))
    assert saved == ["step-00000040", "step-00000045"]


@pytest.mark.stage3
def test_a_link_among_the_checkpoints_is_left_alone(tmp_path: Path, base: nn.Module) -> None:
    """A link named like an old checkpoint, to a copy of one kept elsewhere, is not one of the
    run's: pruning leaves it and what it leads to alone."""
    train(base, tmp_path / "run", 20, keep_last=1)
    checkpoints = tmp_path / "run" / "checkpoints"
    shutil.copytree(checkpoints / "step-00000020", tmp_path / "kept")
    (checkpoints / "step-00000001").symlink_to(tmp_path / "kept")
    train(base, tmp_path / "run", 35, keep_last=1)
    assert os.readlink(checkpoints / "step-00000001") == str(tmp_path / "kept")
    assert (tmp_path / "kept" / "metadata.json").is_file()
    saved = sorted(p.name for p in checkpoints.glob("step-*") if not p.is_symlink())
    assert saved == ["step-00000030", "step-00000035"]


def test_a_list_of_optimizers_trains_saves_and_resumes_exactly(
    tmp_path: Path, base: nn.Module
) -> None:
    """``Logbook(folder, model, [muon, adamw])``: every step steps both, with the learning
    rate scaled alike, and a run resumed from its checkpoint ends where the uninterrupted one
    does, bit for bit (both optimizers' state saved and loaded)."""

    def run(folder: Path, steps: int) -> Any:
        def rank_main(rank: int, pg: ProcessGroup) -> dict[str, Tensor]:
            model = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
            params = list(model.parameters())
            opts = [
                torch.optim.Muon([p for p in params if p.ndim == 2], lr=1e-2),
                torch.optim.AdamW([p for p in params if p.ndim != 2], lr=1e-2),
            ]
            with Logbook(folder, model, opts, save_every=3, plot_every=None) as book:
                for _ in book.steps(steps):
                    x, y = stream(book.position, rank)
                    loss = model(x, y)
                    loss.backward()
                    book.step(loss)
            return model.full_state_dict()

        return run_ranks(2, rank_main, timeout=120)

    whole = run(tmp_path / "whole", 6)
    run(tmp_path / "resumed", 3)
    resumed = run(tmp_path / "resumed", 6)
    assert [e["event"] for e in events(tmp_path / "resumed")] == ["resumed"]
    for got, want in zip(resumed, whole):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.stage3
def test_a_spike_it_cannot_get_past_stops_the_run(tmp_path: Path, base: nn.Module) -> None:
    with pytest.raises(AssertionError) as failure:
        train(base, tmp_path, 45, bad=frozenset(range(30, 100)))
    message = str(failure.value)
    assert message.count("SpikeError") >= 2  # every rank stops alike
    assert "came back after 3 rollbacks in a row" in message
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds.count("rollback") == 3 and kinds[-1] == "stopped"


@pytest.mark.stage3
def test_resume_continues_the_logbook(tmp_path: Path, base: nn.Module) -> None:
    """The first run saves blocking, the resumed one in the background (the default)."""
    train(base, tmp_path, 25, bad=frozenset({18}), blocking_saves=True)
    with open(tmp_path / "logbook.jsonl", "a") as f:
        f.write('{"step": 26, "loss"')  # the line being written when the run was killed
    states = train(base, tmp_path, 45, bad=frozenset({18}))
    kinds = [e["event"] for e in events(tmp_path)]
    assert kinds == ["spike", "rollback", "skipped", "lr_scale", "resumed", "lr_scale"]
    run = read(tmp_path)
    assert [s["step"] for s in run.steps] == list(range(1, 46))
    assert run.steps[-1]["lr"] == LR  # recovered after resume, as the uninterrupted run would
    reference = replay(base, tmp_path).state_dict()
    for name, value in reference.items():
        torch.testing.assert_close(states[0][name], value, rtol=0, atol=1e-5, msg=name)


@pytest.mark.stage3
def test_summary_and_plots_from_the_file(
    tmp_path: Path, base: nn.Module, capsys: pytest.CaptureFixture[str]
) -> None:
    clean, spiky = tmp_path / "clean", tmp_path / "spiky"
    train(base, clean, 25, world_size=1)
    train(base, spiky, 25, bad=frozenset({20}), world_size=1)
    with open(spiky / "logbook.jsonl", "a") as f:
        f.write('{"step": 26, "loss"')  # a line cut short by a crash is ignored
    main([str(clean), str(spiky)])
    out = capsys.readouterr().out
    rows = {line.split("  ")[0]: line.split()[-2:] for line in out.splitlines()}
    assert rows["rollbacks"] == ["0", "1"]
    assert rows["steps"] == ["25", "25"]
    for folder in (clean, spiky):
        for png in ("loss.png", "system.png"):
            assert (folder / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    run = read(spiky)
    tokens, lr, memory = system_figure(run).axes
    assert [ax.get_ylabel() for ax in (tokens, lr, memory)] == [
        "tokens/s, all ranks",
        "learning rate",
        "peak memory (GiB)",
    ]
    (lr_line,) = lr.get_lines()
    assert list(lr_line.get_xdata()) == [s["step"] for s in run.steps]
    assert list(lr_line.get_ydata()) == [s["lr"] for s in run.steps]
    assert min(lr_line.get_ydata()) == LR / 2  # the rollback's backoff is drawn
    (memory_line,) = memory.get_lines()  # one rank
    assert memory.get_ylim()[0] == 0 < min(memory_line.get_ydata())


@pytest.mark.stage3
def test_bad_use_is_refused(tmp_path: Path, base: nn.Module) -> None:
    model = ShardedModule(copy.deepcopy(base), auto_wrap=Block)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    with pytest.raises(ValueError, match="keep_last must be at least 1"):
        Logbook(tmp_path, model, opt, keep_last=0)
    with pytest.raises(ValueError, match=r"Spikes.suspect must be 0 or more"):
        Spikes(suspect=-1)
    with pytest.raises(TypeError, match="wrapped with ShardedModule"):
        Logbook(tmp_path, base, opt)
    with Logbook(tmp_path, model, opt, save_every=5, plot_every=None) as book:
        with pytest.raises(RuntimeError, match="call it exactly once in every step"):
            for _ in book.steps(3):
                pass
    with pytest.raises(ValueError, match="pass resume=True to continue it"):
        Logbook(tmp_path, model, opt, resume=False)


@pytest.mark.stage3
@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"save_every": "100"}, ValueError, "save_every must be 0 (never) or more, an int; got"),
        ({"keep_last": 2.5}, ValueError, "keep_last must be at least 1, an int; got 2.5"),
        ({"plot_every": -1}, ValueError, "plot_every must be a positive number or None, got -1"),
        ({"blocking_saves": "False"}, TypeError, "blocking_saves must be True or False"),
        ({"resume": "no"}, TypeError, "resume must be True or False, got 'no'"),
    ],
)
def test_options_of_another_type_are_refused_on_every_rank(
    tmp_path: Path, base: nn.Module, options: dict[str, Any], error: type, message: str
) -> None:
    """Before any collective; before, ``blocking_saves="False"`` saved blocking and a string
    ``save_every`` raised a bare ``TypeError``."""

    def fn(rank: int, pg: ProcessGroup) -> None:
        model = ShardedModule(copy.deepcopy(base), auto_wrap=Block, process_group=pg)
        opt = torch.optim.SGD(model.parameters(), lr=LR)
        with pytest.raises(error, match=re.escape(message)):
            Logbook(tmp_path, model, opt, **options)

    run_ranks(2, fn, timeout=30.0)
    assert not (tmp_path / "checkpoints").exists()


def test_spike_check_follows_a_falling_loss_and_flags_jumps() -> None:
    check = SpikeCheck(Spikes(window=50, min_history=20))
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(300, generator=g).tolist()
    for i in range(300):  # a loss falling from 4 to 1 with 3% noise: never a spike
        loss = (1 + 3 * math.exp(-i / 60)) * (1 + 0.03 * noise[i])
        assert check.verdict(loss, 1.0 + 0.1 * noise[i]) is None, i
    assert "loss" in check.verdict(1.6, 1.0)
    assert "gradient norm" in check.verdict(1.0, 5.0)
    assert "non-finite" in check.verdict(float("nan"), 1.0)
    assert check.verdict(1.0, 1.0) is None  # spikes never entered the history


def test_logbook_lines_are_json(tmp_path: Path, base: nn.Module) -> None:
    train(base, tmp_path, 3, world_size=1)
    lines = (tmp_path / "logbook.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines if '"event"' not in line]
    assert set(steps[0]) == {
        "step", "position", "loss", "grad_norm", "lr", "tokens_per_s", "seconds",
        "peak_memory", "samples", "time",
    }  # fmt: skip


def test_a_logbook_of_an_earlier_version_reads_its_spikes_at_their_step(tmp_path: Path) -> None:
    old_spike = {"event": "spike", "step": 30, "spike_step": 31, "loss": 9.0, "grad_norm": 1.0}
    (tmp_path / "logbook.jsonl").write_text(json.dumps(old_spike) + "\n")
    (spike,) = read(tmp_path).events
    assert spike["step"] == 31 and "spike_step" not in spike
