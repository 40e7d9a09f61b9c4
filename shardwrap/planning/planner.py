"""The memory planner: what each rank holds when training at each stage and offload tier.

Design note. The bytes that scale with the model come from the flat layout and the wrapping
policy that ``ShardedModule`` itself uses (``planning/trace.py`` splits a meta-device twin of
the model into units and flat groups); activations are measured by running the meta model
with its parameters shown as views of per-group buffers, as the engine shows them, so that
autograd hands each group's gradients over at the moment it hands the engine's over; the
optimizer's state and temporaries by stepping it over meta shards, as the engine steps it
(``planning/step.py``). The meta run's trace is then replayed with the engine's own
decisions on top (``planning/replay.py``): gathers, prefetch and the buffer pool's spares,
flat gradients and the reductions in flight, where each tier keeps shards, gradients and
state, and the host tier's staged copies.

What the plan counts is what ``shardwrap.track_allocations`` measures: the tensors a rank
creates from wrapping on, at their peak over the first step and the steady ones after it, on
the rank with the most real elements (rank 0); where an optimizer steps whole parameters on
owner ranks (``planning/step.py``), ranks differ in their step, and the plan is the highest.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.step.strategy import Strategy
from ..engine.wrap.checks import bucket_bytes
from ..engine.wrap.policy import AutoWrap
from ..options import Compression, MixedPrecision
from .replay import Parts, Tier, replay
from .step import OptimizerFactory, optimizer_bytes, ranks_to_plan
from .tensor_parallel import localize
from .trace import Trace, causal_loss, meta_twin, trace

__all__ = ["MemoryEstimate", "MemoryPlan", "estimate_memory"]

OFFLOADS = (None, "cpu", "disk")
OPTIMIZERS = ("adamw", "sgd", "none")


@dataclass(frozen=True)
class MemoryEstimate:
    """What one rank holds at its peak, for one stage and offload tier, in bytes.

    The five parts are taken at the moment of the peak and add up to ``peak``: the compute
    device's memory (on a CPU machine, the process's memory).
    """

    stage: int
    offload: str | None
    params: int
    """Shards held in this memory, and at stages 1 and 2 the full parameters kept (the shard
    a slice of them where they compute in its dtype)."""
    grads: int
    """Flat gradients (being made, or reducing), reduced 1/N shards and the buffers peers'
    pieces land in, the host tier's kept gradient buffers, and compression's error-feedback
    residuals (a full-size flat gradient per trainable group)."""
    optimizer: int
    """Optimizer state, plus its step's temporaries when the peak is in the step."""
    working_set: int
    """Gathered flat buffers of units in flight, the pool's spares (buffers and flat
    gradients kept for reuse), and the host tier's shard copies staged for gathers."""
    activations: int
    """Activations and temporaries of forward and backward, the per-parameter gradients
    autograd holds until their group's flat gradient is made, and the previous step's outputs
    until forward returns; measured on the meta device."""
    phase: str
    """Where the peak falls: ``"forward"``, ``"backward"`` or ``"optimizer step"``."""
    host: int = 0
    """Peak bytes in host memory beside a GPU (the cpu tier with ``device="cuda"``): shards,
    their gradient buffers, the optimizer's state and step."""
    disk: int = 0
    """Bytes in the disk tier's files (shards, gradient buffers, optimizer state)."""
    checkpoint: int = 0
    """Host bytes of the copy a non-blocking save (``save_checkpoint(blocking=False)``, the
    Logbook's default) takes of this rank's shards and optimizer state (and, with compression's
    error feedback, of its residuals: a full-size flat gradient per group), kept from the first
    such save on and reused by the next; planned with ``nonblocking_saves=True``, else 0. Not
    in ``peak`` or ``host``: it is host memory beside them (on a CPU, where host memory is the
    process's, add it to ``peak``)."""

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.working_set + self.activations


@dataclass(frozen=True)
class MemoryPlan:
    """Estimates for one model, batch and world size, one row per stage and offload tier."""

    model: str
    params: int
    """Parameters of the model (each tied parameter once)."""
    units: int
    world_size: int
    batch: int
    seq: int
    precision: str
    device: str
    rows: tuple[MemoryEstimate, ...] = field(default=())
    inputs: str = ""
    """Each sample, as fed: ``"seq 128"`` (token ids), ``"3x224x224 images"``."""
    tp: int = 1
    """The tensor-parallel degree: ``world_size`` is ``world_size / tp`` dp ranks x ``tp``."""

    def row(self, stage: int, offload: str | None = None) -> MemoryEstimate:
        """The estimate for ``stage`` and ``offload``."""
        for r in self.rows:
            if r.stage == stage and r.offload == offload:
                return r
        raise KeyError(f"no estimate for stage {stage}, offload {offload!r} in this plan")

    def __str__(self) -> str:
        sample = self.inputs or f"seq {self.seq}"
        head = (
            f"{self.model}: {self.params / 1e6:,.1f}M parameters in {self.units} units, "
            f"world size {self.world_size}{self._mesh}, batch {self.batch} x {sample}, "
            f"{self.precision}, {self.device}; per rank:"
        )
        cols = ["stage", "offload", "params", "grads", "optimizer", "working set"]
        cols += ["activations", "peak", "at"]
        extra = [any(r.host for r in self.rows), any(r.disk for r in self.rows)]
        extra.append(any(r.checkpoint for r in self.rows))
        cols += ["host"] * extra[0] + ["disk"] * extra[1] + ["save copy"] * extra[2]
        lines = [cols]
        for r in self.rows:
            sizes = [r.params, r.grads, r.optimizer, r.working_set, r.activations, r.peak]
            line = [str(r.stage), r.offload or "-", *map(_size, sizes), r.phase]
            line += [_size(r.host)] * extra[0] + [_size(r.disk)] * extra[1]
            line += [_size(r.checkpoint)] * extra[2]
            lines.append(line)
        widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
        table = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join([head, *table])

    @property
    def _mesh(self) -> str:
        return f" (dp {self.world_size // self.tp} x tp {self.tp})" if self.tp > 1 else ""


def _peak(parts: Parts) -> tuple[int, int]:
    """A rank's peak, then its host memory's."""
    compute = parts.params + parts.grads + parts.optimizer + parts.working_set
    return compute + parts.activations, parts.host


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def estimate_memory(
    model_or_config: nn.Module | str | Any,
    *,
    world_size: int,
    stage: int | tuple[int, ...] = (1, 2, 3),
    offload: str | None | tuple[str | None, ...] = None,
    mixed_precision: MixedPrecision | None = None,
    batch: int = 1,
    seq: int = 128,
    auto_wrap: AutoWrap = None,
    optimizer: str | OptimizerFactory = "adamw",
    device: str = "cpu",
    kwargs: dict[str, Any] | None = None,
    compression: Compression | None = None,
    nonblocking_saves: bool = False,
    bucket_mb: float = 4,
    tp: int = 1,
    tp_plan: Mapping[str, Any] | None = None,
) -> MemoryPlan:
    """Estimate what each rank holds while training, without allocating the model.

    Args:
        model_or_config: an ``nn.Module`` (best built under ``torch.device("meta")``), a
            ``transformers`` config, a ``transformers`` model type (``"gpt2"``, ``"t5"``,
            ``"llama"``: its default config, nothing downloaded), ``"module:factory"`` or a
            callable returning a module (called on the meta device with ``kwargs``).
        world_size: ranks sharing the model.
        stage: a ZeRO stage or several.
        offload: ``None``, ``"cpu"`` or ``"disk"``, or several: one row per stage and tier
            (the disk tier at stage 3 only, as ``ShardedModule`` allows). The cpu tier with
            ``device="cpu"`` changes nothing, as in ``ShardedModule``. Offloaded optimizers
            step with torch's fused kernel where their groups leave the choice to torch.
        mixed_precision: as given to ``ShardedModule``.
        batch, seq: per-rank inputs. A ``transformers`` model gets ``input_ids`` and ``labels``
            (and ``decoder_input_ids`` if it is an encoder-decoder) of shape ``(batch, seq)``,
            or if it takes images, ``batch`` images of its config's size (``seq`` unused) and
            for a classifier their labels; any other model is called on one int64
            ``(batch, seq)`` tensor and returns a loss or logits, scored by next-token
            cross-entropy in fp32. The outputs stay alive until the next forward returns, as
            in a loop that keeps ``out = model(...)``.
        auto_wrap: as given to ``ShardedModule``; default: a ``transformers`` model's
            ``_no_split_modules``, else the most frequent class held in an ``nn.ModuleList``.
        optimizer: ``"adamw"`` (default), ``"sgd"`` (with momentum), ``"none"``, or a factory
            ``fn(params)`` returning an optimizer or several (each over some of ``params``,
            stepped in their order: Muon for the matrices, AdamW for the rest); it is stepped
            on meta shard parameters, which keep their parameters' number of dimensions as the
            engine's do. An optimizer the engine steps whole (Muon, Adafactor, one declared
            with ``shardwrap.declare_optimizer(cls, reads_shapes=True)``) is stepped as the
            engine steps it: each rank's state is that of the parameters it owns, in their
            shapes, its step holds their whole values and gradients and the all-to-all's
            buffers, and the figures are for the rank whose peak is highest.
        device: ``"cpu"`` or ``"cuda"``: where the model computes. It decides the default
            optimizer's implementation (foreach on CUDA) and what the cpu tier moves.
        kwargs: keyword arguments of a factory, or overrides of a config's fields.
        compression: as given to ``ShardedModule``: error feedback's residuals count among
            the gradients, and quantized gathers keep the full parameters apart from the
            shards at stages 1 and 2.
        nonblocking_saves: checkpoints are saved with ``save_checkpoint(blocking=False)`` (as
            the Logbook does by default): count the host copy each such save takes of a rank's
            shards and optimizer state (``MemoryEstimate.checkpoint``).
        bucket_mb: as given to ``ShardedModule``: units gathered with the next ones, flat
            gradients held until their bucket is reduced, and the packed buffers of exchanges
            of several.
        tp: the tensor-parallel degree: ``world_size`` ranks as ``world_size / tp`` dp ranks x
            ``tp``, each holding its blocks of the parameters ``tp_plan`` splits
            (``planning/tensor_parallel.py``); ``batch`` is then per dp rank (every tp rank of
            one dp rank reads the same batch).
        tp_plan: with ``tp`` above 1, the plan given to ``parallelize_module`` (module names,
            ``*`` matching one name, to ``ColwiseParallel``, ``RowwiseParallel`` or
            ``SequenceParallel``); default for a ``transformers`` model: its own ``tp_plan``.

    Returns:
        One :class:`MemoryEstimate` per stage and offload tier; ``print`` it for a table.

    Raises:
        ValueError: a stage, world size, tier, batch or optimizer out of range, the disk
            tier below stage 3, a ``transformers`` model whose inputs are neither token ids
            nor images, or one that computes no loss from them, a ``tp`` that does not divide
            ``world_size`` or a plan the planner cannot read, naming the fix.
    """
    stages = (stage,) if isinstance(stage, int) else tuple(stage)
    tiers = offload if isinstance(offload, tuple) else (offload,)
    _check(world_size, stages, tiers, batch, seq, optimizer, device)
    _check_tp(world_size, tp, optimizer, tiers)
    bucket = bucket_bytes(bucket_mb)
    name, model, is_hf = _meta_model(model_or_config, kwargs or {})
    params = sum(p.numel() for p in model.parameters())
    split: frozenset[int] = frozenset()
    if tp > 1:
        split = frozenset(localize(model, _plan_of(model, tp_plan, is_hf), tp))
    feed, inputs = _hf_inputs(model, batch, seq) if is_hf else ({}, f"seq {seq}")
    loss_of = _loss_of(is_hf, feed, torch.zeros(batch, seq, dtype=torch.int64, device="meta"))
    wrap = auto_wrap if auto_wrap is not None else _default_wrap(model)
    cuda = device == "cuda"
    tr = trace(model, wrap, world_size // tp, mixed_precision, loss_of, cuda, split)
    make_optimizer = _optimizer(optimizer)
    rows = [
        row
        for tier in tiers
        for row in _rows(
            tr, make_optimizer, stages, tier, device, compression, bucket, nonblocking_saves
        )
    ]
    rows.sort(key=lambda r: (stages.index(r.stage), tiers.index(r.offload)))
    return MemoryPlan(
        model=name,
        params=params,
        units=len(tr.units),
        world_size=world_size,
        batch=batch,
        seq=seq,
        inputs=inputs,
        precision=_precision_name(mixed_precision),
        device=device,
        rows=tuple(rows),
        tp=tp,
    )


def _check_tp(world_size: int, tp: int, optimizer: Any, tiers: tuple[str | None, ...]) -> None:
    if type(tp) is not int or tp < 1 or world_size % tp:
        raise ValueError(
            f"tp must be a positive int that divides world_size ({world_size}), got {tp!r}; "
            "e.g. world_size=8, tp=2 (4 dp ranks x 2 tp ranks)."
        )
    if tp > 1 and (callable(optimizer) or any(t is not None for t in tiers)):
        raise ValueError(
            "estimate_memory: with tp above 1 the planner plans the optimizers it names "
            '("adamw", "sgd", "none") without offload, as ShardedModule offloads nothing '
            "under tensor parallelism; plan a factory's optimizer at tp=1."
        )


def _plan_of(model: nn.Module, tp_plan: Mapping[str, Any] | None, is_hf: bool) -> Any:
    """The tensor-parallel plan: the one given, or a ``transformers`` model's own."""
    if tp_plan is not None:
        return tp_plan
    own = getattr(model, "tp_plan", None) if is_hf else None
    if not own:
        raise ValueError(
            f"estimate_memory: tp above 1 needs the plan that splits {type(model).__name__}: "
            "pass tp_plan= as given to parallelize_module (a transformers model's own plan is "
            "the default)."
        )
    return own


def _precision_name(mixed_precision: MixedPrecision | None) -> str:
    if mixed_precision is None or mixed_precision.param_dtype is None:
        return "fp32"
    return f"{str(mixed_precision.param_dtype).removeprefix('torch.')} mixed precision"


def _loss_of(is_hf: bool, feed: dict[str, Any], ids: Tensor) -> Callable[..., tuple[Tensor, Any]]:
    """How the trace scores a model: its own loss from ``feed`` (a ``transformers`` model), else
    next-token cross-entropy of ``ids``; with the outputs, which a training loop keeps until
    the next forward."""

    def loss_of(m: nn.Module) -> tuple[Tensor, Any]:
        if is_hf:
            out = m(**feed)
            if out.get("loss") is None:
                raise ValueError(
                    f"estimate_memory: {type(m).__name__} computes no loss from "
                    f"{', '.join(feed)}; plan a model with a head that does (e.g. "
                    "...ForCausalLM, ...ForImageClassification), or a factory whose "
                    "forward(ids) returns the loss ('module:factory')."
                )
            return out.loss, out
        out = m(ids)
        return causal_loss(out, ids), out

    return loss_of


def _rows(
    tr: Trace,
    make_optimizer: OptimizerFactory | None,
    stages: tuple[int, ...],
    tier: str | None,
    device: str,
    compression: Compression | None,
    bucket: int,
    nonblocking_saves: bool,
) -> list[MemoryEstimate]:
    """The estimates of one offload tier, one per stage it allows."""
    where = _tier(tier, device)
    # The offload tiers step with torch's fused kernel where the user left the choice.
    fuse = where.staged or where.disk
    steps = {
        optimizer_bytes(tr, make_optimizer, device, fuse, rank, disk=where.disk)
        for rank in ranks_to_plan(tr, make_optimizer)
    }
    # a non-blocking save's host copy: every shard, the largest rank's optimizer state, and
    # error feedback's residuals (a full-size flat gradient per trainable floating-point group)
    shards = sum(g.shard for g in tr.groups)
    world = tr.groups[0].layout.world_size if tr.groups else 1
    feedback = (
        world > 1
        and compression is not None
        and compression.grads is not None
        and compression.error_feedback
    )
    residuals = sum(
        g.layout.padded_numel * g.grad_dtype.itemsize
        for g in tr.groups
        if g.requires_grad and feedback and g.dtype.is_floating_point
    )
    state = max(step.state for step in steps)
    snapshot = shards + state + residuals if nonblocking_saves else 0
    rows = []
    for s in stages:
        if tier != "disk" or s == 3:
            # the rank that holds the most (ranks differ only in their optimizer step)
            parts = max(
                (
                    replay(tr, Strategy(stage=s), where, step, device, compression, bucket)
                    for step in steps
                ),
                key=_peak,
            )
            rows.append(MemoryEstimate(s, tier, *dataclasses.astuple(parts), checkpoint=snapshot))
    return rows


def _check(
    world_size: int,
    stages: tuple[int, ...],
    tiers: tuple[str | None, ...],
    batch: int,
    seq: int,
    optimizer: Any,
    device: str,
) -> None:
    if type(world_size) is not int or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}; e.g. 8.")
    for s in stages:
        if type(s) is not int or s not in (1, 2, 3):
            raise ValueError(f"stage must be 1, 2 or 3 (or a tuple of them), got {s!r}.")
    for tier in tiers:
        if tier not in OFFLOADS:
            raise ValueError(f'offload must be None, "cpu" or "disk", got {tier!r}.')
        if tier == "disk" and 3 not in stages:
            raise ValueError(
                'offload="disk" needs stage=3: stages 1 and 2 keep the full parameters in '
                'memory. Pass stage=3, or offload=None or "cpu".'
            )
    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be at least 1, got batch={batch}, seq={seq}.")
    if not callable(optimizer) and optimizer not in OPTIMIZERS:
        raise ValueError(
            f"optimizer must be one of {sorted(OPTIMIZERS)} or a factory fn(params), "
            f"got {optimizer!r}."
        )
    if device not in ("cpu", "cuda"):
        raise ValueError(f'device must be "cpu" or "cuda", got {device!r}.')


def _optimizer(optimizer: str | OptimizerFactory) -> OptimizerFactory | None:
    if callable(optimizer):
        return optimizer
    if optimizer == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-4)
    if optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)
    return None


def _tier(offload: str | None, device: str) -> Tier:
    """What the engine makes of ``offload`` on ``device`` (``tiers.home.make_home``): the cpu tier
    stages shards to a GPU, and changes nothing on a CPU."""
    staged = offload == "cpu" and device == "cuda"
    return Tier(staged=staged, apart=staged and device == "cuda", disk=offload == "disk")


def _meta_model(spec: Any, kwargs: dict[str, Any]) -> tuple[str, nn.Module, bool]:
    """``(name, model on the meta device, whether it is a transformers model)``."""
    if isinstance(spec, nn.Module):
        return type(spec).__name__, meta_twin(spec), _is_hf(spec)
    if isinstance(spec, str) and ":" in spec:
        module, _, attr = spec.partition(":")
        factory = getattr(importlib.import_module(module), attr)
        with torch.device("meta"):
            model = factory(**kwargs)
        return spec, model, _is_hf(model)
    if isinstance(spec, str) or type(spec).__name__.endswith("Config"):
        from transformers import (
            AutoConfig,
            AutoModelForCausalLM,
            AutoModelForImageClassification,
            AutoModelForSeq2SeqLM,
        )

        config = AutoConfig.for_model(spec, **kwargs) if isinstance(spec, str) else spec
        autos = [AutoModelForCausalLM, AutoModelForImageClassification]
        if config.is_encoder_decoder:
            autos.insert(0, AutoModelForSeq2SeqLM)
        auto = next((a for a in autos if type(config) in a._model_mapping), None)
        if auto is None:
            raise ValueError(
                f"estimate_memory: a {type(config).__name__} names no causal, sequence-to-"
                "sequence or image-classification model; build the model you train under "
                'torch.device("meta") and pass it.'
            )
        with torch.device("meta"):
            model = auto.from_config(config)
        return spec if isinstance(spec, str) else type(spec).__name__, model, True
    if callable(spec):
        with torch.device("meta"):
            model = spec(**kwargs)
        return getattr(spec, "__name__", type(model).__name__), model, _is_hf(model)
    raise TypeError(
        f"estimate_memory takes a module, a transformers config or model type (e.g. 'gpt2'), "
        f"'module:factory' or a callable, got {type(spec).__name__}."
    )


def _hf_inputs(model: nn.Module, batch: int, seq: int) -> tuple[dict[str, Tensor], str]:
    """What a ``transformers`` model is fed (on the meta device), and how the plan says it.

    1. Token models (``main_input_name`` ``input_ids``): ``input_ids`` and ``labels`` of
       ``(batch, seq)``, and ``decoder_input_ids`` for an encoder-decoder.
    2. Vision models (``pixel_values``): images of ``(batch, channels, height, width)`` from
       the config, and for an image classifier one class label per image.
    3. Anything else (audio features, ...): refused, naming the input and the fix.
    """
    kind = getattr(model, "main_input_name", "input_ids")
    config = model.config
    if kind == "input_ids":
        ids = torch.zeros(batch, seq, dtype=torch.int64, device="meta")
        feed = {"input_ids": ids, "labels": ids}
        if config.is_encoder_decoder:
            feed["decoder_input_ids"] = ids
        return feed, f"seq {seq}"
    if kind == "pixel_values":
        size = config.image_size
        height, width = (size, size) if isinstance(size, int) else tuple(size)
        shape = (batch, config.num_channels, height, width)
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
        feed = {"pixel_values": torch.zeros(shape, dtype=dtype, device="meta")}
        if "ForImageClassification" in type(model).__name__:
            feed["labels"] = torch.zeros(batch, dtype=torch.int64, device="meta")
        return feed, f"{shape[1]}x{height}x{width} images"
    raise ValueError(
        f"estimate_memory: {type(model).__name__} takes {kind!r}; the planner feeds token ids "
        "(input_ids) or images (pixel_values). Plan a factory instead ('module:factory'): a "
        "module whose forward(ids) builds this model's inputs and returns its loss."
    )


def _is_hf(model: nn.Module) -> bool:
    return any(c.__module__.startswith("transformers.") for c in type(model).__mro__)


def _default_wrap(model: nn.Module) -> tuple[type[nn.Module], ...]:
    names = set(getattr(model, "_no_split_modules", None) or ())
    if names:
        return tuple({type(m) for m in model.modules() if type(m).__name__ in names})
    counts = Counter(
        type(child)
        for m in model.modules()
        if isinstance(m, nn.ModuleList)
        for child in m
        if any(True for _ in child.parameters())
    )
    if not counts:
        raise ValueError(
            f"estimate_memory: {type(model).__name__} has no nn.ModuleList of blocks to wrap "
            "by default; pass auto_wrap= as you would to ShardedModule."
        )
    return (counts.most_common(1)[0][0],)
