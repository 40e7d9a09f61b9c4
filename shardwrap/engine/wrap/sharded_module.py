"""``ShardedModule``: the public wrapper.

``ShardedModule(model, ...)`` shards ``model`` in place and returns the same object with
its class swapped for a subclass of both ``ShardedModule`` and the original class, so
``isinstance(model, OriginalClass)``, attribute access, parameter names and state-dict
keys are those of the original model.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...comm.collectives import CommStats
from ...comm.failures import CollectiveFailed
from ...comm.mesh import resolve_mesh
from ...options import Compression
from ...tiers.home import make_home
from ...tiers.shard_param import ShardData, ShardParam
from ..optim.averaged import guard_averaged_updates
from ..optim.dcp_pieces import DCPPiece, dcp_call, refuse_tensor_parallel
from ..optim.pieces import as_piece
from ..optim.save_guard import guard_torch_save
from ..shards.tensor_parallel import check_tensor_parallel
from ..step.edits import check_modifier_rank
from ..step.inference import fits_gathered
from ..step.own_calls import given_hint, piece_hint, precision_hint
from ..step.recompute import compile_unit, recompute_activations
from ..step.root import Root
from ..step.strategy import Strategy
from .agree_values import copy_from_rank0, differing_values, warn_copied
from .build import build_root
from .checks import (
    ROOT_ATTR,
    UNIT_ATTR,
    bucket_bytes,
    check_device,
    check_options,
    check_same_model,
    check_wrappable,
    checkpoint_policy,
    describe,
    resolve_compile,
    unit_plan,
    warn_shadowed,
)
from .copies import CopyRecipe, plain_keys, sharded_copy
from .ddp_habits import DDPHabits
from .extensions import check_prepare, checkpoint_unit, class_habits
from .from_fsdp import FSDPHabits, other_arguments, own_mixed_precision, own_offload
from .full_state import full_state, taking_full_state
from .loads import SHARDS_OF, guard_submodule_loads, load_full, load_state
from .meta_init import ParamInitFn, check_param_init_fn, is_meta
from .moves import Moves
from .policy import AutoWrap, check_selects_something, place_parameters, resolve_policy
from .summary import log_summary, summarize

if TYPE_CHECKING:
    from .from_fsdp import MixedPrecisionArg, OffloadArg

__all__ = ["ShardedModule"]


class ShardedModule(DDPHabits, FSDPHabits, Moves, nn.Module):
    """Shard a model's training state across ranks (ZeRO stage 1, 2 or 3), keeping its identity.

    Every submodule that ``auto_wrap`` selects becomes a *unit*; the root holds the
    parameters no unit took. Each unit keeps a flat, padded 1/N shard of its parameters,
    all-gathers them just before its forward and its backward, releases them afterwards,
    and reduce-scatters its gradient so the optimizer steps on the local shard.

    ``model.parameters()`` yields one ``nn.Parameter`` per original parameter, with its
    original name: this rank's piece of it (possibly empty), in as many dimensions as the
    parameter, its elements along the last one (a matrix's piece is ``(1, k)``). Build the
    optimizer from them *after* wrapping; any elementwise torch optimizer works unchanged.

    Args:
        module: the model to shard, in place. Its parameters must all be on one device.
        auto_wrap: which submodules become units: a module class, a tuple of classes, a
            callable ``(module) -> bool``, or an int (minimum parameter count). ``None``
            makes the whole model one unit.
        process_group: the ranks to shard over. Defaults to the default group when
            ``torch.distributed`` is initialised, else world size 1 (``python train.py``;
            refused where ``WORLD_SIZE`` or ``LOCAL_WORLD_SIZE`` says several processes).
        device: where shards live. Defaults to ``cuda:$LOCAL_RANK`` with NCCL, else the
            parameters' device.
        stage: the ZeRO stage. 3 (default): parameters, gradients and optimizer state are
            all sharded; each unit is gathered for its forward and again for its backward.
            2: full parameters are kept between steps (gathered once per step, after the
            optimizer changed the shards), gradients are reduce-scattered per unit in
            backward. 1: as 2, but gradients stay full until the end of backward and are
            reduced then. The optimizer steps on 1/N shards at every stage.
        reshard_after_forward: stage 3 only. ``True`` (default): release each unit's gathered
            parameters after its forward (least memory); ``False``: keep them until its
            backward (one all-gather fewer per unit and step).
        mixed_precision: compute in a lower precision (see :class:`MixedPrecision`); the
            shards, and so the optimizer, stay in the parameters' own dtype. ``None``: no
            casts at all. FSDP's ``MixedPrecisionPolicy`` and ``MixedPrecision`` are taken as
            the same settings (what has no counterpart is refused, naming the line to write).
        checkpoint_activations: recompute units' activations in backward instead of keeping
            them (non-reentrant activation checkpointing of the unit's ``forward``, inside the
            sharding hooks; the recomputation reuses the backward all-gather). ``True``: every
            unit but the root; or a policy of the same forms as ``auto_wrap``, choosing among
            the units.
        compile: ``torch.compile`` each unit's ``forward`` (units that enclose no other unit;
            the root and enclosing units run eagerly, so the sharding hooks stay outside every
            compiled graph). ``True`` for the defaults, or a dict of ``torch.compile`` options.
        param_init_fn: for a model built under ``with torch.device("meta"):``, called as
            ``param_init_fn(module)`` on each module instead of its ``reset_parameters()``.
            Such a model is materialised one unit at a time, each unit in full on every rank
            from a seed rank 0 draws, then sharded: memory stays near one unit.
        offload: ``Offload(device="disk", path=...)`` keeps the shards, their gradients and
            the optimizer state in files under ``path`` (stage 3, CPU compute device);
            ``Offload(device="cpu")`` keeps them in pinned host memory while a GPU computes
            (any stage). See :class:`Offload`. FSDP's ``CPUOffloadPolicy()`` and
            ``CPUOffload(offload_params=True)`` mean ``Offload(device="cpu")``.
        sync_module_states: ``None`` (default): check that every parameter and buffer has
            the same values on every rank (one pass over the weights, one small
            collective), and copy rank 0's values of those that differ to every rank, as
            DDP does (a seed per rank), with a warning naming them. ``True``: copy them all
            from rank 0 before sharding, without the check (weights loaded on rank 0 only).
            ``False``: neither, for weights loaded after wrapping (``load_pretrained``,
            ``load_full_state_dict``, ``load_checkpoint``). A meta-device model is built
            alike on every rank and needs neither.
        compression: quantize the gathers for compute and the gradient reductions on the
            wire (see :class:`Compression`); shards, optimizer state and checkpoints stay
            exact. ``None`` (default): every collective sends its tensors as they are.
        bucket_mb: small units' gathers, and small groups' gradient reductions, go in one
            exchange of up to this many MiB (4 by default; 0: one exchange each): on a
            backend that pays per message (gloo) that is most of a small model's step. A unit
            gathered with the next ones stays gathered until its own forward or backward
            releases it: memory of at most one bucket more.
        other: none is taken; one of FSDP's (``sharding_strategy``, ``device_id``,
            ``mp_policy``, ...) is refused naming the argument to write instead.

    Raises:
        RuntimeError: no process group while a launcher started several processes (each
            would train its own copy), naming ``init_process_group``.
        TypeError: ``auto_wrap``, ``checkpoint_activations``, ``mixed_precision``,
            ``compile`` or ``bucket_mb`` of an unsupported type; an argument it does not take.
        ValueError: an ``auto_wrap`` that selects no submodule (naming the classes the model
            has), a ``stage`` other than 1, 2 or 3, a negative ``bucket_mb``,
            ``reshard_after_forward`` given with a stage other than 3, or ranks whose
            arguments, or the units they make, differ (agreed with the model's parameters in
            one small collective before any flat buffer is communicated; every rank raises,
            naming each and every rank's value).
        ValueError: a model already wrapped, parameters on several devices, a
            ``param_init_fn`` for a model not on the meta device, a meta-device tensor no
            initialiser wrote (every rank raises, naming each), or parameter names, shapes or
            dtypes that differ across ranks (checked with one small collective; every rank
            raises, naming the first difference).
    """

    _shardwrap_root: Root

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """The class a wrapped model takes (made by ``_sharded_class``) runs none of its model
        class's ``__init_subclass__`` hooks: they are for the user's own subclasses (a registry
        would record shardwrap's class; required class arguments would be missing)."""
        if "_shardwrap_made" not in cls.__dict__:
            super().__init_subclass__(**kwargs)

    def __new__(
        cls,
        module: nn.Module,
        *,
        auto_wrap: AutoWrap = None,
        process_group: dist.ProcessGroup | None = None,
        device: torch.device | str | None = None,
        stage: int = 3,
        reshard_after_forward: bool | None = None,
        mixed_precision: MixedPrecisionArg = None,
        checkpoint_activations: bool | AutoWrap = False,
        compile: bool | dict[str, Any] = False,
        param_init_fn: ParamInitFn | None = None,
        sync_module_states: bool | None = None,
        offload: OffloadArg = None,
        compression: Compression | None = None,
        bucket_mb: float = 4,
        **other: Any,
    ) -> ShardedModule:
        if other:
            raise TypeError(other_arguments(other, list(ShardedModule.__new__.__kwdefaults__)))
        if not isinstance(module, nn.Module):
            raise TypeError(f"ShardedModule wraps an nn.Module, got {type(module).__name__}")
        check_wrappable(module)
        warn_shadowed(module, _OWN_NAMES)
        policy = resolve_policy(module, auto_wrap)
        check_selects_something(module, policy, auto_wrap)
        device = check_device(module, device)
        check_param_init_fn(module, param_init_fn)
        strategy = _strategy(stage, reshard_after_forward)
        mixed_precision = own_mixed_precision(mixed_precision, module)
        offload = own_offload(offload)
        check_options(stage, device, mixed_precision, offload, compression)
        unsupported = {"offload": offload is not None, "compile": bool(compile)}
        check_tensor_parallel(module, process_group, {**unsupported, "meta init": is_meta(module)})
        bucket = bucket_bytes(bucket_mb)
        checkpoint = checkpoint_policy(module, policy, checkpoint_activations)
        compile_options = resolve_compile(compile)
        placement = place_parameters(module, policy)
        mesh = resolve_mesh(process_group, device)
        arguments = {
            "stage": stage,
            "reshard_after_forward": strategy.reshard_after_forward,
            "auto_wrap": auto_wrap,
            "mixed_precision": mixed_precision,
            "checkpoint_activations": checkpoint_activations,
            "compile": compile_options,
            "param_init_fn": param_init_fn,
            "sync_module_states": sync_module_states,
            "offload": offload and f"Offload(device={offload.device!r})",  # paths may differ
            "compression": compression,
            "bucket_mb": bucket_mb,
            "device": device.type,  # its index may differ: a GPU per rank
            "process_group": f"{mesh.shard_size} shard x {mesh.replicate_size} replicate ranks",
            "model built on the meta device": is_meta(module),
        }
        agreed = {name: describe(value) for name, value in arguments.items()}
        agreed.update(unit_plan(module, placement, checkpoint))
        check_same_model(module, mesh.control, mesh.control_device, agreed)
        if sync_module_states and not is_meta(module):
            copy_from_rank0(module, mesh)
        elif sync_module_states is None and not is_meta(module):
            differ = differing_values(module, mesh)
            if differ:  # as DDP does: rank 0's weights, and a word of it
                copy_from_rank0(module, mesh, differ)
                warn_copied(module, differ)
        home = make_home(offload, device, mesh.rank)
        before = plain_keys(module)
        root = build_root(
            module,
            placement,
            mesh,
            strategy,
            mixed_precision,
            param_init_fn,
            home,
            compile_options,
            compression,
            bucket,
        )
        _make_sharded(module, root)
        guard_submodule_loads(module, root)
        again = {
            "auto_wrap": auto_wrap,
            "process_group": process_group,
            "device": device,
            "stage": stage,
            "reshard_after_forward": reshard_after_forward,
            "mixed_precision": mixed_precision,
            "checkpoint_activations": checkpoint_activations,
            "compile": compile,
            "offload": offload,
            "compression": compression,
            "bucket_mb": bucket_mb,
        }
        root.copy_recipe = CopyRecipe(again, before)
        guard_torch_save(ShardedModule, ShardParam, ShardData)  # refused before opening the file
        guard_averaged_updates()
        unit_modules = {id(u.module) for u in root.units}
        for unit in root.units[1:]:
            inner = (m for m in unit.module.modules() if m is not unit.module)
            if compile_options is not None and not any(id(m) in unit_modules for m in inner):
                compile_unit(root.own_calls, unit, compile_options)
            if checkpoint(unit.module) and not checkpoint_unit(root, unit):
                recompute_activations(root, unit)
        log_summary(module, root)
        return module  # type: ignore[return-value]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Wrapping happens in ``__new__``; the wrapped module is already initialised."""

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedModule:
        """``copy.deepcopy(model)`` (``AveragedModel(model)``, a teacher, a reference model): a
        sharded copy, wrapped alike over the same ranks, holding the same values and training
        on its own (``engine/wrap/copies.py``). Every rank copies."""
        return sharded_copy(self, self._shardwrap_root, memo, ShardedModule)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the model; a forward that fails on the shape of a parameter's piece (a
        parameter read outside its unit's forward, or pieces given to ``functional_call``), or
        on float32 met with the compute dtype of mixed precision (a dtype read from the
        pieces), raises naming it and the fixes."""
        try:
            return super().__call__(*args, **kwargs)
        except (RuntimeError, ValueError, IndexError) as e:
            if isinstance(e, CollectiveFailed):
                raise
            root = self._shardwrap_root
            hint = (
                given_hint(root.units, e)
                or piece_hint(root.units, e)
                or precision_hint(root.precision, e)
            )
            if hint is None:
                raise
            raise RuntimeError(hint) from e

    @property
    def _is_accelerate_prepared(self) -> bool:
        """accelerate's mark for a model it must hand back untouched: no DDP (the model reduces
        its own gradients), no move, no autocast wrapper. accelerate reads it as it prepares
        the model, so the integrations' prepare checks run then (``check_prepare``)."""
        check_prepare(self)
        return True

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        """accelerate marks what it prepared; a sharded model is marked for good."""

    @property
    def comm_stats(self) -> CommStats:
        """Calls and bytes of every collective this model issued since the last reset."""
        return self._shardwrap_root.stats

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally, unsharded, without communication.

        Backward passes inside the block keep full, unreduced flat gradients (memory like
        DDP); the first backward after the block reduces everything accumulated. Every rank
        must enter the block alike.
        """
        with self._shardwrap_root.no_sync():
            yield

    @contextmanager
    def gathered(
        self,
        writeback: bool | None = None,
        modifier_rank: int | None = None,
        with_grads: bool = False,
    ) -> Iterator[None]:
        """Make the full parameters readable (and, with ``writeback``, writable) outside forward.

        Inside the block ``module.weight`` and friends are full tensors. Gathers every unit at
        once: memory of the whole model. Call on every rank.

        Args:
            writeback: copy in-place edits into the shards on exit (``None``: only where a
                ``modifier_rank`` is given); otherwise they are discarded.
            modifier_rank: the rank whose edits count (weights loaded on rank 0 only): its full
                parameters are sent to every rank on exit, then written back. Without one, every
                rank must make the same edits: they are compared on exit (one small all-reduce)
                and, where a parameter differs across ranks, every rank raises ``ValueError``
                naming it, writing nothing back.
            with_grads: give each full parameter its whole gradient as ``.grad`` (averaged
                over the ranks, as the unwrapped model's), gathered from the ranks' pieces:
                memory of the whole model's gradients too. Read-only: edits to them are not
                written back. Refused on every rank while gradients accumulated under
                ``no_sync()`` are not yet reduced.

        Where a rank raises inside the block, no rank writes anything back (the others raise
        ``RuntimeError`` saying so).
        """
        root = self._shardwrap_root
        writeback = check_modifier_rank(modifier_rank, writeback, root.mesh)
        if not isinstance(with_grads, bool):
            raise TypeError(f"gathered(with_grads=...) takes True or False, not {with_grads!r}")
        with root.gathered(writeback, modifier_rank, with_grads):
            yield

    @contextmanager
    def keep_gathered(self, enabled: bool | None = None) -> Iterator[None]:
        """Keep units gathered across forwards without a graph: generation, evaluation.

        Each unit is then gathered once for the whole block instead of once per forward (per
        decoded token in ``generate()``), at the memory of the whole model in its compute
        dtype; the units are released when the block ends. ``generate()`` and
        ``shardwrap.hf.Trainer``'s ``evaluate()``/``predict()`` enter it themselves.

        Args:
            enabled: ``None`` (default): keep them only if the units not gathered yet fit in
                half the memory free now on every rank (one small all-reduce decides, alike on
                every rank); ``True``: keep them; ``False``: gather per forward as in training.
                Must be the same on every rank.
        """
        root = self._shardwrap_root
        if root.keeping or root.keep_decided is not None:  # inside another such block
            yield
            return
        keep = fits_gathered(root) if enabled is None else enabled
        root.keep_decided = keep
        try:
            if keep:
                with root.keep_gathered():
                    yield
            else:
                yield
        finally:
            root.keep_decided = None

    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> Tensor:
        """Clip gradients by their global norm over all ranks, as ``clip_grad_norm_`` does.

        The same as ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, which on a
        sharded model also takes the global norm (each shard's ``.grad`` knows it is a
        shard). Call on every rank.

        Returns:
            The total norm of the gradients (before clipping), identical on every rank.
        """
        return torch.nn.utils.clip_grad_norm_(
            list(self.parameters()), max_norm, norm_type, error_if_nonfinite
        )

    def summary(self) -> str:
        """What the wrap produced: ranks, stage, units, dtypes, offload tier and memory per
        rank (also logged at wrap time: logger ``"shardwrap"``, INFO, global rank 0)."""
        return summarize(self, self._shardwrap_root)

    def register_forward_pre_hook(
        self, hook: Any, *, prepend: bool = False, with_kwargs: bool = False
    ) -> Any:
        """As ``nn.Module``'s; a hook given ``prepend=True`` still runs after the model's own
        unit gathers, so it sees the full parameters as every pre-hook does."""
        handle = super().register_forward_pre_hook(hook, prepend=prepend, with_kwargs=with_kwargs)
        root = vars(self).get(ROOT_ATTR)
        if root is not None:
            root.gather_hooks_first()
        return handle

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, Tensor]:
        """The original model's state dict: same keys, full shapes, CPU tensors.

        Gathers one flat group at a time, so device memory stays near one unit. The modules'
        state-dict hooks see the full values, as on the unwrapped model. Every rank must call
        it; with ``rank0_only`` the other ranks get an empty dict.
        """
        root = self._shardwrap_root
        root.settle()
        root.check_state()
        root.schedule.enter("full_state_dict")
        return full_state(self, root, rank0_only)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """Load the unwrapped model's full state dict, or this rank's own shards, by copy, also
        with ``assign=True`` (the shards are views of the flat buffers the gathers read).

        1. Every sharded parameter given in full shape (``torch.load`` of a plain model's
           ``state_dict()``, or ``full_state_dict()``): loaded as :meth:`load_full_state_dict`
           does, each rank taking its pieces; with ``strict=False`` some of them (a pretrained
           backbone under a new head), the rest left as they are and named in the result.
        2. Every sharded parameter in this rank's piece shape (``state_dict()`` of a
           wrapped model at the same world size, on the same rank): loaded as
           ``nn.Module.load_state_dict`` does. So are the pieces DCP loaded into
           (``set_model_state_dict``), once checked to be this rank's.

        Raises:
            ValueError: parameters of neither shape (also a ``RuntimeError``, in torch's words:
                ``size mismatch for ...``), or of both kinds mixed, or another rank's
                ``state_dict()`` (it records whose shards it holds), naming them and the calls
                that load checkpoints.
        """
        return load_state(self, state_dict, strict)

    def load_full_state_dict(self, state_dict: Mapping[str, Tensor], strict: bool = True) -> Any:
        """Load a plain (unsharded) state dict into the shards and buffers: each rank copies
        its pieces, with no communication.

        Args:
            state_dict: the unwrapped model's ``state_dict()``, or ``full_state_dict()``.
            strict: every key of the model, and no other; with ``False`` the keys given are
                loaded and the rest keep their values, as ``nn.Module.load_state_dict`` does.

        Returns:
            ``(missing_keys, unexpected_keys)``, as ``nn.Module.load_state_dict`` returns them.

        Raises:
            KeyError: where ``strict``, naming every missing and unexpected key.
            ValueError: naming every parameter or buffer whose shape differs (with ``strict``
                or not, as torch does); nothing is loaded then.
        """
        return load_full(self, state_dict, strict)


# construction ------------------------------------------------------------------------

_CLASSES: dict[type, type] = {}
# the public names a sharded model answers with shardwrap's own, not nn.Module's
_OWN_NAMES = [n for n in dir(ShardedModule) if not n.startswith("_") and n not in dir(nn.Module)]


def _sharded_class(cls: type) -> type:
    if cls not in _CLASSES:

        def plain(_: type, *args: Any, **kwargs: Any) -> nn.Module:
            """The model's own code making another of its class (``Sequential`` slices with
            ``self.__class__(...)``) gets a plain one, as on the unwrapped model."""
            return cls(*args, **kwargs)

        bases = (ShardedModule, *class_habits(cls), cls)
        namespace = {"__module__": cls.__module__, "__new__": plain, "_shardwrap_made": True}
        _CLASSES[cls] = type(cls.__name__, bases, namespace)
    return _CLASSES[cls]


def _make_sharded(module: nn.Module, root: Root) -> None:
    """Turn ``module``, whose units ``root`` drives, into its sharded class."""
    mesh = root.mesh
    # each state-dict key of a sharded parameter (a tied one has several): its parameter
    pieces = {
        key: root.param_of[id(v)]
        for key, v in nn.Module.state_dict(module, keep_vars=True).items()
        if id(v) in root.param_of
    }

    def note_shards(m: nn.Module, state: Any, prefix: str, local_metadata: dict) -> None:
        if taking_full_state():
            return
        local_metadata[SHARDS_OF] = (mesh.shard_rank, mesh.shard_size)
        taken = {  # with keep_vars, the shard parameters themselves: left as they are
            k: v
            for k in pieces
            if isinstance(v := state.get(prefix + k), Tensor) and not isinstance(v, nn.Parameter)
        }
        call = dcp_call() if taken else None
        if call is not None:
            refuse_tensor_parallel(mesh, call)
        full = {}
        if call is not None and call.full:  # DCP asks for the whole tensors
            full = module.full_state_dict(rank0_only=call.rank0_only)  # type: ignore[operator]
        for key, value in taken.items():
            param, at = pieces[key], prefix + key
            piece = param.group.pieces[param.index]
            if call is None:
                state[at] = as_piece(value, param.shape, piece.start, piece.stop)
            elif not call.full:
                state[at] = DCPPiece(value, param.shape, piece.start, piece.stop)
            elif full:  # else a rank that DCP keeps nothing of (rank0_only)
                state[at] = full[key]

    module.register_state_dict_post_hook(note_shards)
    module.__class__ = _sharded_class(type(module))
    object.__setattr__(module, ROOT_ATTR, root)
    for unit in root.units[1:]:
        object.__setattr__(unit.module, UNIT_ATTR, unit)


def _strategy(stage: int, reshard_after_forward: bool | None) -> Strategy:
    if reshard_after_forward is not None and not isinstance(reshard_after_forward, bool):
        raise TypeError(
            f"reshard_after_forward={reshard_after_forward!r}: True, False or None; an int "
            "(FSDP2's reshard to a smaller group of ranks) has no counterpart in shardwrap."
        )
    if reshard_after_forward is not None and stage in (1, 2):
        raise ValueError(
            f"reshard_after_forward is a stage-3 option; stage {stage} keeps the full "
            "parameters between steps. Drop reshard_after_forward, or pass stage=3."
        )
    return Strategy(stage=stage, reshard_after_forward=reshard_after_forward is not False)


# checks ------------------------------------------------------------------------------
