"""This rank's pieces as ``torch.distributed.checkpoint`` (DCP) takes them: the whole tensor's
shape, and the rectangles of it that the piece holds.

Design note. DCP saves and loads a sharded tensor through three methods it asks of it
(``__create_write_items__``, ``__create_chunk_list__``, ``__get_tensor_shard__``: what it
writes, what it reads, where each rectangle lives), and checks before a load that the tensor's
``size()`` is the saved one, the whole tensor's. A piece is the flat element range
``[start, stop)`` of the row-major whole tensor, which is at most ``2 * ndim - 1`` rectangles
(a partial first row, full rows, a partial last row, and so on down the dimensions), each a
contiguous run of the piece: so a save writes straight from the shard's memory and a load
writes straight into it, at any world size and from any layout (FSDP2's rows included).

A :class:`DCPPiece` is that view: shaped as the whole tensor, holding only the piece, and
refusing every operation but those DCP and its CPU staging perform (naming what it is), so it
never passes for the whole tensor. ``state_dict()`` keeps handing out :class:`ShardPiece`\\ s,
shaped as the piece, for everything else; only a state dict that DCP asks for is shown this way.
A shape-aware optimizer's state (Muon, Adafactor) is whole on its owner: one rectangle there,
and the same names on every other rank as empty pieces (:func:`owned_elsewhere`). Asked for
``full_state_dict=True``, the hooks hand out the whole tensors instead, on the CPU, gathered as
``model.full_state_dict()`` and ``shardwrap.full_optimizer_state_dict`` gather them.

HACK: a module's or an optimizer's ``state_dict()`` is not told who calls it, and DCP's
state-dict functions (``get_model_state_dict``, ``get_optimizer_state_dict``, and
``dcp.save``/``dcp.load`` of a model or optimizer given as it is) call the plain one. So the
state-dict hooks read a few caller frames (:func:`dcp_call`) for those functions, and their
options (``full_state_dict``), as DCP passes them down.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import math
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import CodeType
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ...comm.collectives import all_reduce, group_rank, group_size
from .callers import caller_frame
from .save_guard import guard_torch_save

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import WriteItem

__all__ = [
    "DCPCall",
    "DCPPiece",
    "dcp_call",
    "dcp_filling_empty_state",
    "full_optimizer_state",
    "local_piece",
    "local_pieces",
    "owned_elsewhere",
    "refuse_tensor_parallel",
    "register_full_optimizer_state",
    "row_major_chunks",
    "serving",
]

Chunk = tuple[tuple[int, ...], tuple[int, ...], int]  # offsets, sizes, first flat element


def row_major_chunks(shape: Sequence[int], start: int, stop: int) -> list[Chunk]:
    """The rectangles that make up elements ``[start, stop)`` of a row-major tensor of
    ``shape``, in order: at most ``2 * len(shape) - 1``, none for an empty range. A tensor of
    no elements is one empty rectangle, held alike by every rank."""
    shape = tuple(shape)
    if math.prod(shape) == 0:
        return [((0,) * len(shape), shape, 0)]
    if not shape:
        return [((), (), 0)] if start < stop else []
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    chunks: list[Chunk] = []

    def cover(dim: int, prefix: tuple[int, ...], base: int, lo: int, hi: int) -> None:
        # elements [lo, hi) of the block shape[dim:] at offsets ``prefix``, flat index ``base``
        inner, rest = strides[dim], shape[dim + 1 :]
        first, last = -(-lo // inner), hi // inner  # the whole rows [first, last)
        if first > last:  # inside one row, touching neither of its ends
            row = lo // inner
            cover(dim + 1, (*prefix, row), base + row * inner, lo - row * inner, hi - row * inner)
            return
        if lo < first * inner:
            row = first - 1
            cover(dim + 1, (*prefix, row), base + row * inner, lo - row * inner, inner)
        if last > first:
            offsets = (*prefix, first, *(0,) * len(rest))
            sizes = (*(1,) * len(prefix), last - first, *rest)
            chunks.append((offsets, sizes, base + first * inner))
        if hi > last * inner:
            cover(dim + 1, (*prefix, last), base + last * inner, 0, hi - last * inner)

    if start < stop:
        cover(0, (), 0, start, stop)
    return chunks


def _refusal(piece: DCPPiece, what: str, error: type[Exception] = RuntimeError) -> Exception:
    # RuntimeError by default: torch turns a TypeError of ``piece + 1`` into NotImplemented,
    # and Python's own message would not say what the piece is
    return error(
        f"shardwrap: {what} this rank's piece (elements {piece.start}:{piece.stop}) of a sharded "
        f"tensor of shape {tuple(piece.full_shape)}, as torch.distributed.checkpoint takes it "
        "(get_model_state_dict, get_optimizer_state_dict): only DCP's save, load and staging "
        "read it. For the whole tensor pass options=StateDictOptions(full_state_dict=True), or "
        "call model.full_state_dict() / shardwrap.full_optimizer_state_dict(model, optimizer) "
        "on every rank. See docs/dcp.md."
    )


class DCPPiece(Tensor):
    """This rank's piece of a sharded tensor, shaped as the whole tensor for DCP (see the
    module's note).

    Attributes:
        local: the piece itself (the shard's or the optimizer state's memory, not a copy).
        full_shape: the whole tensor's shape, and this tensor's.
        start, stop: the elements ``[start, stop)`` of the flattened whole tensor held here.
    """

    local: Tensor
    full_shape: torch.Size
    start: int
    stop: int

    @staticmethod
    def __new__(cls, local: Tensor, full_shape: Sequence[int], start: int, stop: int) -> DCPPiece:
        guard_torch_save(cls)
        piece = Tensor._make_wrapper_subclass(
            cls, tuple(full_shape), dtype=local.dtype, device=local.device
        )
        piece.local, piece.full_shape = local, torch.Size(full_shape)
        piece.start, piece.stop = start, stop
        return piece

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(
        cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        """What DCP's CPU staging does to a state dict's tensors (``async_save``): an empty
        tensor like it (``new_empty``, ``zeros_like``: a piece of the same range), a copy into
        it from another piece of the same range, a move (``.to()``) and ``detach``. Anything
        else raises: a piece is not the whole tensor its shape says."""
        kwargs = kwargs or {}
        aten = torch.ops.aten
        piece = args[0]
        if func in (aten.detach.default, aten.alias.default):
            return piece._like(piece.local.detach())
        if func in (aten.new_empty.default, aten.zeros_like.default, aten.empty_like.default):
            device = kwargs.get("device") or piece.local.device
            dtype = kwargs.get("dtype") or piece.local.dtype
            return piece._like(torch.zeros_like(piece.local, device=device, dtype=dtype))
        if func is aten._to_copy.default:
            return piece._like(func(piece.local, **kwargs))
        if func is aten.copy_.default and isinstance(args[1], DCPPiece) and piece._same(args[1]):
            piece.local.copy_(args[1].local, **kwargs)
            return piece
        bad = next((a for a in args if isinstance(a, DCPPiece)), piece)
        raise _refusal(bad, f"{func} on")

    def _like(self, local: Tensor) -> DCPPiece:
        return DCPPiece(local, self.full_shape, self.start, self.stop)

    def _same(self, other: DCPPiece) -> bool:
        """Whether ``other`` is a piece of the same range of a tensor of the same shape."""
        mine, theirs = (self.full_shape, self.start, self.stop), (other.full_shape, other.start)
        return mine == (*theirs, other.stop)

    def _chunks(self) -> list[Chunk]:
        return row_major_chunks(self.full_shape, self.start, self.stop)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        """DCP's save: one item per rectangle, each at its offsets in the whole tensor."""
        from torch.distributed.checkpoint.metadata import (  # DCP, which is saving, loaded it
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes)),
                    properties=properties,
                    size=self.full_shape,
                ),
            )
            for offsets, sizes, _ in self._chunks()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        """DCP's load: the rectangles to read into."""
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [
            ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
            for offsets, sizes, _ in self._chunks()
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> Tensor:
        """The rectangle at ``index.offset``: a view of the piece's memory (saves read it,
        loads write it)."""
        chunks = self._chunks()
        at = index.index
        if at is None or not (0 <= at < len(chunks)) or chunks[at][0] != tuple(index.offset):
            at = next((i for i, c in enumerate(chunks) if c[0] == tuple(index.offset)), None)
        if at is None:
            raise ValueError(
                f"shardwrap: {index.fqn} holds no rectangle at {tuple(index.offset)} on this rank "
                f"(it holds elements {self.start}:{self.stop} of {tuple(self.full_shape)})"
            )
        offsets, sizes, first = chunks[at]
        if self.local.numel() and not self.local.is_contiguous():
            raise _refusal(self, "viewing a rectangle of (its memory is not contiguous)")
        lo = first - self.start
        return self.local.reshape(-1)[lo : lo + math.prod(sizes)].view(sizes)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: a pickled piece would be saved as if it were the whole tensor."""
        raise _refusal(self, "pickling (torch.save)", TypeError)

    def __deepcopy__(self, memo: dict[int, Any]) -> DCPPiece:
        return self._like(copy.deepcopy(self.local, memo))

    def share_memory_(self) -> DCPPiece:
        """For staging into shared memory: the piece's memory is shared."""
        self.local.share_memory_()
        return self

    def __repr__(self, **kwargs: Any) -> str:  # type: ignore[override]
        return (
            f"DCPPiece(elements {self.start}:{self.stop} of {tuple(self.full_shape)}, "
            f"local={self.local!r})"
        )


def local_piece(value: Any, full_shape: Sequence[int], start: int, stop: int, name: str) -> Any:
    """``value``'s own piece where it is a :class:`DCPPiece` of this rank's range (DCP's loads
    hand back what the state dict gave it), else ``value``.

    Raises:
        ValueError: a piece of another range or tensor (another rank's, another layout's).
    """
    if not isinstance(value, DCPPiece):
        return value
    if (value.full_shape, value.start, value.stop) != (torch.Size(full_shape), start, stop):
        raise ValueError(
            f"load_state_dict: {name} is the piece (elements {value.start}:{value.stop} of "
            f"{tuple(value.full_shape)}) of another rank or layout; this rank holds elements "
            f"{start}:{stop} of {tuple(full_shape)}. Load with torch.distributed.checkpoint "
            "into this model's own get_model_state_dict / get_optimizer_state_dict."
        )
    return value.local


def owned_elsewhere(
    held: Mapping[int, Mapping[str, Any]], indices: Sequence[int], group: Any, device: torch.device
) -> dict[int, dict[str, Any]]:
    """For the parameters of ``indices`` stepped whole on another rank of ``group``, the entry
    its owner shows DCP, as this rank shows it: each tensor an empty piece of the same shape
    (nothing to write, nothing to read), every other value as it is. DCP's helpers expect every
    rank to name the same state (``set_optimizer_state_dict(full_state_dict=True)`` fails on a
    scalar a rank does not name); only the owners know the state's keys and shapes (Adafactor's
    factors), so they tell the others: one small exchange of pickled descriptions."""
    mine = {
        i: {
            k: (tuple(v.full_shape), v.dtype) if isinstance(v, DCPPiece) else ("value", v)
            for k, v in held[i].items()
        }
        for i in indices
        if i in held
    }
    shown: dict[int, dict[str, Any]] = {}
    for every in _all_gather_objects(mine, group, device):
        for i, entry in every.items():
            if i not in held:
                shown[i] = {
                    k: v[1] if v[0] == "value" else DCPPiece(torch.empty(0, dtype=v[1]), v[0], 0, 0)
                    for k, v in entry.items()
                }
    return shown


def _all_gather_objects(obj: Any, group: Any, device: torch.device) -> list[Any]:
    """Every rank's ``obj`` (small; what ``torch.load(weights_only=True)`` reads), by rank."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    rank, world = group_rank(group), group_size(group)
    sizes = torch.zeros(world, dtype=torch.int64, device=device)
    sizes[rank] = len(data)
    all_reduce(sizes, group).wait()
    rows = torch.zeros(world, int(sizes.max()), dtype=torch.uint8)
    rows[rank, : len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = rows.to(device)
    all_reduce(rows, group).wait()
    return [
        torch.load(io.BytesIO(bytes(row[:n].cpu().tolist())), weights_only=True)
        for row, n in zip(rows, sizes.tolist())
    ]


def local_pieces(state_dict: Mapping[str, Any], ranges: Mapping[str, tuple[Any, Any]]) -> Any:
    """``state_dict`` (a copy, its ``_metadata`` kept) with each :class:`DCPPiece` of a key of
    ``ranges`` (key: the whole shape, and the piece held here, with ``start`` and ``stop``) as
    its own piece, checked to be this rank's (:func:`local_piece`)."""
    out = copy.copy(state_dict)
    for key, (shape, piece) in ranges.items():
        if key in out:
            out[key] = local_piece(out[key], shape, piece.start, piece.stop, key)  # type: ignore[index]
    return out


# who asks: DCP or not ----------------------------------------------------------------------


@dataclass(frozen=True)
class DCPCall:
    """A state dict that DCP asks for, and how.

    Attributes:
        full: ``StateDictOptions(full_state_dict=True)``: the whole tensors, not pieces.
        rank0_only: with ``cpu_offload``, only global rank 0 keeps them.
        model: the model DCP was given (``get_optimizer_state_dict``), if any.
    """

    full: bool
    rank0_only: bool
    model: nn.Module | None


_entries: dict[CodeType, bool] = {}  # DCP's functions that ask; True: they carry options
_serving = threading.local()


def _dcp_entries() -> dict[CodeType, bool]:
    if not _entries:
        from torch.distributed.checkpoint import state_dict, state_dict_loader, state_dict_saver

        for fn, options in (
            (state_dict._get_model_state_dict, True),
            (state_dict._get_optim_state_dict, True),
            (state_dict_saver._stateful_to_state_dict, False),  # dcp.save({"model": model})
            (state_dict_loader.load, False),  # dcp.load({"model": model})
        ):
            _entries[inspect.unwrap(fn).__code__] = options
    return _entries


def dcp_call(depth: int = 64) -> DCPCall | None:
    """Whether DCP asks for the state dict being made (a state-dict hook calls this), read from
    the ``depth`` frames above the hook's caller; ``None`` inside :func:`serving`."""
    if getattr(_serving, "on", False) or "torch.distributed.checkpoint" not in sys.modules:
        return None  # nobody imported DCP: it is not asking
    entries = _dcp_entries()
    frame = caller_frame(lambda f: f.f_code in entries, depth, skip=2)
    if frame is None:
        return None
    options = entries[frame.f_code]
    info = frame.f_locals.get("info") if options else None
    full = bool(getattr(info, "full_state_dict", False))
    offload = bool(getattr(info, "cpu_offload", False))
    rank0 = full and offload and torch.distributed.is_initialized()
    return DCPCall(full, rank0, frame.f_locals.get("model") if options else None)


def dcp_filling_empty_state(depth: int = 16) -> bool:
    """Whether DCP's state-dict functions step the optimizer whose step hook calls this, to
    fill its state where it is empty (zero gradients, a learning rate of 0), read from the
    ``depth`` frames above the hook's caller."""
    if "torch.distributed.checkpoint.state_dict" not in sys.modules:
        return False
    from torch.distributed.checkpoint import state_dict

    code = inspect.unwrap(state_dict._init_optim_state).__code__
    return caller_frame(lambda f: f.f_code is code, depth, skip=2) is not None


def refuse_tensor_parallel(mesh: Any, call: DCPCall) -> None:
    """Raise where DCP asks for the pieces of a model over a tensor-parallel mesh: each piece
    is a range of its tp rank's block, not of the whole tensor, which its rectangles would
    claim (the whole tensors, ``full_state_dict=True``, are shown as for any model)."""
    if mesh.tp is not None and not call.full:
        raise TypeError(
            "torch.distributed.checkpoint of a model sharded over a tensor-parallel mesh "
            '(("dp", "tp")) is not supported: its pieces are ranges of each tp rank\'s block. '
            "Save with shardwrap.save_checkpoint (it loads at any dp x tp layout), or pass "
            "StateDictOptions(full_state_dict=True) for the whole tensors"
        )


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """While shardwrap itself makes a state dict for DCP: its inner ``state_dict()`` calls are
    plain ones."""
    _serving.on = True
    try:
        yield
    finally:
        _serving.on = False


# The whole optimizer state (``checkpoint/full_optimizer.py``), for full_state_dict=True:
# (model, optimizer, rank0_only) -> optimizer.state_dict() as over the unwrapped model.
FullOptimizerState = Callable[[nn.Module, torch.optim.Optimizer, bool], dict[str, Any]]
_full_optimizer_state: list[FullOptimizerState] = []


def register_full_optimizer_state(fn: FullOptimizerState) -> None:
    """Where the whole optimizer state comes from (registered by the layer that gathers it)."""
    _full_optimizer_state[:] = [fn]


def full_optimizer_state(
    model: nn.Module | None, optimizer: torch.optim.Optimizer, rank0_only: bool
) -> Mapping[str, Any]:
    """The whole optimizer state for a ``full_state_dict=True`` request."""
    if model is None or not _full_optimizer_state:
        raise TypeError(
            "shardwrap: the whole optimizer state needs the model: call "
            "get_optimizer_state_dict(model, optimizer, options=...) or "
            "shardwrap.full_optimizer_state_dict(model, optimizer)"
        )
    held = [m for m in model.modules() if "_shardwrap_root" in vars(m)]
    if len(held) == 1:  # the model DCP was given holds it (or compiled it)
        model = held[0]
    with serving():
        return _full_optimizer_state[0](model, optimizer, rank0_only)
