"""What a script written for torch's FSDP passes and calls, on a sharded model.

A script moving from ``fully_shard`` or ``FullyShardedDataParallel`` keeps its
``MixedPrecisionPolicy``, ``MixedPrecision``, ``CPUOffloadPolicy`` or ``CPUOffload`` line: each
becomes the :class:`~shardwrap.MixedPrecision` or :class:`~shardwrap.Offload` that computes the
same. A setting shardwrap has no counterpart for is refused naming the line to write instead.
Anything else is passed on unchanged for :func:`~.checks.check_options` to judge. Its gradient
accumulation call, ``model.set_requires_gradient_sync(False)``, is :class:`FSDPHabits`'. An
argument of FSDP's own (``sharding_strategy``, ``device_id``, ``mp_policy``) is refused naming
shardwrap's (:func:`other_arguments`).
(Its auto-wrap policies are taken by ``policy.py``.)
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from torch import nn

from ...options import MixedPrecision, Offload

if TYPE_CHECKING:
    from typing import TypeAlias

    from torch.distributed import fsdp

    MixedPrecisionArg: TypeAlias = (
        MixedPrecision | fsdp.MixedPrecisionPolicy | fsdp.MixedPrecision | None
    )
    OffloadArg: TypeAlias = Offload | fsdp.OffloadPolicy | fsdp.CPUOffload | None

__all__ = ["FSDPHabits", "other_arguments", "own_mixed_precision", "own_offload"]


def _fsdp() -> ModuleType | None:
    """torch's FSDP package where it is loaded, as it is wherever one of its objects exists
    (importing it here would load DTensor with shardwrap)."""
    return sys.modules.get("torch.distributed.fsdp")


def own_mixed_precision(value: object, module: nn.Module) -> object:
    """``mixed_precision`` as a :class:`MixedPrecision` where it is one of FSDP's policies.

    Raises:
        ValueError: a setting with no counterpart here (inputs left uncast, gradients kept in
            low precision, normalisation modules kept in full precision).
    """
    fsdp = _fsdp()
    if fsdp is None:
        return value
    if isinstance(value, fsdp.MixedPrecisionPolicy):
        own = MixedPrecision(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            output_dtype=value.output_dtype,
        )
        if not value.cast_forward_inputs and value.param_dtype is not None:
            raise ValueError(_refused(value, own, "cast_forward_inputs=False", _CASTS))
        return own
    if isinstance(value, fsdp.MixedPrecision):
        own = MixedPrecision(
            param_dtype=value.param_dtype,
            reduce_dtype=value.reduce_dtype,
            buffer_dtype=value.buffer_dtype,
        )
        if value.keep_low_precision_grads:
            raise ValueError(
                _refused(
                    value,
                    own,
                    "keep_low_precision_grads=True",
                    "gradients land in the shards' dtype, which the optimizer steps",
                )
            )
        if value.param_dtype is not None and not (
            value.cast_forward_inputs or value.cast_root_forward_inputs
        ):
            raise ValueError(_refused(value, own, "inputs left uncast", _CASTS))
        kept = tuple(value._module_classes_to_ignore)
        full = [n or "the root" for n, m in module.named_modules() if kept and isinstance(m, kept)]
        if value.param_dtype is not None and full:
            raise ValueError(
                _refused(
                    value,
                    own,
                    f"its {', '.join(c.__name__ for c in kept)} modules (here: "
                    f"{', '.join(full[:3])}{', ...' if len(full) > 3 else ''}) kept in full "
                    "precision",
                    "every unit computes in param_dtype, these modules too",
                )
            )
        return own
    return value


def own_offload(value: object) -> object:
    """``offload`` as an :class:`Offload` (or ``None``) where it is one of FSDP's policies.

    Raises:
        ValueError: ``CPUOffloadPolicy(pin_memory=False)``: the host tier pins its memory.
    """
    fsdp = _fsdp()
    if fsdp is None:
        return value
    if isinstance(value, fsdp.CPUOffloadPolicy):
        if not value.pin_memory:
            raise ValueError(
                _refused(
                    value,
                    Offload(device="cpu"),
                    "pin_memory=False",
                    "the host tier's copies overlap compute only from pinned memory",
                )
            )
        return Offload(device="cpu")
    if isinstance(value, fsdp.OffloadPolicy):
        return None
    if isinstance(value, fsdp.CPUOffload):
        return Offload(device="cpu") if value.offload_params else None
    return value


_CASTS = "each unit casts its floating-point inputs to param_dtype"


def _refused(value: object, own: object, setting: str, why: str) -> str:
    return (
        f"{type(value).__name__} with {setting} has no counterpart in shardwrap: {why}. "
        f"Pass {_shown(own)} to train with shardwrap's own."
    )


def _shown(own: object) -> str:
    """The line that makes ``own``."""
    if isinstance(own, Offload):
        return f"shardwrap.Offload(device={own.device!r})"
    assert isinstance(own, MixedPrecision)
    names = ["param_dtype", "reduce_dtype"] + [
        n for n in ("output_dtype", "buffer_dtype") if getattr(own, n) is not None
    ]
    return f"shardwrap.MixedPrecision({', '.join(f'{n}={getattr(own, n)}' for n in names)})"


_PREFETCH = "drop it: each unit's start issues the next unit's gather, in the last step's order"
_DIVIDE = (
    "no counterpart: gradients are averaged over the ranks, as under DDP; scale the loss to "
    "scale them"
)
_COMMS = (
    "no counterpart: shardwrap's gathers and reductions are its own (compression= quantizes "
    "them, bucket_mb= groups small ones)"
)
# FSDP2's methods (FSDPModule's) that have no namesake on a sharded model: what to do instead.
_FSDP2_METHODS = {
    "unshard": (
        "units are gathered just in time and the next one prefetched; to read or edit the full "
        "parameters outside forward use `with model.gathered():`, to keep them gathered from "
        "forward to backward pass reshard_after_forward=False, across forwards without a graph "
        "`with model.keep_gathered():`"
    ),
    "reshard": "drop it: each unit is released after its forward and backward as its stage says",
    "set_reshard_after_forward": "pass reshard_after_forward= to ShardedModule",
    "set_reshard_after_backward": (
        "pass stage=2 to ShardedModule (full parameters kept between steps), or use "
        "`with model.keep_gathered():` around forwards without a graph"
    ),
    "set_is_last_backward": (
        "set model.require_backward_grad_sync (or model.set_requires_gradient_sync): the "
        "backward where it is True reduces everything accumulated"
    ),
    "set_requires_all_reduce": (
        "set model.require_backward_grad_sync (or model.set_requires_gradient_sync): hybrid "
        "sharding's all-reduce follows the reduce-scatter"
    ),
    "reset_iter_state": "drop it: a backward that raised leaves nothing behind",
    "set_modules_to_forward_prefetch": _PREFETCH,
    "set_modules_to_backward_prefetch": _PREFETCH,
    "set_gradient_divide_factor": _DIVIDE,
    "set_reduce_scatter_divide_factor": _DIVIDE,
    "set_force_sum_reduction_for_comms": _COMMS,
    "set_custom_all_gather": _COMMS,
    "set_custom_reduce_scatter": _COMMS,
    "set_all_reduce_hook": _COMMS,
    "set_post_optim_event": _COMMS,
    "set_unshard_in_backward": _COMMS,
    "set_reduce_scatter_unused_params": _COMMS,
    "set_reduce_scatter_max_input_buffers": _COMMS,
    "set_separate_reduce_scatter_group": _COMMS,
    "set_allocate_memory_from_process_group_for_comm": _COMMS,
    "set_symm_mem_for_comm": _COMMS,
}


class FSDPHabits:
    """FSDP2's gradient-sync switch on a sharded model (mixed into :class:`ShardedModule`), and
    its other methods' names answered with what to do instead."""

    require_backward_grad_sync: bool

    def __getattr__(self, name: str) -> Any:
        """As the model's own lookup; an FSDP2 method it lacks raises naming the counterpart
        (an ``AttributeError`` still, so ``hasattr`` says ``False``)."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name not in _FSDP2_METHODS:
                raise
            raise AttributeError(
                f"{type(self).__name__}.{name}: FSDP2's {name}() has no namesake on a model "
                f"wrapped by ShardedModule; {_FSDP2_METHODS[name]}."
            ) from None

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """FSDP2's name for ``model.require_backward_grad_sync = requires_gradient_sync``.

        ``False``: the backwards that follow keep local, unsharded gradients without
        communication (gradient accumulation); ``True`` again: the next backward reduces all
        that was accumulated. Call it alike on every rank, before the forward.

        Raises:
            ValueError: ``recurse=False``: gradients sync for the whole model or not at all.
        """
        if not recurse:
            raise ValueError(
                "set_requires_gradient_sync(..., recurse=False) has no counterpart in "
                "shardwrap: the whole model's gradients are reduced together, or none. Call "
                "model.set_requires_gradient_sync(flag) (or enter model.no_sync())."
            )
        self.require_backward_grad_sync = requires_gradient_sync


# FSDP's arguments (``FullyShardedDataParallel``'s and ``fully_shard``'s): what to write instead.
_COUNTERPARTS = {
    "auto_wrap_policy": "write auto_wrap= (the same policy object works)",
    "mp_policy": "write mixed_precision= (the same MixedPrecisionPolicy works)",
    "offload_policy": "write offload= (the same CPUOffloadPolicy works)",
    "cpu_offload": "write offload= (the same CPUOffload works)",
    "device_id": "write device=",
    "mesh": 'write process_group= (a DeviceMesh works; ("replicate", "shard") for hybrid sharding)',
    "use_orig_params": "drop it: parameters always keep their names",
    "limit_all_gathers": "drop it: each unit's start issues the next unit's gather",
    "forward_prefetch": "drop it: each unit's start issues the next unit's gather",
    "backward_prefetch": "drop it: each unit's start issues the next unit's gather",
    "ignored_modules": "no counterpart: keep what must stay unsharded outside the wrapped model",
    "ignored_params": "no counterpart: keep what must stay unsharded outside the wrapped model",
    "ignored_states": "no counterpart: keep what must stay unsharded outside the wrapped model",
    "device_mesh": 'write process_group= (a DeviceMesh works; ("replicate", "shard") for hybrid '
    "sharding)",
    "shard_placement_fn": "no counterpart: each unit's parameters are sharded as one flat "
    "buffer, evenly over the ranks",
}

_STRATEGIES = {
    "FULL_SHARD": "stage=3 (the default)",
    "SHARD_GRAD_OP": "stage=3, reshard_after_forward=False (full parameters from forward to "
    "the end of backward), or stage=2 (kept between steps too)",
    "NO_SHARD": "stage=1 (full parameters and gradients; the optimizer state sharded)",
    "HYBRID_SHARD": 'process_group= a DeviceMesh with dimensions ("replicate", "shard")',
    "_HYBRID_SHARD_ZERO2": 'process_group= a DeviceMesh with dimensions ("replicate", "shard"), '
    "stage=2",
}


def other_arguments(arguments: dict[str, object], taken: list[str]) -> str:
    """Why ``ShardedModule`` refuses keyword ``arguments`` it does not take: each of FSDP's named
    with the argument to write instead, any other named as unknown; ``taken``: its own."""
    lines = []
    for name, value in arguments.items():
        if name == "sharding_strategy":
            strategy = getattr(value, "name", str(value))
            here = _STRATEGIES.get(strategy, "stage=1, 2 or 3")
            lines.append(f"sharding_strategy={strategy} is FSDP's; write {here}")
        elif name in _COUNTERPARTS:
            lines.append(f"{name} is FSDP's; {_COUNTERPARTS[name]}")
        else:
            lines.append(f"{name} is not an argument of ShardedModule")
    return (
        f"ShardedModule: {'; '.join(lines)}. Its arguments: {', '.join(taken)} (see "
        "docs/api.md; from FSDP and DeepSpeed: docs/fsdp.md)."
    )
