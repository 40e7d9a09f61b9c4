"""Parameters that are DTensors on a tensor-parallel mesh, as a flat group keeps them.

Design note. Tensor parallelism (``parallelize_module`` on the mesh's ``"tp"`` dimension,
before wrapping) leaves some parameters as DTensors: split along one dimension (``Shard``) or
replicated (``Replicate``) over the tp ranks. A flat group lays out each one's *local* tensor,
this tp rank's block, so the flat groups of tp ranks differ in values but not in layout, and
each is sharded over the shard (dp) group alone. What the layout forgets is kept here, in a
:class:`TPSpec` per parameter: the mesh, placement and whole shape. A gathered view of the
local tensor becomes the DTensor the tensor-parallel layer expects with ``DTensor.from_local``,
without communication; in backward its gradient (a DTensor, which DTensor's own rules have
already reduced over tp where the placement asks for it) arrives at the view as the local
gradient, and so in the flat gradient.

What is refused, by :func:`check_tensor_parallel` before any collective, each naming the fix:
placements other than one ``Shard`` or ``Replicate`` on the tp mesh (``Partial`` at rest, a
strided shard, a parameter on another mesh), blocks of unequal size (every tp rank must lay
out the same flat groups, and checkpoints stack equal blocks), DTensor parameters without a
``"tp"`` mesh to shard them over, and the options not built for it (offload tiers,
``compile``, a model on the meta device).

A ``transformers`` model under its own tensor-parallel plan runs a layer's forward under
``torch.no_grad()`` on local tensors: its layer swaps the DTensor parameters registered on the
module (``_parameters``) for their local tensors. A flat group shadows the registered shard
parameters with its views in the module's ``__dict__``, out of that swap's reach, so
:func:`local_views_for_inference` lends such a layer its DTensor views as registered
parameters for the length of its forward.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from .split import Split

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor, Placement

__all__ = [
    "TPSpec",
    "check_tensor_parallel",
    "is_dtensor",
    "local_of",
    "local_views_for_inference",
    "spec_of",
    "tp_mesh_of",
]


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor. Importing DTensor costs a process over half a second, so
    shardwrap never imports it itself: no tensor is a DTensor before someone else has."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


@dataclass(frozen=True)
class TPSpec:
    """How one DTensor parameter lies over the tp ranks.

    Attributes:
        mesh: the 1-D tensor-parallel mesh.
        placements: its placement on that mesh (one ``Shard`` or ``Replicate``).
        split: the whole parameter's shape and the blocks the ranks hold (not split for
            ``Replicate``).
        stride: the whole parameter's stride.
        index: which block this rank holds.
    """

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    split: Split
    stride: tuple[int, ...]
    index: int

    def as_param(self, local: Tensor) -> Tensor:
        """``local`` (a view shaped like this rank's block) as the DTensor the tensor-parallel
        layer reads; no communication, and differentiable back to ``local``."""
        from torch.distributed.tensor import DTensor  # loaded: the spec came from one

        return DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.split.shape,
            stride=self.stride,
        )

    def whole(self, local: Tensor) -> Tensor:
        """The whole parameter from this rank's block (an all-gather over tp where split)."""
        if not self.split.is_split:
            return local
        return self.as_param(local).full_tensor()

    def local_of(self, whole: Tensor) -> Tensor:
        """This rank's block of the whole value ``whole`` (a view)."""
        return self.split.block(whole, self.index)


def tp_mesh_of(process_group: Any) -> DeviceMesh | None:
    """The ``"tp"`` dimension of ``process_group`` where it is a ``DeviceMesh`` that has one."""
    if isinstance(process_group, DeviceMesh) and "tp" in (process_group.mesh_dim_names or ()):
        return process_group["tp"]
    tp = getattr(process_group, "tp", None)  # a shardwrap Mesh
    return tp if isinstance(tp, DeviceMesh) else None


def spec_of(p: nn.Parameter) -> TPSpec | None:
    """The spec of ``p`` where it is a DTensor (checked by :func:`check_tensor_parallel`)."""
    if not is_dtensor(p):
        return None
    placement = p.placements[0]
    parts = p.device_mesh.size()
    dim = placement.dim % p.ndim if placement.is_shard() else None
    split = Split(tuple(p.shape), dim, parts if dim is not None else 1)
    index = p.device_mesh.get_local_rank() if dim is not None else 0
    return TPSpec(p.device_mesh, tuple(p.placements), split, tuple(p.stride()), index)


def local_of(p: Tensor) -> Tensor:
    """The tensor a flat group lays out for ``p``: its local block where it is a DTensor."""
    return p.to_local() if is_dtensor(p) else p


def check_tensor_parallel(module: nn.Module, process_group: Any, options: dict[str, bool]) -> None:
    """Refuse, before any collective, DTensor parameters shardwrap cannot shard.

    Args:
        module: the model, after ``parallelize_module``.
        process_group: ``ShardedModule``'s argument.
        options: which options not built for tensor parallelism are on, by name.

    Raises:
        ValueError: naming every parameter refused (and why), or the option, and the fix.
    """
    tp = tp_mesh_of(process_group)
    dtensors = [(n, p) for n, p in module.named_parameters() if is_dtensor(p)]
    if not dtensors:
        return
    if tp is None:
        name, p = dtensors[0]
        if _replicated_only(p):
            raise ValueError(
                f"ShardedModule: parameter '{name}' is a DTensor replicated on every rank of "
                f"its mesh ({p.placements}: distribute_module or distribute_tensor without a "
                "split), which no tensor parallelism needs and shardwrap does not keep. Make "
                "the parameters plain tensors before wrapping (for each module, "
                "module.register_parameter(name, nn.Parameter(p.to_local())), or build the "
                "model without distribute_module): ShardedModule then shards them itself."
            )
        raise ValueError(
            f"ShardedModule: parameter '{name}' is a DTensor (tensor parallelism), "
            'but process_group has no "tp" dimension to keep it on. Pass the DeviceMesh that '
            'parallelize_module used the "tp" dimension of: mesh = init_device_mesh("cuda", '
            '(dp, tp), mesh_dim_names=("dp", "tp")); parallelize_module(model, mesh["tp"], '
            "plan); ShardedModule(model, process_group=mesh)."
        )
    problems = [f"'{n}': {why}" for n, p in dtensors if (why := _problem(p, tp)) is not None]
    if problems:
        raise ValueError(
            "ShardedModule: tensor-parallel parameters it cannot shard: "
            + "; ".join(problems[:4])
            + ("; ..." if len(problems) > 4 else "")
            + '. Each parameter must be a DTensor on the mesh\'s "tp" dimension, placed '
            "Shard(d) with equal blocks or Replicate(), as parallelize_module's "
            "ColwiseParallel, RowwiseParallel and SequenceParallel leave them."
        )
    for option, on in options.items():
        if on:
            raise ValueError(
                f"ShardedModule: {option} is not supported with tensor parallelism yet (its "
                "shards would need the DTensor layout it does not keep). Leave it out, or train "
                "without parallelize_module."
            )


def _replicated_only(p: DTensor) -> bool:
    """Whether ``p`` is replicated on every dimension of its mesh (split nowhere)."""
    from torch.distributed.tensor import Replicate  # loaded: p is a DTensor

    return all(type(placement) is Replicate for placement in p.placements)


def _problem(p: DTensor, tp: DeviceMesh) -> str | None:
    """Why ``p`` cannot be laid out, or ``None``."""
    from torch.distributed.tensor import Replicate, Shard  # loaded: p is a DTensor

    mesh = p.device_mesh
    if mesh.ndim != 1 or mesh.mesh.tolist() != tp.mesh.tolist():
        return f'on mesh {mesh.mesh.tolist()}, not the "tp" dimension {tp.mesh.tolist()}'
    placement = p.placements[0]
    if type(placement) is Replicate:
        return None
    if type(placement) is not Shard:  # Partial, or a strided shard
        return (
            f"placed {type(placement).__name__}: only Shard(d) and Replicate() are kept at "
            "rest (a Partial "
            "parameter's value is a sum nobody holds; redistribute it first)"
        )
    dim = placement.dim % p.ndim
    if p.shape[dim] % mesh.size():
        return (
            f"dimension {dim} of {tuple(p.shape)} does not split into {mesh.size()} equal "
            "blocks (choose sizes the tp degree divides)"
        )
    return None


def local_views_for_inference(model: nn.Module) -> None:
    """Hook each layer of ``model`` that ``transformers`` made tensor-parallel (it marks them
    ``_is_hooked``) so that, in a forward without gradients, the layer's gathered DTensor
    views are its registered parameters, which its plan swaps for their local tensors; the
    shard parameters are registered again when the forward ends, however it ends."""
    for module in model.modules():
        if getattr(module, "_is_hooked", False) and module._parameters:
            lent: list[tuple[str, Tensor | None]] = []
            module.register_forward_pre_hook(functools.partial(_lend, lent=lent))
            module.register_forward_hook(functools.partial(_take_back, lent=lent), always_call=True)


def _lend(module: nn.Module, args: Any, *, lent: list[tuple[str, Tensor | None]]) -> None:
    if torch.is_grad_enabled():  # the plan's DTensor path reads the views where they are
        return
    for attr, registered in list(module._parameters.items()):
        view = module.__dict__.get(attr)
        if is_dtensor(view):
            lent.append((attr, registered))
            module._parameters[attr] = view
            del module.__dict__[attr]  # else it shadows what the plan swaps in


def _take_back(
    module: nn.Module, args: Any, output: Any, *, lent: list[tuple[str, Tensor | None]]
) -> None:
    for attr, registered in lent:
        module.__dict__[attr] = module._parameters[attr]  # the plan has put the view back
        module._parameters[attr] = registered
    lent.clear()
