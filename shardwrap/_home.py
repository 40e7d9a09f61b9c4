"""Where a flat group's shard lives between uses (its home), apart from where it computes.

Design note. Two devices meet in every flat group: the compute device, where gathered
parameters, flat gradients and collectives are, and the shard's home, where the fp32 shard,
its reduced gradient and so the optimizer state live. Every site that allocates, gathers or
lands a gradient asks the group's :class:`Home` rather than deciding itself:

1. :class:`Home` (no offload, or the disk tier on a CPU device): the home is the compute
   device. A gather reads the shard in place; a reduced gradient stays where it landed.
2. :class:`HostHome` (``Offload(device="cpu")`` with a CUDA device):
   shards and their gradients in pinned host memory, so the optimizer makes its state there
   and steps on the CPU. A gather first *stages* the shard: a host-to-device copy on a side
   stream into a device tensor of its own, issued when the unit before it is gathered
   (:meth:`HostHome.read_ahead`; with prefetch, while the unit two before computes), so the
   compute stream, which waits for the copy where the all-gather is issued, finds it done.
   The staged copy is a tensor apart, not a slot of the gathered buffer, because a pooled
   buffer may still be read by the previous unit's kernels on the compute stream; copying
   into it would have to wait for them. The all-gather then reads the staged copy, casting
   into its slot of the buffer on the device under mixed precision: the host does no pass
   over the shard, and the copy stays asynchronous (a cast on the host would go through an
   unpinned temporary). The price is fp32 bytes over the bus rather than half of them. A
   reduced gradient is cast to the shard's dtype on the device and copied device-to-host on
   a second side stream, into a pinned buffer kept per group; the copies are waited for at
   the end of backward, before ``.grad`` is set.

A gradient buffer kept per group (this pinned buffer, the disk tier's gradient file) takes a
backward's gradient only while nothing holds it: a ``.grad`` still set, or one a user kept
past ``zero_grad()``, which reusing the buffer would overwrite (its storage's reference count
tells, :meth:`FlatGroup.free_home_grad`); otherwise that backward lands in a new tensor.

Host writes to a shard (the optimizer step, loads, ``gathered(writeback=True)``) must not race
a staged copy still reading it: :meth:`Home.quiesce` waits for every copy in flight, and runs
before each of them (the step pre-hook of each optimizer over the shards, ``_optimizers.py``;
the end of backward; the root's checks before a call).
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import NamedTuple

import torch
from torch import Tensor

from ._offload import Offload

__all__ = ["HostHome", "Home", "make_home"]


class Home:
    """Shards at home on the compute device: gathers read them in place, nothing is copied.

    Args:
        device: the compute device.
    """

    staged = False  # whether a gather copies the shard to the compute device first

    def __init__(self, device: torch.device) -> None:
        self.device = device  # where compute runs
        self.memory = device  # where shards, their gradients and the optimizer state live

    def tensor(self, numel: int, dtype: torch.dtype) -> Tensor:
        """A new 1-D tensor of zeros in the home's memory."""
        return torch.zeros(numel, dtype=dtype, device=self.memory)

    def read_ahead(self, shards: Iterable[Tensor]) -> None:
        """Start moving these shards to the compute device (they are gathered next)."""

    def gather_input(self, shard: Tensor) -> Tensor:  # 1-D, padded/N, on the device
        """``shard`` on the compute device, as the all-gather's input."""
        return shard

    def land(self, out: Tensor, buffer: Tensor | None, dtype: torch.dtype) -> Tensor:
        """A reduced shard gradient (on the compute device) as it is kept: here, as it is.

        ``buffer``: a gradient buffer kept in the home that may take it (or ``None``);
        ``dtype``: the shard's.
        """
        return out

    def quiesce(self) -> None:
        """Wait for every copy in flight between the home and the compute device."""

    def close(self) -> None:
        """The model is being freed."""


class _Staged(NamedTuple):
    """A shard copied to the compute device: the copy, the shard's version it holds, and the
    event the copy's stream records when done (``None`` on a CPU device)."""

    tensor: Tensor  # 1-D, padded/N, shard dtype, on the compute device
    version: int
    done: torch.cuda.Event | None


class HostHome(Home):
    """The host tier: shards and their gradients in host memory, staged to the compute device.

    Args:
        device: the compute device; on CUDA the host memory is pinned and copies run on side
            streams; on a CPU device (which :func:`make_home` never chooses; the tests build
            one to cover the logic) they are unpinned, and the copies plain.
    """

    staged = True

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.memory = torch.device("cpu")
        cuda = device.type == "cuda"
        self._pinned = cuda
        self._up = torch.cuda.Stream(device) if cuda else None  # host -> device copies
        self._down = torch.cuda.Stream(device) if cuda else None  # device -> host copies
        self._staged: dict[int, _Staged] = {}  # id(shard) -> its copy, not yet used
        self._closed = False

    def tensor(self, numel: int, dtype: torch.dtype) -> Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=self._pinned).zero_()

    def read_ahead(self, shards: Iterable[Tensor]) -> None:
        for shard in shards:
            staged = self._staged.get(id(shard))
            if staged is None or staged.version != shard._version:
                self._staged[id(shard)] = self._stage(shard)

    def _stage(self, shard: Tensor) -> _Staged:
        if self._up is None:
            return _Staged(shard.clone(), shard._version, None)
        with torch.cuda.stream(self._up):
            copy = torch.empty(shard.shape, dtype=shard.dtype, device=self.device)
            copy.copy_(shard, non_blocking=True)
            done = self._up.record_event()
        return _Staged(copy, shard._version, done)

    def gather_input(self, shard: Tensor) -> Tensor:
        staged = self._staged.pop(id(shard), None)
        if staged is None or staged.version != shard._version:
            staged = self._stage(shard)
        if staged.done is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(staged.done)
            staged.tensor.record_stream(current)  # made on the copy stream, used on this one
        return staged.tensor

    def land(self, out: Tensor, buffer: Tensor | None, dtype: torch.dtype) -> Tensor:
        """``out`` in the shard's ``dtype`` (cast on the device), copied into ``buffer``, the
        group's pinned gradient buffer, or a new one where ``buffer`` is ``None`` (``.grad``
        or anything else holds it)."""
        home = buffer if buffer is not None else self.tensor(out.numel(), dtype)
        src = out.to(dtype)
        if self._down is None:
            home.copy_(src)
            return home
        self._down.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._down):
            home.copy_(src, non_blocking=True)
        src.record_stream(self._down)
        return home

    def quiesce(self) -> None:
        if self._up is not None and self._down is not None:
            self._up.synchronize()
            self._down.synchronize()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._staged.clear()


def make_home(offload: Offload | None, device: torch.device) -> Home:
    """The home the offload options and the compute device call for.

    1. ``Offload(device="cpu")`` with a CUDA device: :class:`HostHome`.
    2. ``Offload(device="cpu")`` with a CPU device: the state is in host memory already, so
       :class:`Home`, with a warning that the tier changes nothing.
    3. Anything else (no offload; the disk tier, whose files are mapped into host memory on a
       CPU device): :class:`Home`.
    """
    if offload is None or offload.device != "cpu":
        return Home(device)
    if device.type == "cuda":
        return HostHome(device)
    warnings.warn(
        'Offload(device="cpu") with a CPU compute device changes nothing: the state is in '
        "host memory already. Use it with a GPU, or the disk tier for a model larger than "
        "memory.",
        stacklevel=3,
    )
    return Home(device)
