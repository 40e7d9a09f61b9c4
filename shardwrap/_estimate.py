"""The memory planner: what each rank holds when training at each stage and offload tier.

Design note. The bytes that scale with the model come from the flat layout and the wrapping
policy that ``ShardedModule`` itself uses (``_estimate_trace.py`` splits a meta-device twin of
the model into units and flat groups); activations and the optimizer's temporaries are measured
by running the meta model and one optimizer step. The planner then replays the meta run's trace,
unit boundary by unit boundary, with each stage's buffer lifetimes on top (``_strategy.py``):

- stage 3 gathers a unit before its forward and its backward and prefetches the next one into
  buffers handed on through a pool that keeps up to two spares per size (``_pool.py``); the
  root, and the unit that ran last in forward, stay gathered for backward;
- autograd holds a unit's per-parameter gradients until the last of them exists, then the unit's
  flat gradient (padded, in the reduce dtype) is built, and reduce-scattered with at most one
  reduction in flight (``_reduce.py``); stage 1 keeps every flat gradient until the end of
  backward; on the CPU over more than two ranks a reduction in flight also receives each
  peer's piece into a buffer of its own (``_collectives.py``), (N-1)/N of the group;
- the reduced 1/N gradients stay until ``zero_grad()``, through the optimizer step.

The peak is the largest sum over the replay, counted on the rank with the most real elements
(rank 0), in steady state (from the second step on: optimizer state exists, prefetch is on).
"""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ._estimate_trace import GroupSpec, Trace, causal_loss, meta_twin, optimizer_bytes, trace
from ._options import MixedPrecision
from ._wrap import AutoWrap

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
    """Shards, and at stages 1 and 2 the full parameters kept (a low-precision copy too)."""
    grads: int
    """Gradients: per-parameter ones autograd holds, flat ones, reduced 1/N shards."""
    optimizer: int
    """Optimizer state, plus its step's temporaries when the peak is in the step."""
    working_set: int
    """Gathered flat buffers: units in flight and the pool's spares (stage 3)."""
    activations: int
    """Activations and temporaries of forward and backward, measured on the meta device."""
    phase: str
    """Where the peak falls: ``"forward"``, ``"backward"`` or ``"optimizer step"``."""
    host: int = 0
    """Peak bytes in host memory beside a GPU (the cpu tier with ``device="cuda"``)."""
    disk: int = 0
    """Bytes in the disk tier's files (shards, gradient buffers, optimizer state)."""

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

    def row(self, stage: int, offload: str | None = None) -> MemoryEstimate:
        """The estimate for ``stage`` and ``offload``."""
        for r in self.rows:
            if r.stage == stage and r.offload == offload:
                return r
        raise KeyError(f"no estimate for stage {stage}, offload {offload!r} in this plan")

    def __str__(self) -> str:
        head = (
            f"{self.model}: {self.params / 1e6:,.1f}M parameters in {self.units} units, "
            f"world size {self.world_size}, batch {self.batch} x seq {self.seq}, "
            f"{self.precision}, {self.device}; per rank:"
        )
        cols = ["stage", "offload", "params", "grads", "optimizer", "working set"]
        cols += ["activations", "peak", "at"]
        extra = any(r.host for r in self.rows), any(r.disk for r in self.rows)
        cols += ["host"] * extra[0] + ["disk"] * extra[1]
        lines = [cols]
        for r in self.rows:
            sizes = [r.params, r.grads, r.optimizer, r.working_set, r.activations, r.peak]
            line = [str(r.stage), r.offload or "-", *map(_size, sizes), r.phase]
            line += [_size(r.host)] * extra[0] + [_size(r.disk)] * extra[1]
            lines.append(line)
        widths = [max(len(line[i]) for line in lines) for i in range(len(cols))]
        table = ["  ".join(c.rjust(w) for c, w in zip(line, widths)) for line in lines]
        return "\n".join([head, *table])


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
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] = "adamw",
    device: str = "cpu",
    kwargs: dict[str, Any] | None = None,
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
            (the disk tier at stage 3 only, as ``ShardedModule`` allows).
        mixed_precision: as given to ``ShardedModule``.
        batch, seq: per-rank inputs. A ``transformers`` model gets ``input_ids`` and ``labels``
            (and ``decoder_input_ids`` if it is an encoder-decoder) of shape ``(batch, seq)``;
            any other model is called on one int64 ``(batch, seq)`` tensor and returns a loss
            or logits, scored by next-token cross-entropy in fp32.
        auto_wrap: as given to ``ShardedModule``; default: a ``transformers`` model's
            ``_no_split_modules``, else the most frequent class held in an ``nn.ModuleList``.
        optimizer: ``"adamw"`` (default), ``"sgd"`` (with momentum), ``"none"``, or a factory
            ``fn(params) -> Optimizer``; it is run for one step on meta shard parameters.
        device: ``"cpu"`` or ``"cuda"``: where the model computes. It decides the default
            optimizer's implementation (foreach on CUDA) and what the cpu tier moves.
        kwargs: keyword arguments of a factory, or overrides of a config's fields.

    Returns:
        One :class:`MemoryEstimate` per stage and offload tier; ``print`` it for a table.

    Raises:
        ValueError: a stage, world size, tier, batch or optimizer out of range, or the disk
            tier below stage 3, naming the fix.
    """
    stages = (stage,) if isinstance(stage, int) else tuple(stage)
    tiers = offload if isinstance(offload, tuple) else (offload,)
    _check(world_size, stages, tiers, batch, seq, optimizer, device)
    name, model, is_hf = _meta_model(model_or_config, kwargs or {})
    ids = torch.zeros(batch, seq, dtype=torch.int64, device="meta")

    def loss_of(m: nn.Module) -> tuple[Tensor, Any]:
        if is_hf:
            extra = {"decoder_input_ids": ids} if m.config.is_encoder_decoder else {}
            out = m(input_ids=ids, labels=ids, **extra)
            return out.loss, out.logits
        out = m(ids)
        return causal_loss(out, ids), out

    wrap = auto_wrap if auto_wrap is not None else _default_wrap(model)
    tr = trace(model, wrap, world_size, mixed_precision, loss_of, fused_dropout=device == "cuda")
    state, most = optimizer_bytes(tr.groups, _optimizer(optimizer, device))
    rows = tuple(
        _Replay(tr, s, tier, state, most, device).run()
        for s in stages
        for tier in tiers
        if tier != "disk" or s == 3
    )
    precision = "fp32"
    if mixed_precision is not None and mixed_precision.param_dtype is not None:
        precision = f"{str(mixed_precision.param_dtype).removeprefix('torch.')} mixed precision"
    return MemoryPlan(
        model=name,
        params=sum(p.numel() for p in model.parameters()),
        units=len(tr.units),
        world_size=world_size,
        batch=batch,
        seq=seq,
        precision=precision,
        device=device,
        rows=rows,
    )


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


def _optimizer(
    optimizer: str | Callable[[list[nn.Parameter]], torch.optim.Optimizer], device: str
) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None:
    if callable(optimizer):
        return optimizer
    foreach = device == "cuda"  # torch's default: one foreach step on CUDA, per tensor on CPU
    if optimizer == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=foreach)
    if optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, foreach=foreach)
    return None


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
        from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

        config = AutoConfig.for_model(spec, **kwargs) if isinstance(spec, str) else spec
        auto = AutoModelForSeq2SeqLM if config.is_encoder_decoder else AutoModelForCausalLM
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


# the replay ----------------------------------------------------------------------------


class _Pool:
    """The engine's buffer pool by size: buffers in use, and up to ``keep`` spares per size."""

    def __init__(self, keep: int = 2) -> None:
        self.keep = keep
        self.holding = True
        self.in_use: dict[int, tuple[int, int]] = {}  # group -> (key, bytes)
        self.free: Counter[tuple[int, int]] = Counter()

    @property
    def bytes(self) -> int:
        return sum(n for _, n in self.in_use.values()) + sum(k[1] * c for k, c in self.free.items())

    def take(self, g: int, spec: GroupSpec) -> None:
        key = (spec.layout.padded_numel, spec.full)
        if self.free[key]:
            self.free[key] -= 1
        self.in_use[g] = (key, spec.full)

    def give(self, g: int) -> None:
        key, _ = self.in_use.pop(g)
        if self.holding and self.free[key] < self.keep:
            self.free[key] += 1


class _Replay:
    """Replays a trace with one stage's lifetimes; keeps the peak and its breakdown."""

    def __init__(
        self, tr: Trace, stage: int, tier: str | None, state: int, most: int, device: str
    ) -> None:
        self.tr, self.stage, self.offload = tr, stage, tier
        self.world = tr.groups[0].layout.world_size if tr.groups else 1
        groups = tr.groups
        host = tier == "cpu" and device == "cuda"
        disk = tier == "disk"
        shards = sum(g.shard for g in groups)
        if stage == 3:
            kept = 0
        elif host:  # the full parameters on the device, the shards on the host
            kept = sum(g.full for g in groups)
        else:  # the full parameters: the shard is a slice of them unless they compute apart
            kept = sum(g.full - (g.shard if g.compute_dtype == g.dtype else 0) for g in groups)
        self.params = kept + (0 if host or disk else shards)
        self.opt_state = 0 if host or disk else state
        self.opt_step = 0 if host else most - (state if disk else 0)
        self.shard_grads_here, self.shard_grads_host = not (host or disk), host
        self.host_fixed = shards + state if host else 0
        self.host_step = most - state if host else 0
        self.disk = shards + sum(g.shard_grad for g in groups) + state if disk else 0
        self.pool = _Pool()
        self.gathered: set[int] = set()
        self.held = [0] * len(groups)  # per-parameter gradients autograd holds, per group
        self.flat: dict[int, int] = {}  # flat gradients alive (not yet reduced)
        self.shard_grads = 0  # reduce-scatter outputs alive
        self.pending: list[int] = []  # groups whose reduction is in flight
        self.receive_peers = self.world - 1 if device == "cpu" and self.world > 2 else 0
        self.order = [
            i
            for u in sorted(range(len(tr.units)), key=lambda u: -u)
            for i, g in enumerate(groups)
            if g.unit == u and g.requires_grad
        ]
        self.ready = {i: False for i in self.order}
        self.issued = 0
        self.best: tuple[int, ...] = (-1,)
        self.phase = self.best_phase = "forward"
        self.host_peak = 0

    # accounting ----------------------------------------------------------------------

    def check(self, activations: int) -> None:
        parts = (
            self.params,
            sum(self.held)
            + sum(self.flat.values())
            + self.shard_grads * self.shard_grads_here
            + self.receive_peers * sum(self.tr.groups[g].shard_grad for g in self.pending),
            self.opt_step if self.phase == "optimizer step" else self.opt_state,
            self.pool.bytes,
            activations,
        )
        if sum(parts) > sum(self.best):
            self.best, self.best_phase = parts, self.phase
        host = self.host_fixed + (self.host_step if self.phase == "optimizer step" else 0)
        self.host_peak = max(self.host_peak, host + self.shard_grads * self.shard_grads_host)

    # units ----------------------------------------------------------------------------

    def groups_of(self, unit: int) -> list[int]:
        return [i for i, g in enumerate(self.tr.groups) if g.unit == unit]

    def gather(self, unit: int, live: int) -> None:
        if self.stage == 3 and unit not in self.gathered:
            self.gathered.add(unit)
            for g in self.groups_of(unit):
                self.pool.take(g, self.tr.groups[g])
            self.check(live)

    def reshard(self, unit: int) -> None:
        if unit in self.gathered:
            self.gathered.discard(unit)
            for g in self.groups_of(unit):
                if g in self.pool.in_use:
                    self.pool.give(g)

    # reductions -----------------------------------------------------------------------

    def issue(self, live: int) -> None:
        """Issue the reductions ready in order, one in flight at a time."""
        upto = self.issued
        while upto < len(self.order) and self.ready[self.order[upto]]:
            upto += 1
        for i in range(self.issued, upto):
            if self.pending:
                self.land()
            g = self.order[i]
            self.flat.setdefault(g, self.tr.groups[g].flat_grad)  # zeros where unused
            self.pending.append(g)
            self.shard_grads += self.tr.groups[g].shard_grad
            self.check(live)
        self.issued = max(self.issued, upto)

    def land(self) -> None:
        for g in self.pending:
            self.flat.pop(g, None)
        self.pending = []

    def complete(self, g: int, live: int) -> None:
        """A group's last per-parameter gradient exists: the flat gradient is built."""
        spec = self.tr.groups[g]
        if self.stage == 3 and g in self.pool.in_use:
            self.pool.give(g)
        self.land()
        self.flat[g] = spec.flat_grad
        self.check(live)
        self.held[g] = 0
        self.ready[g] = True
        unit = spec.unit
        if all(self.ready[i] for i in self.groups_of(unit) if i in self.ready):
            self.reshard(unit)
        if self.world == 1 and self.stage != 1:
            self.issue(live)

    # the run --------------------------------------------------------------------------

    def run(self) -> MemoryEstimate:
        tr, stage = self.tr, self.stage
        forward = [i for kind, i, _, _ in tr.events if kind == "fwd_pre"]
        backward = list(dict.fromkeys(i for kind, i, _, _ in tr.events if kind == "bwd_pre"))
        fwd_next, bwd_next = _successors(forward), _successors(backward)
        last = forward[-1] if len(forward) > 1 else None
        wanted = Counter(g for g in tr.param_group if tr.groups[g].requires_grad)
        got: Counter[int] = Counter()
        seen_bwd: set[int] = set()
        for kind, i, live, most in tr.events:
            self.check(most)
            if kind == "fwd_pre":
                self.gather(i, live)
                if i in fwd_next:
                    self.gather(fwd_next[i], live)
            elif kind == "fwd_post" and stage == 3 and self.phase == "forward":
                if i == 0:
                    for u in list(self.gathered):
                        if u not in (0, last):
                            self.reshard(u)
                elif i != last:
                    self.reshard(i)
            elif kind == "bwd_pre" and i not in seen_bwd:
                seen_bwd.add(i)
                self.phase = "backward"
                if stage != 1 and self.world > 1:
                    self.issue(live)
                self.gather(i, live)
                if i in bwd_next:
                    self.gather(bwd_next[i], live)
                else:
                    self.pool.holding = False
                    self.pool.free.clear()
            elif kind == "grad":
                g = tr.param_group[i]
                self.held[g] += tr.param_grad_bytes[i]
                got[g] += 1
                if got[g] == wanted[g]:
                    self.complete(g, live)
                else:
                    self.check(live)
        self.check(tr.end)
        self.phase = "backward"
        for u in list(self.gathered):
            self.pool.holding = False
            self.reshard(u)
        self.ready = dict.fromkeys(self.ready, True)
        self.issue(tr.kept)
        self.land()
        trainable = [g for g in tr.groups if g.requires_grad]
        # Landed shards join the shard parameters' .grad, in the shards' dtype.
        self.shard_grads += sum(g.shard for g in trainable if g.grad_dtype != g.dtype)
        self.check(tr.kept)
        self.phase = "optimizer step"
        self.shard_grads = sum(g.shard for g in trainable)
        self.check(tr.kept)
        params, grads, optimizer, working, activations = self.best
        return MemoryEstimate(
            stage=stage,
            offload=self.offload,
            params=params,
            grads=grads,
            optimizer=optimizer,
            working_set=working,
            activations=activations,
            phase=self.best_phase,
            host=self.host_peak,
            disk=self.disk,
        )


def _successors(order: list[int]) -> dict[int, int]:
    nxt: dict[int, int] = {}
    for a, b in zip(order, order[1:]):
        nxt.setdefault(a, b)
    return nxt
