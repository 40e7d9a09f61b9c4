"""``track_allocations`` and the memory planner's mode, entered by ranks run as threads (the
test tier, ``benchmarks/estimate.py``): each rank's mode receives each op as the op itself, also
an op that both meet for the first time at once (``shardwrap/planning/python_ops.py``).
Run: ``pytest tests/planning/test_allocations.py``.
"""

from __future__ import annotations

import sys
import threading
import uuid
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from shardwrap import AllocationTracker
from shardwrap.planning.trace import LiveBytes

pytestmark = pytest.mark.stage3  # no stage involved: once is enough

OPS = 128
RANKS = 4


def recording(mode: type[TorchDispatchMode]) -> type[TorchDispatchMode]:
    """``mode``, keeping each op it receives in ``ops``."""

    class Recording(mode):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[Any] = []

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            self.ops.append(func)
            return super().__torch_dispatch__(func, types, args, kwargs)

    return Recording


# track_allocations' mode, and the memory planner's (estimate_memory)
@pytest.mark.parametrize("mode", [AllocationTracker, LiveBytes], ids=["tracker", "planner"])
def test_threads_meeting_new_ops_at_once_each_receive_the_op_itself(
    mode: type[TorchDispatchMode],
) -> None:
    # Ops no mode has met: a library defined here. The threads meet each op at once and
    # switch as often as Python lets them, so that several make its Python object unless it
    # is made before; a rank that fails breaks the barrier for the others.
    namespace = f"shardwrap_test_{uuid.uuid4().hex[:8]}"
    library = torch.library.Library(namespace, "DEF")
    names = [f"op{i}" for i in range(OPS)]
    for name in names:
        library.define(f"{name}(Tensor x) -> Tensor")
        library.impl(name, lambda x: x + 1, "CPU")
    trackers = [recording(mode)() for _ in range(RANKS)]
    meet = threading.Barrier(len(trackers), timeout=60)
    sums: list[float] = [0.0] * len(trackers)

    def rank(r: int) -> None:
        x = torch.zeros(3)
        with trackers[r]:
            for name in names:
                meet.wait()
                x = getattr(getattr(torch.ops, namespace), name)(x)
        sums[r] = x.sum().item()

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in range(len(trackers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    ops = [getattr(getattr(torch.ops, namespace), name).default for name in names]
    for tracker in trackers:
        received = [op for op in tracker.ops if op.namespace == namespace]
        assert len(received) == OPS
        others = [name for name, op, got in zip(names, ops, received) if got is not op]
        assert not others, f"received another object than the op itself for {others}"
    assert sums == [3.0 * OPS] * len(trackers)
