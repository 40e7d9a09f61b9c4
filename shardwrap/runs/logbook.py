"""A run's logbook, and rollback past loss spikes without a person.

    with shardwrap.Logbook("runs/gpt", model, opt, save_every=100) as book:
        for step in book.steps(10_000):      # resumes; after a rollback, repeats from there
            set_lr(opt, schedule(step))
            batch = data.batch(book.position, rank)  # a pure function of the position
            model(batch).backward()
            book.step(loss, tokens=batch.numel())  # measure, judge, step or roll back, log

    python -m shardwrap.logbook runs/gpt [runs/other]   # summary, side by side; redraw plots
    (see ``shardwrap.logbook``)

Design note. :meth:`Logbook.step` owns the end of a training step: it takes the global
gradient norm (clipping when asked), gathers every rank's loss, tokens and peak memory in one
collective, and judges the step with :class:`Spikes` before the optimizer sees it. Every rank
judges the same gathered numbers with the same history, so every rank reaches the same
verdict with no further exchange. A normal step is applied and logged; a spike is not applied:
the run loads the last checkpoint saved before the spike's suspect window, moves the data
position past every batch from that checkpoint to the spike, scales the learning rate by
``lr_backoff`` and goes on. Batches are addressed by a position in the data stream
(:attr:`Logbook.position`), not by the step, which is what makes skipping them possible and
what the logbook records for every step.

Rank 0 appends one JSON line per step and per event to ``logbook.jsonl`` and flushes it, so a
crash loses at most the line being written; a resumed run first cuts off such a torn line, then
appends to the same file. Lines for steps that a rollback or resume abandoned stay in the file;
readers take the last line written for each step (see ``shardwrap.runs.runlog``).
"""

from __future__ import annotations

import math
import re
import resource
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..checkpoint.background import PendingSave
from ..checkpoint.files import LOGBOOK
from ..checkpoint.folder import delete_checkpoint
from ..checkpoint.format import metadata_of
from ..checkpoint.load import load_checkpoint
from ..checkpoint.optimizer_state import Optimizers, as_list
from ..checkpoint.save import latest_checkpoint, save_checkpoint
from ..comm.collectives import group_rank, group_size
from ..engine.step.root import Root
from . import runlog
from .spikes import SpikeCheck, Spikes

__all__ = ["Logbook", "SpikeError", "Spikes"]

_CHECKPOINT = re.compile(r"step-(\d+)")
DEFAULT_SPIKES = Spikes()


class SpikeError(RuntimeError):
    """The run met a loss spike it could not get past with ``max_retries`` rollbacks."""


class Logbook:
    """Logs a training run on every rank alike, checkpoints it, and rolls it back past spikes.

    Args:
        folder: the run folder: ``logbook.jsonl``, ``loss.png``, ``system.png`` and
            ``checkpoints/`` go here.
        model: a model wrapped with :class:`ShardedModule`.
        optimizer: the optimizer over ``model.parameters()``, or a list of optimizers over
            disjoint parts of them (``[muon, adamw]``); :meth:`step` calls each one's
            ``step()`` and ``zero_grad()``, and scales every group's learning rate.
        save_every: save a checkpoint every this many steps (and after the last). Rollback
            needs checkpoints: with ``0`` there are none, and a spike stops the run.
        keep_last: checkpoints kept, besides the one a rollback would go to now.
        clip: clip gradients to this global norm; ``None`` measures the norm only.
        spikes: when a step is a spike and what to do about one. ``None`` turns outlier
            detection off; a non-finite loss or gradient norm still rolls back, with the
            defaults of :class:`Spikes`.
        plot_every: seconds between redraws of the plots (and at the end); ``None``: never.
        print_every: rank 0 prints a line every this many steps, and every event but a
            checkpoint as it happens; ``None``: silent.
        resume: continue from the latest checkpoint in ``folder/checkpoints`` if there is one.
        stateful: more objects with ``state_dict()``/``load_state_dict()`` (a learning-rate
            scheduler, say) saved in every checkpoint and restored by resume and rollback.
        blocking_saves: ``False`` (default) saves with ``save_checkpoint(blocking=False)``:
            training goes on while a checkpoint is written, at the cost of one host copy of
            this rank's shards and optimizer state (kept between saves); the next save, a
            rollback and the end of :meth:`steps` wait for it first. ``True``: every rank
            waits for each save.

    Raises:
        ValueError: an option out of range or of another type, on every rank before any
            collective.
        TypeError: ``optimizer`` neither an optimizer nor a list of them, or ``resume`` or
            ``blocking_saves`` not a bool.
        ImportError: plots asked for without matplotlib installed.
    """

    def __init__(
        self,
        folder: str | Path,
        model: nn.Module,
        optimizer: Optimizers,
        *,
        save_every: int = 100,
        keep_last: int = 2,
        clip: float | None = None,
        spikes: Spikes | None = DEFAULT_SPIKES,
        plot_every: float | None = 60.0,
        print_every: int | None = None,
        resume: bool = True,
        stateful: Mapping[str, Any] | None = None,
        blocking_saves: bool = False,
    ) -> None:
        _check_int("save_every", save_every, 0, "0 (never) or more")
        _check_int("keep_last", keep_last, 1, "at least 1")
        if print_every is not None:
            _check_int("print_every", print_every, 1, "at least 1 or None")
        for name, seconds_or_norm in (("clip", clip), ("plot_every", plot_every)):
            if seconds_or_norm is not None and not (
                isinstance(seconds_or_norm, (int, float))
                and not isinstance(seconds_or_norm, bool)
                and 0 < seconds_or_norm < math.inf
            ):
                raise ValueError(
                    f"Logbook: {name} must be a positive number or None, got {seconds_or_norm!r}"
                )
        for name, flag in (("resume", resume), ("blocking_saves", blocking_saves)):
            if not isinstance(flag, bool):
                raise TypeError(f"Logbook: {name} must be True or False, got {flag!r}")
        if plot_every is not None:
            runlog.require_matplotlib()
        for name, obj in (stateful or {}).items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ValueError(
                    f"Logbook: stateful[{name!r}] is a {type(obj).__name__}, which has no "
                    "state_dict()/load_state_dict(); pass objects a checkpoint can restore"
                )
        self.folder = Path(folder)
        self.checkpoints = self.folder / "checkpoints"
        self.model, self.optimizer = model, optimizer
        self._optimizers = as_list(optimizer, "Logbook")
        self.save_every, self.keep_last, self.clip = save_every, keep_last, clip
        self.spikes = spikes or Spikes()
        self.detect = spikes is not None
        self.plot_every, self.print_every = plot_every, print_every
        self.stateful = dict(stateful or {})
        self.blocking_saves = blocking_saves
        self._pending: PendingSave | None = None  # the save being written in the background
        self._root = getattr(model, "_shardwrap_root", None)
        if not isinstance(self._root, Root):
            raise TypeError(
                f"Logbook takes a model wrapped with ShardedModule, got {type(model).__name__}"
            )
        self._mesh = self._root.mesh
        self._check = SpikeCheck(self.spikes)
        self.done = 0  # optimizer steps applied on the path that survives
        self.offset = 0  # data position of step i is i + offset
        self._backoff = (1.0, 0)  # learning-rate factor after the last rollback, spike step
        self._retries = 0
        self._last_spike: int | None = None
        self._trusted = -1  # the step of the last rollback's target
        self._calls = 0
        self._total: int | None = None
        self._saved_at = -1  # the step of the last checkpoint saved or loaded
        self._step_began = time.perf_counter()
        self._plotted = time.monotonic()
        latest = latest_checkpoint(self.checkpoints)
        if latest is not None and not resume:
            raise ValueError(
                f"Logbook: {self.checkpoints} holds checkpoints of an earlier run (latest: "
                f"{latest.name}); pass resume=True to continue it, or give a new folder"
            )
        self._file = None
        if self._mesh.rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            _drop_torn_line(self.folder / LOGBOOK)
            self._file = open(self.folder / LOGBOOK, "a", encoding="utf-8")
        if latest is not None:
            self._restore(load_checkpoint(self.checkpoints, model, optimizer), resume=True)
            self.event("resumed", checkpoint=latest.name, world_size=self._mesh.world_size)
        else:
            parameters = sum(math.prod(p.shape) for p in self._root.params)
            self.event("started", world_size=self._mesh.world_size, parameters=parameters)

    # the loop ----------------------------------------------------------------------------

    @property
    def lr_scale(self) -> float:
        """What the schedule's learning rate is multiplied by in this step: ``lr_backoff`` per
        rollback, climbing back to 1 over ``lr_recover`` steps once past the spike."""
        low, spike = self._backoff
        recover = self.spikes.lr_recover
        if low == 1.0 or self.done < spike or recover == 0:
            return low
        return low + (1.0 - low) * min(1.0, (self.done + 1 - spike) / recover)

    @property
    def position(self) -> int:
        """Where in the data stream this step's batch is. Make each rank's batch a pure
        function of it (and of the rank), so that a rollback can skip batches."""
        return self.done + self.offset

    def steps(self, total: int) -> Iterator[int]:
        """Yield the index of each step to run until ``total`` steps are applied.

        After a rollback the indices go back to the checkpoint's. Call :meth:`step` once in
        every step. At the end, saves a last checkpoint and redraws the plots.
        """
        self._total = total
        if self.save_every and self.done == 0 and latest_checkpoint(self.checkpoints) is None:
            self._save()  # the first rollback target: the initial weights
        while self.done < total:
            calls = self._calls
            self._step_began = time.perf_counter()
            yield self.done
            if self._calls != calls + 1:
                raise RuntimeError(
                    f"Logbook: book.step(loss) was called {self._calls - calls} times in step "
                    f"{self.done}; call it exactly once in every step of book.steps()"
                )
        if self.save_every and self._saved_at != self.done:
            self._save()
        self._settle()
        self.plot()

    def step(self, loss: Tensor, *, tokens: int = 0, samples: Sequence[int] | None = None) -> bool:
        """End a step whose backward has run: judge it, then apply it or roll back.

        Call on every rank, once per step of :meth:`steps`.

        Args:
            loss: this rank's loss for the step (its mean over ranks is what is logged).
            tokens: tokens this rank processed in the step, for throughput.
            samples: the sample indices this rank's batch used, recorded in the logbook.

        Returns:
            Whether the step was applied (``False``: it was a spike and the run rolled back).

        Raises:
            SpikeError: on every rank, when a spike recurs after ``max_retries`` rollbacks, or
                when there is no checkpoint to roll back to.
        """
        self._calls += 1
        if self.clip is not None:
            norm = self.model.clip_grad_norm_(self.clip)
        else:  # the norm alone: no pass that multiplies every gradient by 1
            grads = [p.grad for p in self.model.parameters() if p.grad is not None]
            norm = torch.nn.utils.get_total_norm(grads)
        grad_norm = float(norm)
        mine = torch.tensor(
            [float(loss.detach()), float(tokens), float(_peak_memory())], dtype=torch.float64
        )
        every = self._gather(mine)  # (world, 3): loss, tokens, peak bytes
        mean_loss = float(every[:, 0].mean())
        seconds = time.perf_counter() - self._step_began
        if self.detect:
            why = self._check.verdict(mean_loss, grad_norm)
        elif not (math.isfinite(mean_loss) and math.isfinite(grad_norm)):
            why = f"non-finite loss {mean_loss} or gradient norm {grad_norm}"
        else:
            why = None
        if why is not None:
            self._zero_grad()
            self._roll_back(mean_loss, grad_norm, why)
            return False
        groups = [group for o in self._optimizers for group in o.param_groups]
        lrs = [group["lr"] for group in groups]
        scale = self.lr_scale
        for group, lr in zip(groups, lrs):
            group["lr"] = lr * scale
        try:
            for o in self._optimizers:
                o.step()
        finally:
            for group, lr in zip(groups, lrs):
                group["lr"] = lr
        self._zero_grad()
        self.done += 1
        if self._last_spike is not None and self.done > self._last_spike + self.spikes.suspect:
            self._retries = 0
        record: dict[str, Any] = dict(
            step=self.done,
            position=self.position - 1,
            loss=mean_loss,
            grad_norm=grad_norm,
            lr=lrs[0] * scale,
            tokens_per_s=float(every[:, 1].sum()) / seconds if seconds > 0 else 0.0,
            seconds=seconds,
            peak_memory=[int(b) for b in every[:, 2].tolist()],
        )
        if samples is not None:
            record["samples"] = self._gather_object(list(map(int, samples)))
        self._write(record)
        if self._backoff[0] < 1.0 and self.lr_scale == 1.0:  # back on the schedule
            self._backoff = (1.0, 0)
            self.event("lr_scale", scale=1.0)
        if self._file is not None and self.print_every and self.done % self.print_every == 0:
            print(
                f"step {self.done}/{self._total}  loss {mean_loss:.4f}  grad norm "
                f"{grad_norm:.3g}  lr {record['lr']:.3g}  {record['tokens_per_s']:,.0f} tokens/s",
                flush=True,
            )
        if self.save_every and (self.done % self.save_every == 0 or self.done == self._total):
            self._save()
        if self.plot_every is not None and time.monotonic() - self._plotted > self.plot_every:
            self.plot()
        return True

    def _zero_grad(self) -> None:
        for o in self._optimizers:
            o.zero_grad(set_to_none=True)

    def event(self, kind: str, *, step: int | None = None, **fields: Any) -> None:
        """Append an event line (``kind``, ``step`` and ``fields``, JSON-serialisable) to the
        logbook. ``step`` is where the event belongs on the plots' step axis; by default the
        number of steps applied so far."""
        step = self.done if step is None else step
        self._write({"event": kind, "step": step, **fields})
        if self._file is not None and self.print_every and kind != "checkpoint":
            said = ", ".join(f"{k} {v}" for k, v in fields.items())
            print(f"step {step}: {kind}: {said}", flush=True)

    def plot(self) -> None:
        """Redraw ``loss.png`` and ``system.png`` from the logbook (rank 0; others return)."""
        self._plotted = time.monotonic()
        if self._file is not None and self.plot_every is not None:
            self._file.flush()
            runlog.draw(self.folder)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> Logbook:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc: object) -> None:
        try:
            if kind is None:  # an error on its way out is the one to see; exit waits anyway
                self._settle()
        finally:
            self.close()

    # rollback ----------------------------------------------------------------------------

    def _roll_back(self, loss: float, grad_norm: float, why: str) -> None:
        self._settle()  # the checkpoints to choose from are complete ones
        spike = self.done + 1  # the step that was not applied, numbered as its line would be
        self.event("spike", step=spike, loss=loss, grad_norm=grad_norm, reason=why)
        spikes = self.spikes
        again = self._last_spike is not None and spike <= self._last_spike + spikes.suspect
        self._retries = self._retries + 1 if again else 1
        self._last_spike = spike
        target = self._target(self.done)
        if target is None or self._retries > spikes.max_retries:
            why_stop = (
                f"there is no checkpoint to roll back to (save_every={self.save_every})"
                if target is None
                else f"it came back after {spikes.max_retries} rollbacks in a row, with the "
                f"learning rate scaled to {self.lr_scale:g}"
            )
            self.event("stopped", reason=why_stop)
            self.close()
            raise SpikeError(
                f"Logbook: a loss spike at step {spike} ({why}), and {why_stop}. The run "
                f"stops rather than loop. Look at {self.folder / LOGBOOK}; resume from "
                "a checkpoint with a lower learning rate, other data, or looser Spikes options"
            )
        step, path = target
        first, last = step + self.offset, self.done + self.offset  # batches from there to here
        self._restore(load_checkpoint(path, self.model, self.optimizer), resume=False)
        self._trusted = step
        self.offset += last + 1 - first
        self._backoff = (self.lr_scale * spikes.lr_backoff, spike)
        self.event("rollback", to_step=step, checkpoint=path.name, retry=self._retries)
        self.event("skipped", positions=[first, last + 1], batches=last + 1 - first)
        self.event("lr_scale", scale=self.lr_scale)
        self._save(replace=path)  # the target now carries the new position and scale
        if self._mesh.rank == 0:
            for later, later_path in _saved(self.checkpoints):
                if later > step:  # saved within the bad path: never resume from it
                    delete_checkpoint(later_path, "Logbook")

    def _target(self, before: int) -> tuple[int, Path] | None:
        """Where a spike in step ``before + 1`` rolls back to: the newest checkpoint at least
        ``suspect`` steps before it, or the previous rollback's target (its weights trained
        on without a spike once already: a spike right after it is the data's fault), else
        the oldest checkpoint kept."""
        saved = _saved(self.checkpoints) if self.save_every else []
        fit = [(s, p) for s, p in saved if s <= before - self.spikes.suspect or s == self._trusted]
        return fit[-1] if fit else (saved[0] if saved else None)

    # checkpoints -------------------------------------------------------------------------

    def _state(self) -> dict[str, Any]:
        return {
            "done": self.done,
            "offset": self.offset,
            "backoff": list(self._backoff),
            "retries": self._retries,
            "last_spike": -1 if self._last_spike is None else self._last_spike,
            "trusted": self._trusted,
            "history": self._check.state(),
        }

    def _restore(self, extra: dict[str, Any], resume: bool) -> None:
        """Take the step, the spike history and ``stateful`` from a checkpoint's ``extra``;
        on resume also where the data is and how the learning rate is scaled (a rollback
        keeps what it has learnt about the data instead)."""
        for name, obj in self.stateful.items():
            obj.load_state_dict(extra["stateful"][name])
        book = extra["logbook"]
        self.done = self._saved_at = book["done"]
        self._check.load(book["history"])
        if resume:
            self.offset, self._backoff = book["offset"], tuple(book["backoff"])
            self._retries = book["retries"]
            self._last_spike = None if book["last_spike"] < 0 else book["last_spike"]
            self._trusted = book["trusted"]

    def _save(self, replace: Path | None = None) -> None:
        self._settle()
        path = replace or self.checkpoints / f"step-{self.done:08d}"
        saved = save_checkpoint(
            path,
            self.model,
            self.optimizer,
            blocking=self.blocking_saves,
            logbook=self._state(),
            stateful={name: obj.state_dict() for name, obj in self.stateful.items()},
        )
        self._saved_at = self.done
        if isinstance(saved, PendingSave):
            self._pending = saved
        else:
            self._prune(path)
        if replace is None:
            self.event("checkpoint", checkpoint=path.name)

    def _settle(self) -> None:
        """Wait for the save being written, then prune; raises its error on every rank."""
        pending, self._pending = self._pending, None
        if pending is not None:
            self._prune(pending.wait())

    def _prune(self, path: Path) -> None:
        """Delete checkpoints beyond ``keep_last`` and the rollback target, but ``path``."""
        if self._mesh.rank == 0:
            saved = [p for _, p in _saved(self.checkpoints)]
            keep = set(saved[-self.keep_last :])
            target = self._target(self.done)  # where a spike in the next step would go
            keep |= {target[1]} if target else set()
            for old in saved:
                if old not in keep and old != path:
                    delete_checkpoint(old, "Logbook")

    # communication and files -------------------------------------------------------------

    def _gather(self, mine: Tensor) -> Tensor:
        group = self._mesh.control
        if group is None:
            return mine[None]
        every = torch.zeros(group_size(group), *mine.shape, dtype=torch.float64)
        every[group_rank(group)] = mine
        every = every.to(self._mesh.control_device)
        dist.all_reduce(every, group=group)  # a gather: every other row is zero
        return every.cpu()

    def _gather_object(self, mine: list[int]) -> list[list[int]]:
        group = self._mesh.control
        if group is None:
            return [mine]
        out: list[Any] = [None] * group_size(group)
        dist.all_gather_object(out, mine, group=group)
        return out

    def _write(self, record: dict[str, Any]) -> None:
        if self._file is not None:
            record["time"] = round(time.time(), 3)
            self._file.write(runlog.dumps(record) + "\n")
            self._file.flush()


def _check_int(name: str, value: object, least: int, rule: str) -> None:
    """Raise unless ``value`` is an int (not a bool) of at least ``least``."""
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise ValueError(f"Logbook: {name} must be {rule}, an int; got {value!r}")


def _saved(folder: Path) -> list[tuple[int, Path]]:
    """The completed checkpoints in ``folder`` named ``step-N``, oldest first (folders of
    shardwrap's: a link or anything else there is someone else's, and left alone)."""
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = _CHECKPOINT.fullmatch(child.name)
        if match and metadata_of(child) is not None:
            found.append((int(match.group(1)), child))
    return sorted(found)


def _drop_torn_line(path: Path) -> None:
    """Cut off a last line left unfinished by a run that was killed while writing it (no
    reader takes it), so that what a resumed run appends starts on a line of its own."""
    if not path.is_file():
        return
    with open(path, "r+b") as f:
        end = f.seek(0, 2)
        f.seek(max(0, end - 1))
        if f.read(1) in (b"", b"\n"):  # empty, or the last line is whole
            return
        while end > 0:  # back from the end, a block at a time, to the last newline
            start = max(0, end - 65536)
            f.seek(start)
            cut = f.read(end - start).rfind(b"\n")
            if cut >= 0:
                f.truncate(start + cut + 1)
                return
            end = start
        f.truncate(0)


def _peak_memory() -> int:
    """This rank's peak memory so far: allocated on CUDA, else the resident-set high-water."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return torch.cuda.max_memory_allocated()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024
