"""What a DDP training script reads and sets on its model, on a sharded one.

A script written for ``DistributedDataParallel`` changes its wrap line and keeps the rest:
``raw_model = model.module``, gradient accumulation by ``model.require_backward_grad_sync``,
and a count of parameters. :class:`DDPHabits` gives :class:`ShardedModule` those names with
DDP's meaning; ``docs/ddp.md`` lists the lines that must change, and why. A line a migrated
script may keep that would go wrong without a word is refused where it runs, naming the fix:
``DistributedDataParallel(model)`` around the sharded model (its start-up broadcast would
overwrite every rank's pieces with rank 0's, and its all-reduce average pieces of different
ranges); ``torch.save(model)`` of the model object is refused too, before the file is opened.
(``copy.deepcopy(model)`` makes a sharded copy: ``engine/wrap/copies.py``.)

DDP around a module that holds a sharded model (``parent.body = ShardedModule(parent.body)``,
then ``DDP(parent)``) cannot be refused as DDP is built: its constructor asks nothing of a child
before its start-up broadcast, which overwrites every rank's pieces with rank 0's where the
pieces' shapes agree (where they differ, DDP itself raises that a parameter's sizes do not
match). :func:`refuse_ddp_outside` refuses the first forward such a DDP runs, on every rank,
before the forward's first gather: no step is ever taken on the overwritten pieces.
"""

from __future__ import annotations

import inspect
import math
import sys
import weakref
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..shards.eager import eager
from ..step.root import TRACED, Root

__all__ = ["DDPHabits", "refuse_ddp_outside"]

_HOOKS = (
    "pass mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16) to ShardedModule for "
    "fp16_compress_hook's or bf16_compress_hook's reduction in 16 bits, or "
    'compression=Compression(grads="int8") for fewer bytes still (PowerSGD\'s aim): the '
    "gradient reduction is shardwrap's own, a reduce-scatter per unit"
)
# DDP's methods that have no namesake on a sharded model: what to do instead.
_DDP_FILE = inspect.getfile(DistributedDataParallel)  # where DDP's constructor reads it
_DDP_METHODS = {
    "join": (
        "every rank must run as many forward and backward passes as the others (a rank out "
        "of batches that goes on to a save or another forward raises on every rank, naming "
        "where each is): give each rank as many batches, e.g. "
        "DistributedSampler(dataset, drop_last=True) and DataLoader(..., drop_last=True), or "
        "stop every rank at the shortest rank's count"
    ),
    "join_hook": "see join: every rank runs as many passes as the others",
    "register_comm_hook": _HOOKS,
    "_register_builtin_comm_hook": _HOOKS,
    "_set_static_graph": "drop it: each unit's gather and reduction follow the graph as it runs",
}


class DDPHabits:
    """DDP's attributes on a sharded model (mixed into :class:`ShardedModule`), and its other
    methods' names answered with what to do instead."""

    _shardwrap_root: Root

    def __getattr__(self, name: str) -> Any:
        """As the model's own lookup; a DDP method it lacks raises naming the counterpart (an
        ``AttributeError`` still, so ``hasattr`` says ``False``)."""
        try:
            return super().__getattr__(name)  # type: ignore[misc]
        except AttributeError:
            if name not in _DDP_METHODS:
                raise
            raise AttributeError(
                f"{type(self).__name__}.{name}: DistributedDataParallel's {name}() has no "
                f"namesake on a model wrapped by ShardedModule; {_DDP_METHODS[name]}."
            ) from None

    @property
    def _ddp_params_and_buffers_to_ignore(self) -> Any:
        """Read by ``DistributedDataParallel``'s constructor before its first collective, which
        is refused; to any other reader (``hasattr`` scans: ``torch.jit``, ``inspect``) the
        model has no such attribute."""
        if not sys._getframe(1).f_code.co_filename.endswith(_DDP_FILE):
            raise AttributeError("_ddp_params_and_buffers_to_ignore")
        raise TypeError(
            "DistributedDataParallel(model) around a ShardedModule: DDP would broadcast rank "
            "0's pieces of the parameters over every rank's own pieces, then average pieces "
            "that hold different ranges of each parameter. A ShardedModule averages its "
            "gradients over its ranks itself: drop the DDP(...) line (model.module, "
            "model.no_sync() and model.require_backward_grad_sync work as on DDP). To "
            "replicate over some ranks and shard over others, pass process_group= a "
            'DeviceMesh with dimensions ("replicate", "shard") (hybrid sharding).'
        )

    def __prepare_scriptable__(self) -> Any:
        """``torch.jit.script(model)`` asks this first: refused, naming what to script."""
        raise TypeError(TRACED)

    def __copy__(self) -> Any:
        """``copy.copy(model)``: a shallow copy sharing everything, as of any module (defined
        here because copying would otherwise go through ``__reduce_ex__``, which refuses)."""
        new = object.__new__(type(self))
        new.__setstate__(self.__dict__.copy())
        return new

    def __reduce_ex__(self, protocol: Any) -> Any:
        """``torch.save(model)`` (and any pickling of the model object) is refused: its
        parameters are this rank's pieces and its hooks hold the process group. ``torch.save``
        asks before it opens the file (``engine/optim/save_guard.py``), so a file it would
        replace is kept."""
        raise TypeError(
            "torch.save(model) of a ShardedModule: the model object holds this rank's pieces "
            "of its parameters and hooks tied to its process group, so no file could hold the "
            "whole model. Save its weights instead: shardwrap.save_checkpoint(path, model, "
            "optimizer) on every rank to resume training, or state = model.full_state_dict() "
            "on every rank, then torch.save(state, path) on rank 0 (it loads into the plain "
            "model with load_state_dict, and into a sharded one with load_full_state_dict)."
        )

    @property
    def module(self) -> Any:
        """DDP's ``model.module`` (``raw_model = model.module``): the model itself.

        A sharded model is not a wrapper around the user's model, it is that model (its class,
        names and methods kept), so what a DDP script reads through ``.module`` it finds here.
        A submodule, parameter or buffer the model itself names ``module`` is returned instead,
        as on the unwrapped model. NOTE: code that unwraps with ``while hasattr(m, "module"):
        m = m.module`` would loop; unwrap with ``isinstance(m, DistributedDataParallel)``.
        """
        try:
            return super().__getattr__("module")  # type: ignore[misc]
        except AttributeError:
            return self

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward reduces gradients across ranks (DDP's attribute; ``False`` inside
        :meth:`ShardedModule.no_sync`).

        ``model.require_backward_grad_sync = False`` makes the backwards that follow keep
        local, unsharded gradients without communication, until it is set ``True`` again:
        the next backward then reduces everything accumulated. Set it alike on every rank,
        before the forward, as DDP scripts do; ranks that differ raise at their next forward
        or backward, on every rank, instead of waiting for each other.
        """
        return self._shardwrap_root.reductions.sync

    @require_backward_grad_sync.setter
    def require_backward_grad_sync(self, value: bool) -> None:
        self._shardwrap_root.reductions.sync = bool(value)

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """The number of elements of the model's parameters, over all ranks' pieces.

        ``p.numel()`` of a parameter of ``model.parameters()`` is this rank's piece's (a tensor
        cannot report another size), so ``sum(p.numel() for p in model.parameters())`` after
        wrapping counts about 1/N of the model; this counts the whole, tied parameters once.
        The signature is Hugging Face's ``PreTrainedModel.num_parameters``, which this replaces
        on a sharded ``transformers`` model.

        Args:
            only_trainable: count only parameters that require a gradient.
            exclude_embeddings: leave out the weights of ``nn.Embedding`` modules.
        """
        assert isinstance(self, nn.Module)
        index = self._shardwrap_root.param_of
        embeddings = (
            {f"{n}.weight" for n, m in self.named_modules() if isinstance(m, nn.Embedding)}
            if exclude_embeddings
            else set()
        )
        total = 0
        for name, p in self.named_parameters():
            if name in embeddings or (only_trainable and not p.requires_grad):
                continue
            param = index.get(id(p))
            total += p.numel() if param is None else math.prod(param.shape)
        return total


def refuse_ddp_outside(model: nn.Module) -> None:
    """Make ``model``'s forward raise when a DDP (``DistributedDataParallel`` or ``replicate``)
    around a module holding ``model`` runs it and replicates its pieces; a DDP told to leave
    them alone (its ``parameters_to_ignore`` naming them all) runs it as any caller would."""
    harmless: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def hook(module: nn.Module, args: Any) -> None:
        ddp = DistributedDataParallel._active_ddp_module  # set for the length of its forward
        if ddp is None or ddp in harmless:
            return
        ignored = ddp.parameters_to_ignore
        managed = {id(p) for n, p in ddp.module.named_parameters() if n not in ignored}
        replicated = [n for n, p in module.named_parameters() if id(p) in managed]
        if not replicated:
            harmless.add(ddp)
            return
        # replicate()'s DDP holds a list of the parameters, where the model has no name
        where = next((n for n, m in ddp.module.named_modules() if m is module), None)
        raise TypeError(
            "DistributedDataParallel around a module that holds a ShardedModule"
            f"{f' (at {where!r})' if where else ''}: DDP replicates the ShardedModule's "
            f"parameters ({', '.join(replicated[:3])}{', ...' if len(replicated) > 3 else ''}), "
            "which are this rank's pieces. Its start-up broadcast has already copied rank 0's "
            "pieces over every other rank's, and its all-reduce would average pieces that hold "
            "different ranges: rebuild the model, then shard all of it (ShardedModule(model, "
            "auto_wrap=...) in place of DistributedDataParallel(model): the outer module's own "
            "parameters join the root unit)"
            + (
                ", or tell DDP to leave the sharded parameters alone before building it: "
                "DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, [n "
                f"for n, _ in model.named_parameters() if n.startswith({where + '.'!r})]) (the "
                "ShardedModule averages its own gradients)."
                if where
                else "."
            )
        )

    model.register_forward_pre_hook(eager(hook), prepend=True)
