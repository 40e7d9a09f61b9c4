"""Tensor parallelism on the planner's meta twin: one tp rank's blocks and activations.

Design note. The planner runs no process group, so it cannot run DTensor; it runs what one
tp rank computes. Each module a tensor-parallel plan names gets its split parameters as this
rank's blocks (plain meta tensors, ``1/tp`` of their split dimension), and hooks that turn its
input and output into this rank's local tensors as the style's own hooks turn them: where a
collective makes a new tensor, so do they, of its size (an all-gather's output ``tp`` times its
input, an all-reduce's a copy, a reduce-scatter's a ``1/tp`` slice), differentiably, so that
backward makes what the collective's backward makes. The meta run then measures a tp rank's
activations, and the flat groups are laid out from its blocks over the dp ranks alone, blocks
apart from what every tp rank holds alike (as ``engine/wrap/policy.py``'s ``group_key``).

A plan is what ``parallelize_module`` takes (module names, ``*`` matching one name, to
``ColwiseParallel``, ``RowwiseParallel`` or ``SequenceParallel``), or a ``transformers`` model's
own plan of style names (its ``tp_plan``, the planner's default for such a model).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from fnmatch import fnmatch
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["localize"]


# A layout over the tp ranks, as the planner reads a DTensor placement: the dimension split
# (``Shard(d)``), REPLICATE, or OTHER (``Partial``: left as the layer computes it). The planner
# keeps its own, so that planning without tensor parallelism never imports DTensor.
Layout = int | str
REPLICATE, OTHER = "replicate", "other"


def _layout(placement: Any) -> Layout:
    if placement.is_shard():
        return placement.dim
    return REPLICATE if placement.is_replicate() else OTHER


@dataclass(frozen=True)
class _Style:
    """What one parallel style does to a module: ``kind`` (``"colwise"``, ``"rowwise"`` or
    ``"sequence"``) and the layouts of its input and output."""

    kind: str
    input: Layout | None
    output: Layout | None


# A transformers plan's style names, as torch's styles with the same layouts.
_HF_STYLES = {
    "colwise": _Style("colwise", REPLICATE, -1),
    "colwise_gather_output": _Style("colwise", REPLICATE, REPLICATE),
    "colwise_rep": _Style("colwise", REPLICATE, REPLICATE),
    "rowwise": _Style("rowwise", -1, REPLICATE),
    "rowwise_split_input": _Style("rowwise", REPLICATE, REPLICATE),
    "rowwise_rep": _Style("rowwise", REPLICATE, REPLICATE),
    "embedding_rowwise": _Style("rowwise", REPLICATE, REPLICATE),
    "sequence_parallel": _Style("sequence", 1, 1),
    "replicate": _Style("sequence", None, None),
}


def _style(style: Any) -> _Style:
    """The planner's reading of ``style`` (a torch ``ParallelStyle`` or a style name)."""
    if isinstance(style, str):
        if style not in _HF_STYLES:
            raise ValueError(
                f"estimate_memory: the tensor-parallel style {style!r} is not one the planner "
                f"plans ({', '.join(sorted(_HF_STYLES))}); plan with a parallelize_module plan "
                "of ColwiseParallel, RowwiseParallel and SequenceParallel instead."
            )
        return _HF_STYLES[style]
    name = type(style).__name__
    if name == "SequenceParallel":
        return _Style("sequence", 1, 1)
    if name in ("ColwiseParallel", "RowwiseParallel"):
        layouts = _layout(style.input_layouts[0]), _layout(style.output_layouts[0])
        return _Style(name[:-8].lower(), *layouts)
    raise ValueError(
        f"estimate_memory: tp_plan holds a {name}; the planner plans ColwiseParallel, "
        "RowwiseParallel and SequenceParallel (and a transformers model's own style names)."
    )


def _matches(name: str, key: str) -> bool:
    parts, keys = name.split("."), key.split(".")
    return len(parts) == len(keys) and all(fnmatch(p, k) for p, k in zip(parts, keys))


def localize(model: nn.Module, plan: Mapping[str, Any], tp: int) -> set[int]:
    """Make meta ``model`` one tp rank's twin under ``plan`` (see the note above).

    Returns:
        The ``id`` of every parameter split over the tp ranks.

    Raises:
        ValueError: a style the planner does not plan, a plan entry that names no module, or a
            split dimension that ``tp`` does not divide, naming it.
    """
    styles = [(key, _style(style)) for key, style in plan.items()]
    used: set[str] = set()
    split: set[int] = set()
    for name, module in model.named_modules():
        for key, style in styles:
            if name and _matches(name, key):
                used.add(key)
                split |= _split_params(name, module, style, tp)
                _hook(module, style, tp)
    unused = [key for key, _ in styles if key not in used]
    if unused:
        raise ValueError(
            f"estimate_memory: tp_plan entries {unused[:4]} name no module of "
            f"{type(model).__name__}; name modules as parallelize_module does ('blocks.*.mlp')."
        )
    return split


def _split_params(name: str, module: nn.Module, style: _Style, tp: int) -> set[int]:
    """Replace ``module``'s split parameters by this rank's blocks; their ids."""
    if style.kind == "sequence":
        return set()
    embedding = isinstance(module, nn.Embedding)
    done = set()
    for attr, p in list(module.named_parameters(recurse=False)):
        if style.kind == "colwise":
            dim = p.ndim - 1 if embedding else 0
        elif attr == "bias":
            continue  # a row-parallel layer adds its bias after the reduction, replicated
        else:
            dim = 0 if embedding else p.ndim - 1
        if p.shape[dim] % tp:
            raise ValueError(
                f"estimate_memory: '{name}.{attr}' of shape {tuple(p.shape)} does not split "
                f"into {tp} equal blocks along dimension {dim}; choose sizes tp divides, as "
                "ShardedModule requires."
            )
        shape = list(p.shape)
        shape[dim] //= tp
        block = nn.Parameter(torch.empty(shape, dtype=p.dtype, device=p.device), p.requires_grad)
        setattr(module, attr, block)
        done.add(id(block))
    return done


def _hook(module: nn.Module, style: _Style, tp: int) -> None:
    """Hooks that turn ``module``'s input and output into this rank's local tensors."""
    embedding = isinstance(module, nn.Embedding)

    def before(_: nn.Module, args: tuple) -> tuple:
        x, rest = args[0], args[1:]
        if style.kind == "colwise" and isinstance(style.input, int):
            x = _gathered(x, style.input, tp)  # the sequence gathered
        elif style.kind == "rowwise" and not embedding and style.input == REPLICATE:
            x = x.chunk(tp, dim=-1)[0].contiguous()  # this rank's slice, a copy as DTensor makes
        return (x, *rest)

    def after(_: nn.Module, args: tuple, out: Tensor) -> Tensor:
        if style.kind == "colwise" and style.output == REPLICATE:
            return _gathered(out, -1, tp)
        if style.kind == "rowwise" and style.output == REPLICATE:
            return out.clone()  # an all-reduce's output
        if style.kind == "rowwise" and isinstance(style.output, int):
            return out.chunk(tp, dim=style.output)[0].clone()  # a reduce-scatter's
        return out

    if style.kind != "sequence":
        module.register_forward_pre_hook(before)
        module.register_forward_hook(after)


def _gathered(x: Tensor, dim: int, tp: int) -> Tensor:
    """An all-gather's output along ``dim``: ``tp`` times ``x``'s size there."""
    return torch.cat([x] * tp, dim)
