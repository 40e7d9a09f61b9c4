"""Tensors autograd saves from gathered buffers, kept by address rather than by memory.

Design note. Between a unit's forward and its backward its gathered buffer goes back to the
pool and may serve other units. A view of it that autograd saved for backward must not pin
it, nor read what another unit put there: while a root's call runs, saved-tensor hooks
replace every saved view of a pooled buffer with where it lies in its flat group (offset,
shape, stride), and rebuild it at backward over wherever the group is gathered then,
gathering it first if it is not. A saved DTensor over such a view (a tensor-parallel
parameter) is kept as its local view's address and its DTensor layout, and rebuilt alike.

torch calls only the innermost saved-tensor hooks, and these are pushed at the root's call,
inside any the user entered around it (``torch.autograd.graph.save_on_cpu()``, a pack hook
that compresses activations). So every other tensor is handed to the hooks that were on top
when the call began, and unpacked by them: the user's hooks see what they see on the plain
model but the gathered parameters, which are kept by address instead. They had never been
called: activations stayed where they were, uncompressed, without a word. The hooks of
``torch.utils.checkpoint`` around the whole model are the exception, handed nothing as before:
its recomputation, in backward, would save the parameters' views too, and find the saved
tensors out of step (checkpoint the units themselves: ``checkpoint_activations``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from .eager import eager
from .flat_group import FlatGroup
from .pool import BufferPool
from .tensor_parallel import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import Placement

__all__ = ["SavedViews"]


class _SavedView(NamedTuple):
    """A tensor autograd saved that views a gathered buffer: where in the group it lies."""

    group: weakref.ReferenceType[FlatGroup]  # weakly: the graph must not keep the model
    offset: int
    shape: torch.Size
    stride: tuple[int, ...]
    steps: int  # the group's optimizer steps when saved


_CHECKPOINT = "torch.utils.checkpoint"  # the module of its saved-tensor hooks


class _PackedOutside(NamedTuple):
    """A tensor packed by the saved-tensor hooks that enclosed the root's call."""

    unpack: Callable[[Any], Tensor]
    packed: Any


class _SavedDTensor(NamedTuple):
    """A saved DTensor whose local tensor views a gathered buffer."""

    local: _SavedView
    mesh: DeviceMesh
    placements: tuple[Placement, ...]  # DTensor placements
    shape: torch.Size
    stride: tuple[int, ...]


_REFUSED = (
    "shardwrap: a forward with gradients of a sharded model where saved-tensor hooks are "
    "refused ({said}): between a unit's forward and its backward its gathered parameters go "
    "back to a pool, and the model keeps what autograd saves of them through such hooks. "
    "torch.func's transforms (grad, vjp, jvp, jacrev, jacfwd, vmap) and "
    "torch.autograd.graph.disable_saved_tensors_hooks refuse them. Take gradients with "
    "loss.backward(), or torch.autograd.grad(loss, inputs) for inputs' (a gradient penalty "
    "with create_graph=True works); run a forward without gradients under torch.no_grad() "
    "(torch.func.vmap, jvp and jacfwd work there). "
    "The model is left as it was: training goes on."
)


_STEPPED = (
    "shardwrap: one of the variables needed for gradient computation has been modified by an "
    "inplace operation: an optimizer stepped {names} since the forward that saved them, as "
    "torch raises for the unwrapped model. A graph kept with retain_graph=True computed with "
    "the weights before the step: run the forward again after the step, or step after the "
    "last backward through it."
)


class SavedViews:
    """The saved-tensor hooks of one root, entered for the outermost call that owns them.

    Args:
        pool: the buffer pool, which knows which group a buffer currently serves.
        regather: gathers a group again (for backward) when an unpacked view needs it.
    """

    def __init__(self, pool: BufferPool, regather: Callable[[FlatGroup], None]) -> None:
        self.pool = pool
        self.regather = regather
        self._hooks: torch.autograd.graph.saved_tensors_hooks | None = None
        self.owner: object | None = None  # the unit or module whose call entered the hooks

    def start(self, owner: object) -> None:
        """Save views of gathered buffers by address until ``owner``'s call returns, unless an
        enclosing call already does."""
        if self.owner is None:
            if torch._C._are_functorch_transforms_active():  # vmap would fail inside, unnamed
                raise RuntimeError(_REFUSED.format(said="a torch.func transform is active"))
            # Weakly: the graph holds these hooks, and a graph nobody runs backward through
            # may live on in torch's cycles; it must not keep the model alive.
            ref = weakref.ref(self)
            outside = torch._C._autograd._top_saved_tensors_default_hooks(False)
            if outside is not None and getattr(outside[0], "__module__", None) == _CHECKPOINT:
                outside = None  # its recomputation would see the parameters' views too

            @eager
            def pack(t: Tensor) -> Any:
                live = ref()
                saved = t if live is None else live._pack(t)
                if saved is t and outside is not None:
                    return _PackedOutside(outside[1], outside[0](t))
                return saved

            @eager
            def unpack(saved: Any) -> Tensor:
                if isinstance(saved, _PackedOutside):
                    return saved.unpack(saved.packed)
                live = ref()
                if live is None and isinstance(saved, _SavedView):
                    raise RuntimeError("backward through a sharded model that has been deleted")
                return saved if live is None else live._unpack(saved)

            hooks = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
            try:
                hooks.__enter__()
            except RuntimeError as e:  # torch.func's transforms, disable_saved_tensors_hooks
                raise RuntimeError(_REFUSED.format(said=e)) from e
            self._hooks, self.owner = hooks, owner

    def stop(self) -> None:
        hooks, self._hooks, self.owner = self._hooks, None, None
        if hooks is not None:
            hooks.__exit__(None, None, None)

    def _pack(self, t: Tensor) -> Any:
        if is_dtensor(t):
            local = self._pack(t.detach().to_local())
            if not isinstance(local, _SavedView):
                return t
            return _SavedDTensor(local, t.device_mesh, t.placements, t.shape, t.stride())
        try:
            group = self.pool.holder.get(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # tensors without plain storage
            return t
        if group is None:
            return t
        return _SavedView(weakref.ref(group), t.storage_offset(), t.shape, t.stride(), group.steps)

    def _unpack(self, saved: Any) -> Tensor:
        if isinstance(saved, _SavedDTensor):
            from torch.distributed.tensor import DTensor  # loaded: a DTensor was saved

            local = self._unpack(saved.local)
            return DTensor.from_local(
                local,
                saved.mesh,
                saved.placements,
                run_check=False,
                shape=saved.shape,
                stride=saved.stride,
            )
        if not isinstance(saved, _SavedView):
            return saved
        group = saved.group()
        if group is None:
            raise RuntimeError("backward through a sharded model that has been deleted")
        if group.steps != saved.steps:
            stepped = group.stepped_since(saved.steps, saved.offset, saved.shape, saved.stride)
            if stepped:
                raise RuntimeError(_STEPPED.format(names=", ".join(stepped[:3])))
        if not group.is_allocated:
            self.regather(group)
        return group.full_data.as_strided(saved.shape, saved.stride, saved.offset)
