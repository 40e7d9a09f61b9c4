"""One flat buffer: the parameters of a unit that share a dtype and ``requires_grad``.

Design note. A flat group keeps this rank's 1/N shard of a padded flat buffer; the
optimizer sees one ``nn.Parameter`` per original parameter, a 1-D view of that shard.
Those shard parameters stay registered in the modules at all times, so ``parameters()``,
``state_dict()`` and an optimizer built after wrapping always see shards.

While gathered, the full flat buffer (a pooled tensor, given back on release) is split into
views shaped like the original parameters, and the views shadow the registered parameters
through each module's instance ``__dict__``: ``module.weight`` returns the full view,
``module._parameters`` keeps the shard. Autograd accumulates the gradients of all views into
the group's one leaf, ``full``, whose ``.grad`` is then reduce-scattered straight from the
flat layout.

A tensor-parallel parameter (a DTensor on the mesh's ``tp`` dimension) is laid out as its
local block; its view is shown to the module as the DTensor it was (``tensor_parallel.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ...comm.buckets import Gathers
from ...comm.collectives import CommStats, Pending, all_gather
from ...comm.compressed import all_gather_quantized
from ...comm.mesh import Mesh
from ...comm.quantize import Codec
from ...tiers.home import Home
from .eager import eager
from .layout import FlatLayout, LocalPiece, view_end
from .param_hooks import hook_view
from .pool import BufferPool
from .shard_grads import ShardGrads
from .split import Split
from .tensor_parallel import TPSpec, local_of

__all__ = ["FlatGroup", "Slot", "views_of"]

Slot = tuple[nn.Module, str]


class FlatGroup:
    """The parameters of one unit that share a dtype and ``requires_grad``.

    Four dtypes meet here: the shard's (``dtype``, the optimizer's master copy), the
    gathered parameters' (``compute_dtype``, which forward and backward use), the flat
    gradient's (``grad_dtype``, in which ranks average it) and the shard params' ``.grad``
    (``param_grad_dtype``). Without mixed precision, or a ``grad_dtype`` set on the
    parameters, all four are the parameters' dtype.

    Args:
        names: canonical name of each parameter (as ``named_parameters()`` gives it).
        params: the original, full parameters, in flat order.
        slots: for each parameter, every ``(module, attribute)`` that holds it (several for
            tied parameters).
        mesh: the model's groups and device; the layout splits over its shard group.
        pool: where the full buffer comes from while gathered.
        compute_dtype: dtype of the gathered parameters (default: ``dtype``).
        grad_dtype: dtype of the flat gradient and its reduction (default: ``compute_dtype``).
        param_grad_dtype: dtype of the shard params' ``.grad`` (default: ``dtype``), set as
            their ``grad_dtype`` where it differs; a ``grad_dtype`` set on a shard param
            later is followed when its gradient lands.
        resident: keep the full buffer for good, with the shard as this rank's slice of it
            (``Strategy.keeps_resident``: stages 1 and 2, where the parameters compute in the
            shards' dtype, exactly, on the compute device): the full parameters then cost no
            memory beyond the shard's own, and a gather only fills the other ranks' slices.
        home: where the shard, its gradient buffer and the optimizer state live, and how the
            shard reaches the compute device (``tiers/home.py``); default: on the mesh's device,
            read in place.
        codec: the wire format of the gathers for compute (``Compression.params``), or
            ``None`` to gather exactly. Such a group keeps no resident buffer: its gathered
            values are decoded ones, and the shard must stay exact.
        specs: for each parameter, how it lies over the tp ranks where it is a DTensor
            (``None`` elsewhere, or for all).
    """

    def __init__(
        self,
        names: list[str],
        params: list[nn.Parameter],
        slots: list[list[Slot]],
        mesh: Mesh,
        pool: BufferPool,
        compute_dtype: torch.dtype | None = None,
        grad_dtype: torch.dtype | None = None,
        param_grad_dtype: torch.dtype | None = None,
        resident: bool = False,
        home: Home | None = None,
        codec: Codec | None = None,
        requires_grad: bool | None = None,
        specs: list[TPSpec | None] | None = None,
    ) -> None:
        self.names = names
        self.codec = codec
        self.pool = pool
        self.slots = slots
        self.mesh = mesh
        self.home = home = home or Home(mesh.device)
        device = home.device
        self.specs: list[TPSpec | None] = specs or [None] * len(params)
        # per parameter: its whole shape and the blocks the tp ranks hold (one: the whole)
        self.splits = [s.split if s else Split(tuple(p.shape)) for s, p in zip(self.specs, params)]
        params = [local_of(p.detach()) for p in params]
        self.shapes = [p.shape for p in params]  # of what the layout holds: local blocks
        self.dtype = params[0].dtype
        self.compute_dtype = compute_dtype or self.dtype
        self.grad_dtype = grad_dtype or self.compute_dtype
        self.param_grad_dtype = param_grad_dtype or self.dtype
        # Whether the group gets a flat gradient; each shard param's own flag may be off (a
        # parameter frozen now that the model may train later gets no ``.grad`` meanwhile).
        self.requires_grad = params[0].requires_grad if requires_grad is None else requires_grad
        self.layout = FlatLayout(tuple(p.numel() for p in params), mesh.shard_size)
        rank = mesh.shard_rank
        self.pieces: tuple[LocalPiece, ...] = self.layout.local_pieces(rank)
        # Each shard param keeps its parameter's number of dimensions (see ``piece_shape``).
        self.piece_shapes = [piece_shape(s, pc.numel) for s, pc in zip(self.shapes, self.pieces)]

        lo, hi = self.layout.shard_range(rank)
        # 1-D, padded numel, compute_dtype: the full buffer kept for good (resident groups only).
        self._resident: Tensor | None = None
        if resident:
            self._resident = torch.empty(self.layout.padded_numel, dtype=self.dtype, device=device)
            pool.claim(self._resident, self)
            self.shard: Tensor = self._resident[lo:hi].zero_()  # 1-D, padded/N
        else:
            self.shard = home.tensor(hi - lo, self.dtype, "shard")  # zeros
        with torch.no_grad():
            for p, offset, n in zip(params, self.layout.offsets, self.layout.numels):
                a, b = max(lo, offset), min(hi, offset + n)
                if a < b:
                    self.shard[a - lo : b - lo].copy_(
                        p.detach().reshape(-1)[a - offset : b - offset]
                    )
        self.shard_params = [
            home.shard_param(
                self.shard[pc.shard_offset : pc.shard_offset + pc.numel].view(shape),
                self.requires_grad,
            )
            for pc, shape in zip(self.pieces, self.piece_shapes)
        ]
        if self.param_grad_dtype != self.dtype:
            for p in self.shard_params:
                p.grad_dtype = self.param_grad_dtype
        self.shard_grads = ShardGrads(
            names, self.shard_params, self.pieces, self.piece_shapes, self.dtype, hi - lo
        )
        # 1-D, padded/N: where a step's reduced gradient lands in a home that keeps a buffer
        # for it (the disk tier's, in grad_dtype; the host tier's, in param_grad_dtype).
        self.home_grad: Tensor | None = None
        if self.requires_grad:
            self.home_grad = home.grad_buffer(hi - lo, self.grad_dtype, self.param_grad_dtype)

        # 1-D, padded numel, over one element of memory: the autograd leaf that stands for the full
        # parameters. Its gradient is the flat gradient (grad_dtype); the values live in a
        # pooled buffer (1-D, padded numel, compute_dtype) while gathered.
        self.full: Tensor = _unbacked(self.layout.padded_numel, self.grad_dtype, device)
        self.full.requires_grad_(self.requires_grad)
        self._buffer: Tensor | None = None

        self.views: list[Tensor] | None = None
        self.views_track_grad = False
        self.shown = False  # whether the module attributes are the views (else the pieces)
        # Differentiable uses of the views whose backward has not run; at zero, backward is
        # done reading the gathered parameters (their gradients are not yet one flat tensor).
        self.splits_pending = 0
        # Per parameter: whether any backward since the flat gradient was last taken gave it a
        # gradient. A parameter none gave one keeps ``.grad = None``, as in plain PyTorch,
        # though its slot of the flat gradient holds zeros.
        self.grads_seen = [False] * len(params)
        # While a backward runs: what lands the reductions in flight (``begin_backward``).
        self._land_reductions: Callable[[], None] | None = None
        # Whether backward gives the buffer back once done with it, or only drops the views
        # (the unit's lifetime: ``Unit.release_after_backward``).
        self.release_after_backward = False
        self.gathered_version = -1
        # Optimizer steps over its pieces (``engine/optim/whole_params.py``'s step hook), and
        # for each parameter the count after the last step that changed it (one it had a
        # gradient for): a view autograd saved before such a step is not what its backward
        # would read (``shards/saved.py``).
        self.steps = 0
        self.stepped = [0] * len(names)
        # Inside ``gathered(writeback=True)``: the buffer holds the full parameters exactly, in
        # the shards' dtype, to be written back; no gather may replace it in another dtype.
        self.exact_only = False
        # 1-D uint8, codec.nbytes(padded/N): the shard as a compressed gather sent it, kept
        # for the unit's next gather (backward's, while the shard is unchanged), with the
        # shard's version and address when packed; dropped at the end of backward.
        self._packed: tuple[tuple[int, int], Tensor] | None = None

    # storage -------------------------------------------------------------------------

    def alloc_storage(self, dtype: torch.dtype, apart: bool = False) -> None:
        """Give the group a full buffer of ``dtype``: its resident one where it has one, unless
        ``apart`` asks for a buffer whose edits cannot reach the shard."""
        resident = self._resident if not apart and dtype == self.dtype else None
        wanted = (resident is not None, dtype)
        if (
            self._buffer is not None
            and (self._buffer is self._resident, self._buffer.dtype) != wanted
        ):
            self.release()
        if self._buffer is None:
            self._buffer = resident if resident is not None else self.take_buffer(dtype)

    def start_training(self) -> None:
        """A frozen group's parameter was unfrozen after wrapping (``requires_grad_(True)``):
        from the next forward on, the group gets a flat gradient and its reduction."""
        lo, hi = self.layout.shard_range(self.mesh.shard_rank)
        self.requires_grad = True
        self.full.requires_grad_(True)
        self.home_grad = self.home.grad_buffer(hi - lo, self.grad_dtype, self.param_grad_dtype)
        self.drop_views()  # made again, tracking gradients, where the group is in use

    def take_buffer(self, dtype: torch.dtype) -> Tensor:
        """A full buffer of ``dtype`` from the pool (1-D, padded numel, values undefined)."""
        return self.pool.take(self.layout.padded_numel, dtype, self.home.device, self)

    @property
    def can_train(self) -> bool:
        """Whether the group's dtype takes gradients (floating point or complex): such a group
        has a reduction, frozen now or not."""
        return self.dtype.is_floating_point or self.dtype.is_complex

    @property
    def full_data(self) -> Tensor:
        """The gathered flat buffer, outside autograd (only while gathered)."""
        if self._buffer is None:
            raise RuntimeError(f"flat group {self.names[:2]}... is not gathered")
        return self._buffer

    def stepped_since(
        self, steps: int, at: int, shape: Sequence[int], stride: Sequence[int]
    ) -> list[str]:
        """The parameters an optimizer stepped after the group's ``steps``-th step that a view
        of the gathered buffer (``at``, ``shape``, ``stride``) reads, by name."""
        stop = view_end(at, shape, stride)
        spans = zip(self.names, self.layout.offsets, self.layout.numels, self.stepped)
        return [name for name, o, n, last in spans if last > steps and o < stop and at < o + n]

    @property
    def is_allocated(self) -> bool:
        return self._buffer is not None

    def free_storage(self) -> None:
        if self._buffer is not None and self._buffer is not self._resident:
            self.pool.give(self._buffer)
        self._buffer = None

    @property
    def is_stale(self) -> bool:
        """True when the buffer does not hold the shards for compute: it is gathered in another
        dtype, or the shard changed (an optimizer step, a load) since the last gather."""
        return self.shard._version != self.gathered_version or (
            self._buffer is not None and self._buffer.dtype != self.compute_dtype
        )

    # gather --------------------------------------------------------------------------

    def gather(
        self, stats: CommStats | None, exact: bool = False, batch: Gathers | None = None
    ) -> Pending:
        """All-gather the shards into the full buffer (asynchronously where possible).

        The buffer is in ``compute_dtype``, quantized on the wire where the group has a
        ``codec``; or with ``exact`` in the shards' own dtype, exactly. A plain gather joins
        ``batch`` where one is given (``comm/buckets.py``).
        """
        if self.exact_only and not exact and self.compute_dtype != self.dtype:
            raise RuntimeError(
                f"shardwrap: a forward inside model.gathered(writeback=True) would gather "
                f"{self.names[0]} and the rest of its unit again in the compute dtype "
                f"({self.compute_dtype}, mixed precision), over the full parameters in "
                f"{self.dtype} that the block writes back: their edits would be lost and "
                "rounded values written back. Nothing was written back. Run the forward after "
                "the block (the edits are in then), or inside a gathered() block without "
                "writeback."
            )
        # Views of the old values (a graph no backward ran, an evaluation's) are not the new.
        self.drop_views()
        self.alloc_storage(self.dtype if exact else self.compute_dtype, apart=exact)
        self.mark_gathered()
        # Writes into a buffer the shard is a slice of may count as writing the shard: the
        # group is marked again once they are done, by whichever unit waits first.
        return self._gather_into(self._buffer, stats, exact, batch, then=self.mark_gathered)

    def _gather_into(
        self,
        buffer: Tensor,
        stats: CommStats | None,
        exact: bool,
        batch: Gathers | None = None,
        then: Callable[[], None] | None = None,
    ) -> Pending:
        shard, group = self.home.gather_input(self.shard), self.mesh.shard
        if self.codec is not None and not exact:
            version = (self.shard._version, self.shard.data_ptr())
            # Backward's gather of a shard unchanged since forward's sends the same packing.
            if self._packed is None or self._packed[0] != version:
                self._packed = (version, self.codec.pack(shard))
            return all_gather_quantized(buffer, shard, group, self.codec, stats, self._packed[1])
        if batch is not None:
            return batch.add(buffer, shard, group, then)
        return all_gather(buffer, shard, group, stats)

    def gather_apart(self, stats: CommStats | None, batch: Gathers) -> Callable[[], None]:
        """Take part in a peer's gather of this group while this rank holds it gathered: into a
        spare buffer, leaving the gathered one (autograd may hold views of it) untouched.

        Returns:
            What completes it once ``batch`` is issued: wait, and give the spare buffer back.
        """
        buffer = self.take_buffer(self.compute_dtype)
        pending = self._gather_into(buffer, stats, False, batch)

        def done() -> None:
            try:
                pending.wait()
            finally:
                self.pool.give(buffer)

        return done

    def make_views(self, track_grad: bool) -> None:
        """Shape the gathered buffer into the parameters and shadow the shard params with them.

        A slot whose registered parameter is not its shard parameter was swapped by
        ``torch.func.functional_call`` (which writes ``module._parameters`` directly, for the
        call): it is left unshadowed, so the module computes with the tensor given, as the
        unwrapped model would.
        """
        track_grad = track_grad and self.requires_grad
        if self.views is None or self.views_track_grad != track_grad:
            if track_grad:
                self.splits_pending += 1  # one more backward to read these views before release
                views = list(_FullParams.apply(self.full, self._buffer, self))
            else:
                views = self.param_views()
            self.views = [v if s is None else s.as_param(v) for v, s in zip(views, self.specs)]
            self.views_track_grad = track_grad
            if track_grad:
                self._hook_views()
        for view, p, slots in zip(self.views, self.shard_params, self.slots):
            for module, attr in slots:
                if module._parameters.get(attr) is p:
                    module.__dict__[attr] = view
                else:
                    module.__dict__.pop(attr, None)
        self.shown = True

    def _hook_views(self) -> None:
        """Give each full parameter its shard parameter's gradient hooks (``p.register_hook``):
        a shard parameter is in no graph, so autograd would never call them. On the view they
        see this rank's gradient of the whole parameter before the reduction, and what they
        return is what is reduced, as DDP's hooks on its parameters (see :func:`hook_view`)."""
        for view, p in zip(self.views, self.shard_params):
            if p._backward_hooks:
                hook_view(view, tuple(p._backward_hooks.values()))

    def param_views(self) -> list[Tensor]:
        """The gathered buffer shaped into the parameters (local blocks), outside autograd."""
        return views_of(self.full_data, self)

    def wholes(self, views: list[Tensor]) -> list[Tensor]:
        """The whole parameters from ``views`` of a gathered buffer: the views themselves, but
        for tensor-parallel blocks, gathered over tp (every tp rank must call it alike)."""
        return [v if s is None else s.whole(v) for v, s in zip(views, self.specs)]

    def flat_grad(self, grads: tuple[Tensor | None, ...]) -> Tensor:
        """The parameters' gradients laid out flat in ``grad_dtype`` (zeros where none, and in
        the padding): one copy, which also casts, into a buffer from the pool. A sparse one
        (``nn.Embedding(sparse=True)``) is laid out dense: pieces of the flat gradient are
        what ranks reduce and optimizers step on."""
        flat = self.pool.take_scratch(self.layout.padded_numel, self.grad_dtype, self.home.device)
        seen = self.grads_seen
        for i, (g, offset, n) in enumerate(zip(grads, self.layout.offsets, self.layout.numels)):
            if g is None:
                flat[offset : offset + n].zero_()
            else:
                seen[i] = True
                flat[offset : offset + n].copy_((g.to_dense() if g.is_sparse else g).reshape(-1))
        flat[self.layout.numel :].zero_()
        return flat

    def begin_backward(self, land_reductions: Callable[[], None]) -> None:
        """A backward begins: once it last reads the views, release them (see
        :meth:`views_backward_done`), calling ``land_reductions`` then."""
        self._land_reductions = land_reductions

    def views_backward_done(self) -> None:
        """One autograd use of the views has its gradients: at the last, inside a backward,
        release the parameters early.

        The flat gradient is still to be assembled from the per-parameter ones; freeing the
        parameters, and the previous reduction's flat gradient, first keeps two unit-sized
        buffers fewer alive at that moment.
        """
        self.splits_pending -= 1
        if self.splits_pending == 0 and self._land_reductions is not None:
            self.after_backward()
            # The reduction in flight is almost always done by now; landing it first means
            # its flat gradient is back in the pool before this group's is taken.
            self._land_reductions()

    def end_backward(self) -> None:
        """Forget the uses of the views one backward counted, however it ended, and the packed
        shard (an optimizer may step next)."""
        self.splits_pending = 0
        self._land_reductions = None  # outside backward, the views' last read releases nothing
        self._packed = None

    def mark_gathered(self) -> None:
        """The buffer now holds the shard as it is."""
        self.gathered_version = self.shard._version

    def mark_stale(self) -> None:
        """The shard may change unseen (not every write is counted in its version): gather
        afresh before the buffer is next read."""
        self.gathered_version = -1
        self._packed = None

    def drop_views(self) -> None:
        if self.views is None:
            return
        self.views = None
        self.hide_views()

    def hide_views(self) -> None:
        """Let the module attributes fall back to the pieces, keeping the views (and the graph
        they are in) for the next :meth:`make_views`."""
        if not self.shown:
            return
        self.shown = False
        for slots in self.slots:
            for module, attr in slots:
                module.__dict__.pop(attr, None)

    def release(self) -> None:
        """Drop the views and give the buffer back to the pool."""
        self.drop_views()
        self.free_storage()

    def after_backward(self) -> None:
        """Backward reads the group no more: release it, or only its views (as told)."""
        if self.release_after_backward:
            self.release()
        else:
            self.drop_views()

    def piece_of(self, index: int, whole: Tensor) -> Tensor:
        """This rank's piece of ``whole``, a value of parameter ``index`` in its whole shape
        (1-D; of this tp rank's block for a tensor-parallel parameter)."""
        pc, spec = self.pieces[index], self.specs[index]
        block = whole if spec is None else spec.local_of(whole)
        return block.reshape(-1)[pc.start : pc.stop]

    def assign(self, index: int, value: Tensor) -> None:
        """Copy this rank's piece of ``value``, parameter ``index``'s new full value, into the
        shard (a gathered buffer of it is then stale, and gathered again before use)."""
        pc = self.pieces[index]
        with torch.no_grad():
            self.shard[pc.shard_offset : pc.shard_offset + pc.numel].copy_(
                self.piece_of(index, value)
            )

    def write_back(self) -> None:
        """Copy this rank's range of the full buffer (gathered ``exact``) back into the shard."""
        lo, hi = self.layout.shard_range(self.mesh.shard_rank)
        with torch.no_grad():
            self.shard.copy_(self.full_data[lo:hi])

    # gradients -----------------------------------------------------------------------

    @property
    def has_grad(self) -> bool:
        """Whether a backward gave any parameter a gradient since the flat one was last taken
        (under ``no_sync``, any of the backwards since the last reduction)."""
        return any(self.grads_seen)

    def take_grad(self) -> tuple[Tensor, list[bool]]:
        """Take the flat gradient (1-D, padded numel, ``grad_dtype``) out of the leaf, for
        reduction (zeros where this rank produced none), with which parameters it holds a
        gradient of (``grads_seen``, reset here)."""
        grad, seen = self.full.grad, self.grads_seen
        self.full.grad = None
        self.grads_seen = [False] * len(seen)
        self.shard_grads.forget()
        if grad is None:
            grad = torch.zeros(
                self.layout.padded_numel, dtype=self.grad_dtype, device=self.home.device
            )
        return grad, seen

    def drop_grad(self) -> None:
        """Drop the flat gradient of a backward that raised."""
        self.full.grad = None
        self.grads_seen = [False] * len(self.grads_seen)
        self.shard_grads.forget()

    def show_pending(self, as_grads: Callable[[list[tuple[int, Tensor]]], list[Tensor]]) -> None:
        """After a backward that reduced nothing (``no_sync``): each parameter whose gradient
        this rank holds unreduced gets a ``.grad`` standing for it (``ShardGrads.stand_in``),
        so that a ``zero_grad()`` before the synced backward is seen (:meth:`drop_cleared`)."""
        held = [p.requires_grad and s for p, s in zip(self.shard_params, self.grads_seen)]
        self.shard_grads.stand_in(held, as_grads, self.free_home_grad())

    def drop_cleared(self) -> None:
        """Before a backward: drop this rank's unreduced gradient of each parameter whose
        ``.grad`` ``zero_grad()`` cleared since :meth:`show_pending`, as a plain model drops
        what it accumulated in ``.grad``."""
        for i in self.shard_grads.cleared():
            if self.full.grad is not None:
                offset, n = self.layout.offsets[i], self.layout.numels[i]
                self.full.grad[offset : offset + n].zero_()
            self.grads_seen[i] = False

    def free_home_grad(self) -> Tensor | None:
        """The home's gradient buffer, if it may take this backward's gradient."""
        return self.home_grad if self.shard_grads.buffer_free(self.home_grad) else None


def piece_shape(shape: torch.Size, numel: int) -> tuple[int, ...]:
    """The shape of a shard param holding ``numel`` elements of a parameter of ``shape``.

    The piece keeps the parameter's number of dimensions, its elements along the last one
    (``(1, numel)`` for a matrix's piece), so that code which picks parameters by ``p.ndim``
    (matrices for Muon, vectors kept out of weight decay) picks the same ones as on the
    unwrapped model. A scalar's (0-d) piece is ``(1,)`` where this rank holds it and ``(0,)``
    elsewhere: an optimizer's per-element state is then never 0-d, as its scalars (``step``)
    are, so every rank tells them apart alike, whichever holds the element.
    """
    return (1,) * (len(shape) - 1) + (numel,) if shape else (numel,)


def _unbacked(numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A 1-D leaf of ``numel`` elements over one element of memory (stride 0).

    Only its size, dtype and gradient matter; autograd still takes a contiguous gradient
    returned for it as ``.grad`` without copying.
    """
    return torch.empty_strided((numel,), (0,), dtype=dtype, device=device)


def views_of(buffer: Tensor, group: FlatGroup) -> list[Tensor]:
    return [
        buffer[offset : offset + n].view(shape)
        for offset, n, shape in zip(group.layout.offsets, group.layout.numels, group.shapes)
    ]


CREATE_GRAPH = (  # a backward with create_graph=True that reaches the parameters
    "backward(create_graph=True) reached the parameters of a sharded model: their gradients are "
    "averaged over the ranks and cut to each rank's piece outside autograd, so a graph through "
    "p.grad (a Hessian-vector product, a penalty on the parameters' gradients) would hold only "
    "this rank's share of it. Refused before any gradient was written. A penalty on the "
    "gradient of inputs works as on the plain model (torch.autograd.grad(out, inputs, "
    "create_graph=True)); for the parameters' gradients call loss.backward()."
)


class _FullParams(torch.autograd.Function):
    """The full parameters as views of a gathered buffer, differentiable as the group's leaf.

    Forward shapes the buffer into the parameters; backward lays their gradients out flat
    as the gradient of ``full``, the group's one leaf, so that however many forwards used
    the group, one accumulator sums them. Backward is also the moment autograd stops
    reading the parameters: the buffer is released before the flat gradient is allocated.
    """

    @staticmethod
    def forward(ctx: Any, full: Tensor, buffer: Tensor, group: FlatGroup) -> tuple[Tensor, ...]:
        # Weakly: the graph can outlive the model (a hook torch keeps in a cycle through the
        # graph holds this node until a collection), and must not keep the model alive.
        ctx.group = weakref.ref(group)
        # A view backward gives no gradient stays None (not zeros): its parameter was unused.
        ctx.set_materialize_grads(False)
        return tuple(views_of(buffer, group))

    @staticmethod
    @eager
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor, None, None]:
        group: FlatGroup | None = ctx.group()
        if group is None:
            raise RuntimeError("backward through a sharded model that has been deleted")
        if torch.is_grad_enabled() and any(g is not None and g.requires_grad for g in grads):
            raise RuntimeError(CREATE_GRAPH)
        group.views_backward_done()
        return group.flat_grad(grads), None, None
