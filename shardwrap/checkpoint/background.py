"""Non-blocking saves: a snapshot in host memory, written by a thread while training goes on.

Design note. ``save_checkpoint(..., blocking=False)`` splits a save in two:

1. On the calling thread, at the call: the checks and the first agreement of the blocking save
   (so a bad path or optimizer raises on every rank before anything is written), then a
   snapshot of everything the checkpoint holds: this rank's shards and optimizer state copied
   into a host buffer kept for the model's next save (on a GPU pinned, filled on a side stream
   that the compute stream then waits for before it may change them), the optimizer's scalars and
   hyperparameters, the buffers (rank 0) and ``extra``, already serialised. From then on
   training changes nothing of what is saved.
2. On a background thread: the same files, checksums, agreements and atomic commit as the
   blocking save, from the snapshot, at a lower CPU priority (nice 10 on Linux) so that it
   takes the cores training leaves idle rather than turns with the training thread.

The agreements of step 2 cannot use the model's control group: gloo (and NCCL) match
collectives by their order on a group, so an all-reduce issued from the writer thread while
the training loop issues its own on the same group would pair with the wrong peer call, or
hang. They run on a **writer group** of their own, a gloo group over the control group's ranks
(:func:`writer_group`), created once per control group on the calling thread at the first
non-blocking save, where every rank is. This was chosen over agreeing at the next save or
``wait()`` on the main thread because the checkpoint is then complete, and ``latest`` points
at it, as soon as every rank has written it: a run that crashes between two saves still has
the last one. The cost is one more gloo group (a few sockets per rank, no memory to speak of).

Every rank's writer reaches the same outcome (the agreement makes a failure anywhere a failure
everywhere), and a failure is raised by :meth:`PendingSave.wait` on each rank that calls it.
The next save, called on every rank, agrees on it first (:func:`raise_unseen`): where any rank
has not had the error raised by ``wait()``, it raises on every rank and saves nothing, so the
ranks never part ways over who saw an error (one rank raising while the others go on to the
save's collectives, which then pair with the wrong calls). Starting a save agrees too: the
writer group and the writer thread are made inside an agreement, so a rank that cannot make
them (out of memory) fails the save on every rank. One save per control group is in flight at
a time (the writer group serves one at a time, in the order every rank started them): the
next, of any model on those ranks, waits.

At interpreter exit (the main thread ended, or an error ended the program on every rank or on
one), pending writes are waited for before anything else shardwrap does at exit, in particular
before the model's groups are released (``comm/mesh.py``): each rank's writer then completes
the save with its peers' and the checkpoint is committed once, or the writers agree that it
failed and it is abandoned, ``latest`` and the checkpoints before it untouched. Each rank says
on stderr which of the two happened, and what ``latest`` names then. A save that failed before
the exit without any ``wait()`` or later save raising its error is reported there too. A process
killed meanwhile leaves at most a hidden ``.NAME.partial`` folder, never a checkpoint marked
complete or pointed at by ``latest``.
"""

from __future__ import annotations

import atexit
import copy
import dataclasses
import os
import sys
import threading
import weakref
from collections.abc import Callable
from contextlib import suppress
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from ..comm.collectives import group_rank, group_size
from ..comm.failures import Group, group_timeout
from .files import LATEST, PeerFailed, PeerOSError, agree
from .format import latest_checkpoint
from .optimizer_state import OptimizerPlan

__all__ = [
    "PendingSave",
    "await_writes",
    "begin",
    "forget_writer_group",
    "previous_save",
    "raise_unseen",
    "snapshot",
    "snapshot_plans",
    "writer_group",
]

_ALIGN = 64  # bytes: every piece of a host snapshot starts aligned for any dtype
_WRITER_TIMEOUT = timedelta(minutes=30)  # where the control group's timeout cannot be read
_WRITER_NICE = 10  # the writer thread's nice value on Linux (training's is usually 0)


class PendingSave:
    """A checkpoint being written in the background by ``save_checkpoint(..., blocking=False)``.

    Attributes:
        path: the checkpoint folder the save creates.

    Its thread starts at once but writes only after :meth:`go` (every rank started one), or
    ends without writing after :meth:`cancel`.
    """

    def __init__(self, path: Path, rank: int, write: Callable[[], None]) -> None:
        self.path = path
        self._rank = rank  # among every rank of the model, for what it says at exit
        self._error: BaseException | None = None
        self._raised = False
        self._go = threading.Event()
        self._cancelled = False
        self._thread = threading.Thread(
            target=self._run, args=(write,), name=f"shardwrap save {path.name}", daemon=True
        )
        _wait_first_at_exit()
        self._thread.start()

    def go(self) -> None:
        """Let the writer write: every rank has started its own."""
        _PENDING.add(self)
        self._go.set()

    def cancel(self) -> None:
        """End the writer without writing: some rank could not start its own."""
        self._cancelled = True
        self._go.set()
        self._thread.join()

    def _run(self, write: Callable[[], None]) -> None:
        self._go.wait()
        if self._cancelled:
            return
        try:
            _yield_to_training()
            write()
        except BaseException as e:  # kept for wait() or the next save, on the caller's thread
            self._error = e
        finally:
            _PENDING.discard(self)

    def done(self) -> bool:
        """Whether the write has ended, successfully or not (:meth:`wait` says which)."""
        return not self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> Path:
        """Block until the checkpoint is complete and ``latest`` points at it.

        Args:
            timeout: seconds to wait at most; ``None``: until the write ends.

        Returns:
            ``path``, the complete checkpoint.

        Raises:
            TimeoutError: the write is still running after ``timeout`` seconds.
            Exception: the write's error, on every rank alike (every rank's writer agrees on
                the outcome): what the blocking save would have raised, e.g. ``OSError`` for a
                full disk. Nothing of the failed checkpoint is kept; ``latest`` and the
                checkpoints before it are as they were.
        """
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise TimeoutError(f"save_checkpoint: {self.path} is still being written")
        if self._error is not None:
            self._raised = True
            raise self._error
        return self.path

    def __repr__(self) -> str:
        state = "writing" if not self.done() else "failed" if self._error else "complete"
        return f"PendingSave({str(self.path)!r}, {state})"


def _yield_to_training() -> None:
    """Lower this writer thread's CPU priority (Linux, where a thread's id takes a nice value):
    it then runs on the cores training leaves idle (waiting for collectives, for the GPU)
    rather than taking turns with the training thread. Elsewhere it keeps its priority."""
    if sys.platform == "linux":
        with suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _WRITER_NICE)


# one save in flight per writer group ---------------------------------------------------

_IN_FLIGHT: weakref.WeakKeyDictionary[object, PendingSave] = weakref.WeakKeyDictionary()
_PENDING: set[PendingSave] = set()


def previous_save(writers: object) -> PendingSave | None:
    """The last non-blocking save over ``writers`` (a control group, whose writer group one
    save at a time uses; a model's root at world size 1), ended, and no longer in flight: every
    rank of those ranks gets the same one, as every rank started it."""
    previous = _IN_FLIGHT.pop(writers, None)
    if previous is not None:
        previous._thread.join()
    return previous


def begin(writers: object, pending: PendingSave) -> None:
    """Make ``pending`` the save in flight over ``writers`` and let it write."""
    _IN_FLIGHT[writers] = pending
    pending.go()


def raise_unseen(
    previous: PendingSave, group: Group, device: torch.device | None, caller: str
) -> None:
    """Raise the failure of the ``previous`` save on every rank alike, unless it succeeded or
    ``wait()`` raised it on every rank already. Call on every rank: its writers agreed on the
    outcome, so every rank knows whether it failed.

    Raises:
        Exception: on a rank where no ``wait()`` raised it, the previous save's own error;
            elsewhere a ``RuntimeError`` naming those ranks and the fix.
    """
    if previous._error is None:
        return

    def unseen() -> int:
        if previous._raised:
            return 0
        previous._raised = True
        error = previous._error
        if not isinstance(error, Exception):  # a BaseException stays with its thread
            error = RuntimeError(f"the writer thread ended with {error!r}")
        error.add_note(
            f"{caller} raises it: the background save to {previous.path} failed on every rank "
            "and no pending.wait() on this rank raised it; nothing of this save was written. "
            "Call pending.wait() on every rank to see such errors where they happen."
        )
        raise error

    seen_here = previous._raised
    try:
        agree(group, device, caller, unseen)
    except (PeerFailed, PeerOSError) as e:
        if not seen_here:  # this rank's own error: the previous save's, raised by unseen()
            raise
        raise RuntimeError(
            f"{caller}: the background save to {previous.path} failed on every rank; "
            f"pending.wait() raised its error on this rank, but not on rank(s) "
            f"{sorted(e.errnos)}, where this save raises it now. So no rank saves: call "
            "pending.wait() on every rank (it raises the same failure on each), then save again"
        ) from e


def await_writes(writers: object) -> None:
    """Wait for the save still in flight over ``writers``, if any, leaving its error for
    :meth:`PendingSave.wait` or the next save: a load, an export or a save then sees the files
    as that save left them (complete, ``latest`` moved, older ones pruned)."""
    pending = _IN_FLIGHT.get(writers)
    if pending is not None:
        pending._thread.join()


def _wait_at_exit() -> None:
    """Let every pending write end (commit or clean up) before the interpreter goes, say how
    each ended, then drop the writer groups while Python is whole (see ``comm/mesh.py``'s note
    on groups at exit)."""
    writing = list(_PENDING)
    for pending in {*writing, *_IN_FLIGHT.values()}:
        pending._thread.join()
        said = _said_at_exit(pending, pending in writing)
        if said:
            print(said, file=sys.stderr, flush=True)
    _WRITERS.clear()


def _said_at_exit(pending: PendingSave, writing: bool) -> str:
    """What this rank says at exit of ``pending``: a save still being written when the program
    ended (``writing``), or one whose failure nothing raised; else nothing."""
    who = f"shardwrap (rank {pending._rank})"
    if pending._error is None:
        if not writing:
            return ""
        return (
            f"{who}: the program ended while the checkpoint {pending.path} was being written; "
            f"it was completed first, and {_latest_now(pending.path)}."
        )
    if pending._raised:
        return ""
    when = "while the program ended" if writing else "and no wait() or later save raised it"
    return (
        f"{who}: the checkpoint save to {pending.path} failed {when}: {pending._error!r}. "
        f"It was abandoned on every rank: nothing of it was kept, and {_latest_now(pending.path)} "
        "(the checkpoints before it are as they were). Call pending.wait() before the program "
        "ends to see such errors where they happen."
    )


def _latest_now(path: Path) -> str:
    """What ``path.parent/latest`` names now, for a message."""
    try:
        latest = latest_checkpoint(path.parent)
    except (OSError, ValueError) as e:
        return f"'{LATEST}' could not be read ({e})"
    if latest is None:
        return f"there is no '{LATEST}' in {path.parent}"
    return f"'{LATEST}' names {latest}"


def _wait_first_at_exit() -> None:
    """Have :func:`_wait_at_exit` run before every exit handler registered so far.

    NOTE: exit handlers run last registered first, and the mesh's release of its groups is
    registered when ``comm/mesh.py`` is first imported, which may come after this module: a
    writer must finish before it, or its save would outlive the groups it was started on.
    """
    atexit.unregister(_wait_at_exit)
    atexit.register(_wait_at_exit)


# the writer group --------------------------------------------------------------------

_WRITERS: weakref.WeakKeyDictionary[dist.ProcessGroup, dist.ProcessGroup] = (
    weakref.WeakKeyDictionary()
)
_ATTEMPTS: weakref.WeakKeyDictionary[dist.ProcessGroup, int] = weakref.WeakKeyDictionary()


def writer_group(control: Group) -> Group:
    """A gloo group over ``control``'s ranks for the writer threads' agreements (``None`` for
    world size 1), made once per control group. Call on every rank at the same point.

    It rendezvouses through ``control``'s own store under a key of its own, so it needs no
    registration with ``torch.distributed`` and takes ``control``'s timeout.
    """
    if control is None:
        return None
    group = _WRITERS.get(control)
    if group is not None:
        return group
    attempt = _ATTEMPTS.get(control, 0)  # keys of an attempt that failed somewhere are stale
    prefix = f"shardwrap/checkpoint-writer/{attempt}"
    store = dist.PrefixStore(prefix, control.get_group_store())
    options = dist.ProcessGroupGloo._Options()
    options._timeout = group_timeout(control) or _WRITER_TIMEOUT
    try:  # the interfaces the control group's gloo backend uses, if it has one
        options._devices = control._get_backend(torch.device("cpu")).options._devices
    except (RuntimeError, AttributeError):
        options._devices = [dist.ProcessGroupGloo.create_default_device()]
    rank, size = group_rank(control), group_size(control)
    backend = dist.ProcessGroupGloo(store, rank, size, options)
    group = dist.ProcessGroup(store, rank, size)
    group._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    group._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    _WRITERS[control] = group
    return group


def forget_writer_group(control: Group) -> None:
    """Drop ``control``'s writer group after a start that failed on some rank (every rank calls
    it): the next save makes a new one, under keys of its own."""
    if control is not None:
        _WRITERS.pop(control, None)
        _ATTEMPTS[control] = _ATTEMPTS.get(control, 0) + 1


# snapshots ---------------------------------------------------------------------------

_HOST: weakref.WeakKeyDictionary[object, Tensor] = weakref.WeakKeyDictionary()


def snapshot(root: object, tensors: list[Tensor]) -> tuple[list[Tensor], Callable[[], None]]:
    """Copies of ``tensors`` in host memory, and a function that waits until they are filled.

    The copies are views of one host buffer kept per model (``root``) and reused by its next
    save while large enough: a fresh buffer would cost its page faults at every save (about
    a third of the copy's time on a CPU), and on a GPU a pinned allocation.

    1. All on the CPU: copied at once.
    2. Any on a GPU: the buffer is pinned; the copies run on a side stream after the work
       queued so far, and the current stream waits for them before anything queued later
       (the optimizer's next step) may change the originals. The caller's thread does not wait.
    """
    cuda = next((t.device for t in tensors if t.is_cuda), None)
    sizes = [-(-t.numel() * t.element_size() // _ALIGN) * _ALIGN for t in tensors]
    host = _HOST.get(root)
    if host is None or host.numel() < sum(sizes) or host.is_pinned() != (cuda is not None):
        _HOST.pop(root, None)
        host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=cuda is not None)
        _HOST[root] = host
    views, at = [], 0
    for t, size in zip(tensors, sizes):
        views.append(host[at : at + t.numel() * t.element_size()].view(t.dtype).view(t.shape))
        at += size
    if cuda is None:
        for view, t in zip(views, tensors):
            view.copy_(t.detach())
        return views, _filled
    compute = torch.cuda.current_stream(cuda)
    side = torch.cuda.Stream(cuda)
    side.wait_stream(compute)
    with torch.cuda.stream(side):
        for view, t in zip(views, tensors):
            view.copy_(t.detach(), non_blocking=True)
    filled = side.record_event()
    compute.wait_event(filled)
    return views, filled.synchronize


def _filled() -> None:
    """A snapshot on the CPU: filled already."""


def snapshot_plans(plans: list[OptimizerPlan]) -> list[OptimizerPlan]:
    """``plans`` with their scalars (``step``) and hyperparameters copied, as of now: the
    optimizer updates its ``step`` tensors in place and a scheduler rewrites ``lr``. Their
    tensors are not copied: the caller snapshots those with :func:`snapshot`."""
    return [
        dataclasses.replace(
            plan,
            scalars={name: _copied(state) for name, state in plan.scalars.items()},
            groups=copy.deepcopy(plan.groups),
            packed=copy.deepcopy(plan.packed),  # how a low-bit state's parts go back together
        )
        for plan in plans
    ]


def _copied(state: dict[str, object]) -> dict[str, object]:
    return {k: v.detach().clone() if isinstance(v, Tensor) else v for k, v in state.items()}
