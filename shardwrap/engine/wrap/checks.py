"""Checks of ``ShardedModule``'s arguments, made before any parameter is moved.

Each names the problem and the fix. The only one that communicates, :func:`check_same_model`,
is one small all-reduce, so every rank raises alike instead of some hanging later: it agrees on
the model's parameters, on every argument of ``ShardedModule`` and on the unit plan they lead
to, before any flat buffer is communicated. Only where something differs does a second
collective gather what each rank has, so that every rank names it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.nn.parameter import UninitializedTensorMixin
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from ...comm.collectives import Group, all_reduce, group_size
from ...options import Compression, MixedPrecision, Offload
from ..shards.layout import view_end
from ..shards.tensor_parallel import is_dtensor
from .policy import AutoWrap, Placement, group_key, resolve_policy
from .retired import is_retired

__all__ = [
    "bucket_bytes",
    "check_device",
    "check_options",
    "check_same_model",
    "check_wrappable",
    "checkpoint_policy",
    "describe",
    "resolve_compile",
    "unit_plan",
    "warn_shadowed",
]

ROOT_ATTR = "_shardwrap_root"
UNIT_ATTR = "_shardwrap_unit"
SHARD_ATTR = "_shardwrap_shard"


# Packages whose classes shardwrap's integrations answer for on purpose (transformers'
# num_parameters counts the whole model on a sharded one).
_INTEGRATED = ("transformers.", "peft.")


def warn_shadowed(module: nn.Module, names: list[str]) -> None:
    """Warn where the model's class or the model itself holds one of ``names``, which the
    sharded model answers with shardwrap's own (a ``summary()`` method, a ``comm_stats``
    attribute): after wrapping, ``model.<name>`` is shardwrap's."""
    clashes = []
    for name in names:
        if name in module._modules or name in module._parameters or name in module._buffers:
            continue  # found by shardwrap's lookup too (``module``)
        if name in vars(module):
            clashes.append(f"{name} (an attribute: read it as vars(model)[{name!r}])")
            continue
        owner = next((c for c in type(module).__mro__ if name in vars(c)), None)
        if owner not in (None, nn.Module) and not owner.__module__.startswith(_INTEGRATED):
            clashes.append(f"{name} ({owner.__name__}'s: call {owner.__name__}.{name}(model))")
    if clashes:
        warnings.warn(
            f"ShardedModule: {type(module).__name__} has names that the sharded model answers "
            f"with shardwrap's own: {', '.join(clashes)}. After wrapping, model.<name> is "
            "shardwrap's (see docs/api.md); the model's own stays reachable as said.",
            stacklevel=3,
        )


def check_wrappable(module: nn.Module) -> None:
    """Refuse, before any collective, a model wrapped already (or a part of it), holding an
    uninitialized (lazy) tensor or a parameter with a layout of its own, which the flat shards
    cannot hold, or an embedding that renormalises its weight in place during forward."""
    for name, m in module.named_modules():
        if hasattr(m, ROOT_ATTR) or hasattr(m, UNIT_ATTR):
            already_wrapped("the model" if not name else f"its submodule '{name}'")
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            _renorming_embedding(name, m)
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if isinstance(t, UninitializedTensorMixin):
            raise ValueError(
                f"ShardedModule: '{name}' is uninitialized (a lazy module, nn.Lazy*): its shape "
                "is known only after the module's first forward, and shards are cut from "
                "shapes. Run one forward with a batch of the real shapes before wrapping, or "
                "build the module with its sizes."
            )
    _refuse_shared_memory(module)
    for name, p in module.named_parameters():
        if getattr(p, SHARD_ATTR, False):
            already_wrapped(f"its parameter '{name}' (part of a wrapped model)")
        if is_retired(p):
            raise ValueError(
                f"ShardedModule: parameter '{name}' was moved into another ShardedModule when a "
                "model holding it was wrapped, and the tensor here is the one from before, "
                "freed (a parameter shared by two models, or tied across a wrapped module's "
                "boundary). Wrap one model that holds every use of it, choosing its units with "
                "auto_wrap."
            )
        if _has_own_layout(p):
            raise TypeError(
                f"ShardedModule: parameter '{name}' is a {type(p).__module__}."
                f"{type(p).__name__}, a tensor with a layout of its own (NF4's or "
                "bitsandbytes' quantized blocks and scales, a float8 tensor's scale): shards "
                "are plain tensors of one dtype, into which that layout cannot be split, and "
                "it would compute as a plain tensor. Give the model plain parameters before "
                "wrapping (for QLoRA-style training, a frozen bfloat16 base beside the "
                "trainable adapters: frozen parameters are sharded too). DTensor parameters "
                '(tensor parallelism, with a "tp" dimension in process_group) are the one '
                "tensor subclass taken."
            )


def _refuse_shared_memory(module: nn.Module) -> None:
    """Refuse a parameter whose memory another parameter or a buffer also views (a buffer
    registered as ``weight.data``, a parameter made of a slice of another's data): on the
    plain model they change together; wrapping moves each parameter into its unit's flat shard,
    and they would part ways without a word. The same ``nn.Parameter`` under two names (tied
    weights) is one parameter, and taken."""
    spans: dict[int, list[tuple[int, int, str, bool]]] = {}
    tensors = [(n, t, True) for n, t in module.named_parameters()]
    tensors += [(n, t, False) for n, t in module.named_buffers()]
    for name, t, is_param in tensors:
        if t.device.type == "meta" or t.numel() == 0:
            continue
        try:
            storage = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # a subclass without plain storage
            continue
        size = t.element_size()
        start = t.storage_offset()
        stop = view_end(start, t.shape, t.stride())
        spans.setdefault(storage, []).append((start * size, stop * size, name, is_param))
    for entries in spans.values():
        if len(entries) < 2 or not any(is_param for *_, is_param in entries):
            continue
        entries.sort()
        reach, held = entries[0][1], entries[0]
        for entry in entries[1:]:
            if entry[0] < reach and (entry[3] or held[3]):
                param, other = (held, entry) if held[3] else (entry, held)
                kind = "parameter" if other[3] else "buffer"
                apart = "they would part ways" if other[3] else "the buffer would stay as it is"
                raise ValueError(
                    f"ShardedModule: {kind} '{other[2]}' shares memory with parameter "
                    f"'{param[2]}' (one views the other's data): on the plain model they change "
                    "together, but wrapping moves each parameter into its unit's flat shard, so "
                    f"{apart}, silently. Before wrapping, tie "
                    "parameters by assigning the same nn.Parameter (module.b = module.a), and "
                    "take a view of a parameter in forward (self.weight[:2]) instead of "
                    "registering it."
                )
            if entry[1] > reach:
                reach, held = entry[1], entry


def _renorming_embedding(name: str, m: nn.Module) -> None:
    kind, norm = type(m).__name__, m.max_norm
    where = f"submodule '{name}'" if name else "the model"
    raise ValueError(
        f"ShardedModule: {where} is an nn.{kind} with max_norm={norm}: its forward "
        "renormalises, in place, the rows of its weight that it looks up. A sharded model's "
        "forward computes with a gathered copy of the weight that is dropped afterwards, so "
        "those writes could never reach the shards (and each rank looks up other rows; under "
        "DDP the replicas would drift apart). Build it with max_norm=None and bound the rows "
        "after each optimizer step, on every rank: with model.gathered(writeback=True): "
        f"w = model.get_submodule('{name}').weight; "
        f"w.copy_(torch.renorm(w, {m.norm_type}, 0, {norm})) (every row, not only those a batch "
        "looked up)."
    )


def _has_own_layout(p: Tensor) -> bool:
    """Whether ``p`` is a tensor subclass other than tensor parallelism's DTensor (torchao's NF4
    and float8 tensors, ...) or one of bitsandbytes' quantized parameters (packed codes beside
    their quantization state)."""
    if is_traceable_wrapper_subclass(p):
        return not is_dtensor(p)
    return type(p).__module__.startswith("bitsandbytes.")


def already_wrapped(where: str) -> None:
    raise ValueError(
        f"ShardedModule: {where} is already wrapped. Wrap once, at the top, and let "
        "auto_wrap select the submodules: ShardedModule(model, auto_wrap=Block)."
    )


def check_device(module: nn.Module, device: torch.device | str | None) -> torch.device:
    devices: dict[torch.device, str] = {}
    for name, p in module.named_parameters():
        devices.setdefault(p.device, name)
    if len(devices) > 1:
        listed = ", ".join(f"'{n}' on {d}" for d, n in devices.items())
        raise ValueError(
            f"ShardedModule: parameters are on several devices ({listed}). Move the model to "
            "one device first, e.g. model.to('cpu'), and pass device= for where shards go."
        )
    if devices and not any(d.type == "meta" for d in devices):
        for name, b in module.named_buffers():
            if b.is_meta:
                raise ValueError(
                    f"ShardedModule: buffer '{name}' is on the meta device but the parameters "
                    "are not; build the whole model under `with torch.device('meta'):`, or "
                    "none of it."
                )
    if device is not None and torch.device(device).type == "meta":
        raise ValueError(
            "ShardedModule: device='meta' would keep the shards on no device at all; device= "
            "is where the shards live. To build a large model without memory, build it under "
            "`with torch.device('meta'):` and pass the device its shards go to, e.g. "
            "device='cpu' or 'cuda' (param_init_fn makes the weights where the model has no "
            "reset_parameters)."
        )
    if device is not None:
        return _as_made(torch.device(device))
    if devices:
        only = next(iter(devices))
        if only.type not in ("cpu", "meta"):
            return only
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def _as_made(device: torch.device) -> torch.device:
    """``device`` as the tensors made there name it: ``cpu:0`` is ``cpu``, and ``cuda`` is
    ``cuda:<current>`` where CUDA is the accelerator here. Buffers are kept and found again
    by their device, so a name that differs from the tensors' own would never find one."""
    if device.type == "cpu":
        return torch.device("cpu")
    here = torch.accelerator.current_accelerator(check_available=True)
    if device.index is None and here is not None and here.type == device.type:
        return torch.device(device.type, torch.accelerator.current_device_index())
    return device


def checkpoint_policy(
    module: nn.Module, units: Callable[[nn.Module], bool], value: bool | AutoWrap
) -> Callable[[nn.Module], bool]:
    """Which units to checkpoint; a policy that selects no unit is an error, not a no-op."""
    if value is True or value is False:
        return lambda m: value
    if value is None:
        return lambda m: False
    try:
        selected = resolve_policy(module, value)
    except (TypeError, ValueError) as e:
        told = str(e).replace("auto_wrap", "checkpoint_activations")
        raise type(e)(f"{told} (or True, to checkpoint every unit)") from None
    if not any(units(m) and selected(m) for m in module.modules() if m is not module):
        raise ValueError(
            f"checkpoint_activations={value!r} selects none of the units; it chooses among "
            "the modules auto_wrap selects. Pass checkpoint_activations=True to checkpoint "
            "every unit, or select a class that auto_wrap also selects."
        )
    return selected


def resolve_compile(value: bool | dict[str, Any]) -> dict[str, Any] | None:
    if value is True:
        return {}
    if value is False or value is None:
        return None
    if isinstance(value, dict):
        return dict(value)
    raise TypeError(
        f"compile takes True, False or a dict of torch.compile options, got {value!r}; "
        "e.g. compile={'mode': 'max-autotune'}."
    )


def describe(value: object) -> str:
    """``value`` as text that is the same on every rank for the same argument: classes and
    functions by qualified name (never an address), containers and dataclasses field by field."""
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype, torch.device)):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(describe(v) for v in value) + ")"
    if isinstance(value, (set, frozenset)):
        return "{" + ", ".join(sorted(describe(v) for v in value)) + "}"
    if isinstance(value, dict):
        items = sorted(value.items(), key=lambda kv: str(kv[0]))
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in items) + "}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = dataclasses.fields(value)
        shown = ", ".join(f"{f.name}={describe(getattr(value, f.name))}" for f in fields)
        return f"{type(value).__name__}({shown})"
    named = value if isinstance(value, type) or hasattr(value, "__qualname__") else type(value)
    return f"{getattr(named, '__module__', '?')}.{getattr(named, '__qualname__', '?')}"


def _gradients(dtype: torch.dtype, grad_dtype: torch.dtype) -> str:
    """A group's gradient dtype, where it differs from its parameters'."""
    return "" if grad_dtype == dtype else f" ({str(grad_dtype).removeprefix('torch.')} gradients)"


def unit_plan(
    module: nn.Module, placement: Placement, checkpoint: Callable[[nn.Module], bool]
) -> dict[str, str]:
    """What wrapping makes of ``module``, as text to agree on: every unit with its flat groups
    (dtype, trainable or frozen, gradient dtype where apart, elements), and the units whose
    activations are recomputed.

    Each is a list, one item a line after a count, which :func:`check_same_model` shows by its
    first item that differs across ranks.
    """
    names = {id(m): name for name, m in module.named_modules()}
    units = []
    for index, (unit, params) in enumerate(zip(placement.units, placement.params)):
        sizes: dict[tuple[torch.dtype, bool, bool, torch.dtype], int] = {}
        for _, p, _ in params:
            sizes[group_key(p)] = sizes.get(group_key(p), 0) + p.numel()
        groups = ", ".join(
            f"{str(dtype).removeprefix('torch.')} {'trainable' if grad else 'frozen'}"
            f"{' tp-split' if split else ''}"
            f"{_gradients(dtype, grad_dtype)} {n}"
            for (dtype, grad, split, grad_dtype), n in sizes.items()
        )
        units.append(f"#{index} {names[id(unit)] or '(root)'}: {groups or 'no parameters'}")
    recomputed = [names[id(m)] for m in placement.units[1:] if checkpoint(m)]
    return {
        "auto_wrap (the units it makes)": "\n".join([_count(units, "unit"), *units]),
        "checkpoint_activations (the units it recomputes)": "\n".join(
            [_count(recomputed, "unit"), *recomputed]
        ),
    }


def _count(items: list[str], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _digest(text: str) -> int:
    """56 bits of ``text``'s hash: positive, and so is its negation's magnitude, in an int64."""
    return int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "little")


def _described(kind: str, i: int, name: str, t: Tensor) -> str:
    """The ``i``-th parameter or buffer as the ranks compare it, and as a message names it."""
    grad = f" and requires_grad={t.requires_grad}" if kind == "parameter" else ""
    return f"{kind} #{i} '{name}' with shape {tuple(t.shape)}, dtype {t.dtype}{grad}"


def check_same_model(
    module: nn.Module, group: Group, device: torch.device, options: Mapping[str, str]
) -> None:
    """One small all-reduce: every rank must hold the same parameters and buffers (names,
    shapes, dtypes, which parameters train), and the same ``options`` (each argument of
    ``ShardedModule`` and the unit plan it leads to, described as text, see :func:`describe`
    and :func:`unit_plan`). The collectives that follow (comparing and copying the values,
    sharding) pair up only where these agree.

    Raises:
        ValueError: on every rank alike: naming the first parameter or buffer that differs, or
            else every option that differs with each rank's value (one more collective
            gathers them).
    """
    if group_size(group) == 1:
        return
    named = [_described("parameter", i, *np) for i, np in enumerate(module.named_parameters())]
    named += [_described("buffer", i, *nb) for i, nb in enumerate(module.named_buffers())]
    sigs = [_digest(d) for d in named]
    texts = list(options.values())
    values = [len(sigs), _digest("|".join(map(str, sigs))), *map(_digest, texts)]
    length = len(_SEPARATOR.join(texts).encode())
    t = torch.tensor(values + [-v for v in values] + [-length], dtype=torch.int64, device=device)
    all_reduce(t, group, dist.ReduceOp.MIN).wait()
    agreed = t.tolist()
    n = len(values)
    low, high, longest = agreed[:n], [-v for v in agreed[n : 2 * n]], -agreed[-1]
    if low[:2] != high[:2]:
        _name_first_difference(named, sigs, high[0], group, device)
    differ = [i for i in range(len(texts)) if low[2 + i] != high[2 + i]]
    if differ:
        _name_option_differences(list(options), texts, differ, longest, group, device)


_SEPARATOR = "\x1f"  # between option texts on the wire; no description holds it


def _name_option_differences(
    names: list[str],
    texts: list[str],
    differ: list[int],
    longest: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> NoReturn:
    """Every rank is here: gather every rank's option texts (one all-reduce) and raise alike."""
    rank, world = group.rank(), group.size()
    mine = _SEPARATOR.join(texts).encode()
    rows = torch.zeros(world, longest, dtype=torch.uint8)
    rows[rank, : len(mine)] = torch.frombuffer(bytearray(mine), dtype=torch.uint8)
    rows = rows.to(device)
    all_reduce(rows, group, dist.ReduceOp.SUM).wait()
    every = [bytes(row.cpu().tolist()).rstrip(b"\0").decode().split(_SEPARATOR) for row in rows]
    lines = []
    for i in differ:
        ranks: dict[str, list[int]] = {}
        for r in range(world):
            ranks.setdefault(every[r][i], []).append(r)
        shown = _shown(list(ranks))
        lines.append(
            f"  {names[i]}: "
            + "; ".join(f"{s} on {_ranks(rs)}" for s, rs in zip(shown, ranks.values()))
        )
    raise ValueError(
        f"ShardedModule: ranks passed different arguments (this is rank {rank} of {world}), "
        "so their collectives would not pair up:\n"
        + "\n".join(lines)
        + "\nPass the same arguments on every rank."
    )


def _shown(values: list[str]) -> list[str]:
    """Each value as a message shows it. A list (a count, then one ``name: details`` item a
    line) shows its count and the first item whose name differs among ``values``, or else
    whose details differ."""
    if not any("\n" in v for v in values):
        return values
    items = [v.split("\n") for v in values]
    longest = max(len(lines) for lines in items)

    def first(key: Callable[[str], str]) -> int | None:
        for k in range(1, longest):
            if len({tuple(key(x) for x in lines[k : k + 1]) for lines in items}) > 1:
                return k
        return None

    k = first(lambda item: item.split(": ")[0]) or first(lambda item: item) or 1
    shown = [lines[k] if k < len(lines) else "none" for lines in items]
    return [f"{lines[0]}, first differing {item}" for lines, item in zip(items, shown)]


def _ranks(ranks: list[int]) -> str:
    """``[0, 1, 2, 5]`` as "ranks 0-2, 5"."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and runs[-1][-1] == r - 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    text = ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else f"{run[0]}" for run in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _name_first_difference(
    named: list[str],
    sigs: list[int],
    longest: int,
    group: dist.ProcessGroup,
    device: torch.device,
) -> NoReturn:
    """Every rank is here: find the first parameter or buffer that differs (one more
    all-reduce)."""
    padded = sigs + [-1] * (longest - len(sigs))
    t = torch.tensor(padded + [-s for s in padded], dtype=torch.int64, device=device)
    all_reduce(t, group, dist.ReduceOp.MIN).wait()
    values = t.tolist()
    first = next(i for i in range(longest) if values[i] != -values[longest + i])
    if first < len(named):
        here = named[first]
    else:
        here = f"only {len(named)} parameters and buffers"
    raise ValueError(
        f"ShardedModule: the model differs across ranks; rank {group.rank()} has {here}, "
        "which differs on another rank. Build the same model on every rank (same config, "
        "same code path) before wrapping."
    )


def check_options(
    stage: int,
    device: torch.device,
    mixed_precision: MixedPrecision | None,
    offload: Offload | None,
    compression: Compression | None = None,
) -> None:
    """Check the option objects' types and the combinations they allow.

    Raises:
        TypeError: ``mixed_precision``, ``offload`` or ``compression`` of another type.
        ValueError: the disk tier below stage 3 or off a CPU compute device.
    """
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(
            f"mixed_precision takes a shardwrap.MixedPrecision, got {mixed_precision!r}; "
            "e.g. mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)."
        )
    if compression is not None and not isinstance(compression, Compression):
        raise TypeError(
            f"compression takes a shardwrap.Compression, got {compression!r}; e.g. "
            'compression=Compression(params="int8", grads="int8").'
        )
    if offload is None:
        return
    if not isinstance(offload, Offload):
        raise TypeError(
            f"offload takes a shardwrap.Offload, got {offload!r}; e.g. "
            'offload=Offload(device="disk", path="/nvme/run1").'
        )
    if offload.device == "disk" and stage != 3:
        raise ValueError(
            f'Offload(device="disk") needs stage=3: stage {stage} keeps the full parameters '
            "in memory between steps, the opposite of keeping the state on disk."
        )
    if offload.device == "disk" and device.type != "cpu":
        raise ValueError(
            f'Offload(device="disk") runs on a CPU compute device, got {device}: its files are '
            "mapped into host memory and gathered from there. With a GPU use "
            'Offload(device="cpu") (shards, gradients and optimizer state in pinned host memory).'
        )


def bucket_bytes(bucket_mb: float) -> int:
    """``ShardedModule(bucket_mb=...)`` in bytes.

    Raises:
        TypeError: not a number.
        ValueError: negative or not finite.
    """
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float)):
        raise TypeError(
            f"bucket_mb takes a number of MiB, got {bucket_mb!r}; e.g. bucket_mb=4, or "
            "bucket_mb=0 for one exchange per unit and group."
        )
    if not math.isfinite(bucket_mb) or bucket_mb < 0:
        raise ValueError(
            f"bucket_mb must be a finite number of MiB, 0 or more, got {bucket_mb!r}; e.g. "
            "bucket_mb=4, or bucket_mb=0 for one exchange per unit and group."
        )
    return int(bucket_mb * 2**20)
