"""Building a sharded model's units and root: flat groups per unit, sharded in place.

Design note. Every parameter a unit holds goes into one flat group per (dtype,
``requires_grad``, tp split, gradient dtype) key; the group keeps this rank's shard, and the
module's registered parameters become the shard parameters (the original parameters are
retired). A model built on the meta device is materialised one unit at a time as it is
sharded. The caller (``engine/wrap/sharded_module.py``) then turns the module into its sharded
class.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from ...comm.collectives import CommStats
from ...comm.mesh import Mesh
from ...comm.quantize import Codec
from ...options import Compression, MixedPrecision
from ...tiers.home import Home
from ...tiers.shard_param import NAME_ATTR, SHAPE_ATTR
from ..optim.whole_params import PIECE_ATTR, install, release
from ..shards.flat_group import FlatGroup
from ..shards.pool import BufferPool
from ..shards.tensor_parallel import local_views_for_inference, spec_of
from ..shards.unit import Unit
from ..step.root import Root
from ..step.strategy import Strategy
from . import assign
from .checks import SHARD_ATTR
from .ddp_habits import refuse_ddp_outside
from .extensions import may_train, param_replaced
from .meta_init import Materializer, ParamInitFn, agree_seed, is_meta
from .policy import Placement, group_key, reduce_dtype_of
from .resets import guard_resets
from .retired import retire

__all__ = ["build_root"]


def build_root(
    module: nn.Module,
    placement: Placement,
    mesh: Mesh,
    strategy: Strategy,
    precision: MixedPrecision | None,
    param_init_fn: ParamInitFn | None = None,
    home: Home | None = None,
    compile_options: dict[str, Any] | None = None,
    compression: Compression | None = None,
    bucket_bytes: int = 0,
) -> Root:
    """Shard ``module``'s parameters into the units ``placement`` chose and return their root
    (``bucket_bytes``: see ``comm/buckets.py``)."""
    device = mesh.device
    param_codec = (
        compression and compression.params and Codec(compression.params, compression.block)
    )
    materialize = None
    if is_meta(module):
        seed = agree_seed(mesh.control, mesh.control_device)
        materialize = Materializer(module, placement.units, device, seed, param_init_fn)
    stats = CommStats()
    pool = BufferPool()
    units: list[Unit] = []
    trainable_later = may_train(module)
    for index, (unit_module, params) in enumerate(zip(placement.units, placement.params)):
        if materialize is not None:
            meta_params, params = params, materialize(index, params)
            for name, p, _ in meta_params:
                retire(p, name)
        by_key: dict[tuple[Any, ...], list[tuple[str, nn.Parameter, list]]] = {}
        for entry in params:
            by_key.setdefault(group_key(entry[1], entry[0] in trainable_later), []).append(entry)
        frozen = sum(p.numel() for _, p, _ in params if not p.requires_grad)
        trainable = sum(p.numel() for _, p, _ in params) - frozen
        stage3 = strategy.stage3_lifetime(frozen_numel=frozen, trainable_numel=trainable)
        flat_groups = []
        for (_, grad, _, grad_dtype), entries in by_key.items():
            names = [n for n, _, _ in entries]
            originals = [p for _, p, _ in entries]
            dtype = originals[0].dtype
            compute = precision.compute_dtype(dtype) if precision else dtype
            codec = param_codec if dtype.is_floating_point else None
            resident = strategy.keeps_resident(
                stage3_lifetime=stage3,
                requires_grad=grad,
                same_dtype=compute == dtype,
                staged=home is not None and home.staged,
                quantized=codec is not None,
            )
            fg = FlatGroup(
                names,
                originals,
                [s for _, _, s in entries],
                mesh,
                pool,
                compute,
                reduce_dtype_of(dtype, grad_dtype, precision),
                grad_dtype,
                resident=resident,
                home=home,
                codec=codec,
                requires_grad=grad,
                specs=[spec_of(p) for p in originals],
            )
            for i, ((name, p, slots), shard_param) in enumerate(zip(entries, fg.shard_params)):
                shard_param.requires_grad_(p.requires_grad)
                _keep_attributes(p, shard_param)
                param_replaced(p, shard_param)
                setattr(shard_param, SHARD_ATTR, True)
                setattr(shard_param, PIECE_ATTR, (weakref.ref(fg), i, stats))
                setattr(shard_param, NAME_ATTR, name)
                setattr(shard_param, SHAPE_ATTR, tuple(p.shape))
                for owner, attr in slots:
                    owner._parameters[attr] = shard_param
                retire(p, name)
            flat_groups.append(fg)
        gone = strategy.release_after_backward or stage3  # its buffers, after backward
        units.append(Unit(unit_module, index, flat_groups, stats, stage3, bucket_bytes, gone))
    guard_resets(module)
    buffer_dtype = precision.buffer_dtype if precision else None
    for m in module.modules():
        for k, b in m._buffers.items():
            if b is None:
                continue
            dtype = buffer_dtype if buffer_dtype and b.is_floating_point() else b.dtype
            if b.device != device or b.dtype != dtype:
                m._buffers[k] = b.to(device, dtype)
    root = Root(
        units,
        mesh,
        stats,
        strategy,
        pool,
        precision,
        home,
        compile_options,
        compression,
        bucket_bytes,
    )
    refuse_ddp_outside(module)  # after Root's hooks: its own goes first, before any gather
    if mesh.tp is not None:
        local_views_for_inference(module)
    install()  # the step hooks that give shape-aware optimizers whole parameters
    weakref.finalize(root, release)
    root.assignments = assign.Assignments(module, units, root.note_change)
    assign.install()  # the hooks that see parameters and modules assigned after wrapping
    weakref.finalize(root, assign.release)
    return root


def _keep_attributes(original: nn.Parameter, shard_param: nn.Parameter) -> None:
    """What a user set on a parameter (a tag such as ``p._no_weight_decay = True``, which an
    optimizer's groups are built from, or per-parameter settings) and the hooks registered on
    it (``register_hook``, ``register_post_accumulate_grad_hook``) stay on it, as under DDP and
    DeepSpeed, which keep the parameter object: copied onto its shard parameter."""
    for key, value in vars(original).items():
        if key != "_is_param" and not key.startswith("_shardwrap"):
            setattr(shard_param, key, value)
    for hook in (original._backward_hooks or {}).values():
        shard_param.register_hook(hook)
    for hook in (original._post_accumulate_grad_hooks or {}).values():
        shard_param.register_post_accumulate_grad_hook(hook)
