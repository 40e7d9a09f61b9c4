"""Run N ranks as threads of this process, each with its own real gloo process group.

This is the fast test tier (``tests.support.ranks`` is this module), and how
``benchmarks/estimate.py`` measures its ranks: a world-size-2 run costs milliseconds instead of
the seconds it takes to spawn a process per rank. Each run gets a fresh in-memory store and
gloo listens on ephemeral loopback ports, so runs share no state and need no free port.

What the ranks do share, being threads of one process:

- The default RNG. ``torch.manual_seed`` in one rank reseeds all of them and concurrent draws
  interleave, so ranks seeding and building "the same" model get different weights. Build models
  before ``run_ranks`` and ``copy.deepcopy`` them in ``fn``, or draw from a ``torch.Generator``.
- Other process-wide torch settings (``torch.set_num_threads``, default dtype). Grad mode and
  autograd are per thread: CPU backward runs on the thread that calls it, so each rank's hooks
  and their collectives run on that rank's thread.
- torch's cache of each op's Python object, which it fills the first time a dispatch mode
  meets the op: two ranks' modes (a tracker, ``torch.compile``'s fake tensors) meeting one at
  once could leave it holding a freed object. The first ``run_ranks`` of a process makes
  every registered op's object before its ranks start (``shardwrap/planning/python_ops.py``).
- The default generator's lock. ``torch.get_rng_state()`` (activation checkpointing's, on
  every checkpointed forward) holds it while it makes the state's Python object, which may
  run the garbage collector, whose Python callbacks may yield the interpreter lock to another
  rank, which then waits for the generator's lock holding the interpreter's: both ranks
  stopped for good (seen once, in a `make test` run). The first ``run_ranks`` of a
  process has ``torch.get_rng_state`` and ``set_rng_state`` take a Python lock first, which a
  waiting rank waits for without the interpreter's. Ranks in processes share no generator.

The group is not registered in ``torch.distributed``'s default world, which tests never
initialise: call ``pg.rank()`` and ``pg.size()`` (``dist.get_rank(pg)`` raises), and pass
``group_src=`` rather than ``src=`` to ``dist.broadcast``. Functional collectives
(``torch.distributed._functional_collectives``) work: each group is registered under a unique
name for the duration of its rank.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Generic, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _register_process_group, _unregister_process_group
from torch.distributed import ProcessGroup

from shardwrap.planning.python_ops import resolve_python_ops

__all__ = ["make_gloo_group", "run_ranks", "subgroup"]

T = TypeVar("T")

# Ranks share this machine's cores; intra-op threads per rank would only oversubscribe them.
torch.set_num_threads(1)


def make_gloo_group(
    store: dist.Store, rank: int, world_size: int, timeout: timedelta
) -> ProcessGroup:
    """Create a gloo process group without touching ``torch.distributed``'s global state.

    Blocks until all ``world_size`` ranks sharing ``store`` have called it.

    Args:
        store: Rendezvous store, private to this group.
        rank: This rank, in ``[0, world_size)``.
        world_size: Number of ranks in the group.
        timeout: Limit for the rendezvous and for every collective; past it they raise.

    Returns:
        A process group whose CPU backend is gloo over loopback.
    """
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    # Loopback, not the default device, which depends on how the hostname resolves.
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    backend = dist.ProcessGroupGloo(store, rank, world_size, options)
    pg = dist.ProcessGroup(store, rank, world_size)
    pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
    pg._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, backend)
    return pg


# The store and the open groups of each run, by the run's id (the first part of its groups'
# names): subgroup() rendezvous through the store and keeps its group with the run's.
_RUNS: dict[str, tuple[dist.Store, list[ProcessGroup]]] = {}
_PREPARED = False  # the ops resolved and the RNG state serialised: see "What the ranks do share"


def subgroup(pg: ProcessGroup, ranks: list[int], name: str) -> ProcessGroup:
    """A gloo group over ``ranks`` (ranks of ``pg``, which must include this one).

    Every rank in ``ranks`` must call it with the same ``ranks`` and ``name``; ``name`` tells
    apart the groups one rank makes. The group stays open until every rank of the run is done,
    like the run's own groups: a rank that returned first must not cut off a peer still joining.
    """
    base, groups = _RUNS[pg.group_name.split("/")[0]]
    store = dist.PrefixStore(f"{name}/{'-'.join(map(str, ranks))}", base)
    store.set_timeout(base.timeout)
    group = make_gloo_group(store, ranks.index(pg.rank()), len(ranks), base.timeout)
    groups.append(group)
    return group


@dataclass
class _Run(Generic[T]):
    """What the rank threads of one ``run_ranks`` call report back."""

    results: dict[int, T] = field(default_factory=dict)
    failures: dict[int, tuple[float, str]] = field(default_factory=dict)  # rank: (time, traceback)
    groups: list[ProcessGroup] = field(default_factory=list)  # kept open until every rank is done


def _rank_main(
    run: _Run[T],
    rank: int,
    world_size: int,
    store: dist.Store,
    timeout: timedelta,
    group_name: str,
    fn: Callable[[int, ProcessGroup], T],
) -> None:
    pg: ProcessGroup | None = None
    try:
        pg = make_gloo_group(store, rank, world_size, timeout)
        pg._set_group_name(group_name)
        _register_process_group(group_name, pg)
        try:
            run.results[rank] = fn(rank, pg)
            # A finished rank keeps its sockets open until every rank is done: closing them
            # early could cut peers off from data still in flight to them.
            run.groups.append(pg)
        finally:
            _unregister_process_group(group_name)
    except BaseException:
        run.failures[rank] = (time.monotonic(), traceback.format_exc())
    else:
        return
    # A failed rank closes its sockets now, so that peers blocked on it fail at once with
    # "Connection reset by peer" instead of at the timeout. The group may sit in a reference
    # cycle (e.g. a module whose hooks hold it), hence the collection.
    del pg
    gc.collect()


def _report(
    world_size: int,
    timeout: float,
    failures: dict[int, tuple[float, str]],
    hung: dict[int, str],
) -> str:
    summary = [f"{len(failures)} of {world_size} ranks failed"] if failures else []
    if hung:
        summary.append(f"{len(hung)} still running after {timeout:g} s")
    sections = [f"run_ranks(world_size={world_size}): {', '.join(summary)}"]
    ordered = sorted(failures, key=lambda rank: failures[rank][0])
    for i, rank in enumerate(ordered):
        first = " (first to fail)" if i == 0 and len(ordered) > 1 else ""
        sections.append(f"--- rank {rank} failed{first} ---\n{failures[rank][1]}")
    for rank, stack in hung.items():
        sections.append(f"--- rank {rank} hung; its stack at the timeout ---\n{stack}")
    return "\n".join(sections)


def _serialize_rng_state() -> None:
    """Have ``torch.get_rng_state`` and ``set_rng_state`` (and ``torch.random``'s) take one
    Python lock around the generator's (see the module's note)."""
    lock = threading.Lock()
    for name in ("get_rng_state", "set_rng_state"):
        original = getattr(torch.random, name)

        def serialized(*args: object, _original: Callable[..., object] = original) -> object:
            with lock:
                return _original(*args)

        setattr(torch.random, name, serialized)
        setattr(torch, name, serialized)


def run_ranks(
    world_size: int, fn: Callable[[int, ProcessGroup], T], *, timeout: float = 60.0
) -> list[T]:
    """Run ``fn(rank, pg)`` on ``world_size`` ranks, one thread each, and collect the results.

    Failure semantics:

    - Any rank raising: one ``AssertionError`` carrying the full traceback of every failing rank,
      the first to fail marked (later failures are often its consequences).
    - A collective that cannot complete raises in its rank after ``timeout / 2`` (gloo's own
      timeout), so it is reported with its traceback.
    - A rank still running after ``timeout`` is reported with its current stack; its daemon
      thread is abandoned, so the test suite never hangs.

    Args:
        world_size: Number of ranks, at least 1.
        fn: Body of one rank; gets its rank and its own gloo group.
        timeout: Seconds the whole run may take.

    Returns:
        ``fn``'s return values, indexed by rank.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    global _PREPARED
    if not _PREPARED:
        resolve_python_ops()
        _serialize_rng_state()
        _PREPARED = True
    collective_timeout = timedelta(seconds=timeout / 2)
    store = dist.HashStore()
    store.set_timeout(collective_timeout)
    run: _Run[T] = _Run()
    run_id = uuid.uuid4().hex
    _RUNS[run_id] = (store, run.groups)
    threads = [
        threading.Thread(
            target=_rank_main,
            args=(run, rank, world_size, store, collective_timeout, f"{run_id}/{rank}", fn),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    del _RUNS[run_id]
    frames = sys._current_frames()
    hung = {
        rank: "".join(traceback.format_stack(frames[thread.ident]))
        if thread.ident in frames
        else "(finished while being inspected)\n"
        for rank, thread in enumerate(threads)
        if thread.is_alive()
    }
    if run.failures or hung:
        raise AssertionError(_report(world_size, timeout, dict(run.failures), hung))
    return [run.results[rank] for rank in range(world_size)]
