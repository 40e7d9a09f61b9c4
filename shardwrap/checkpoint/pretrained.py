"""Loading a folder of safetensors weights (an export, or a Hugging Face one) into a sharded
model: :func:`load_pretrained`.

Design note. Each rank reads only the rows of each tensor that cover its own pieces,
memory-mapped, so no rank holds the whole model. A ``transformers`` model's folder may hold
its original checkpoint names, which are renamed as ``from_pretrained`` renames them; weights
``from_pretrained`` merges as it loads are refused, naming it.
"""

from __future__ import annotations

import json
import math
import re
import warnings
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ..engine.shards.split import Split
from .entry import wrapped_root
from .export import INDEX, WEIGHTS, is_transformers_model
from .files import agree, agree_path, few, is_plain_name
from .format import persistent_buffers

__all__ = ["load_pretrained"]


_NOTHING = re.compile(r"(?!)")  # matches no name


def _ignored(model: nn.Module) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The names a ``transformers`` model's ``from_pretrained`` leaves out of its missing and
    unexpected keys (its class's ``_keys_to_ignore_on_load_missing`` and ``_unexpected``:
    GPT-2's causal-mask buffers older folders hold; and, where the model has such buffers,
    ``rotary_emb.inv_freq`` and ``position_ids``, once persistent); matching none for any
    other model."""
    if not is_transformers_model(model):
        return _NOTHING, _NOTHING
    buffers = [name for name, _ in model.named_buffers()]
    unexpected = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        unexpected.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        unexpected.add(r"(^|\.)position_ids$")
    missing = set(getattr(model, "_keys_to_ignore_on_load_missing", None) or ())

    def joined(patterns: set[str]) -> re.Pattern[str]:
        return re.compile("|".join(f"({p})" for p in sorted(patterns))) if patterns else _NOTHING

    return joined(missing), joined(unexpected)


def _conversions(model: nn.Module) -> tuple[list[Any], list[Any]] | None:
    """A ``transformers`` model's checkpoint renamings and its converters (which merge saved
    tensors into one, a mixture of experts' per-expert weights), as ``from_pretrained``
    applies them since transformers 5; ``None`` for any other model."""
    if not is_transformers_model(model):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, WeightRenaming
    except ImportError:  # a transformers without checkpoint conversions
        return None
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    return renamings, [t for t in transforms if isinstance(t, WeightConverter)]


def _model_names(model: nn.Module, keys: list[str], own: Mapping[str, Any]) -> dict[str, str]:
    """Each saved key's name in the model: itself, or for a ``transformers`` model the name
    its checkpoint renamings give it (some models are saved under their original checkpoint
    names, which ``from_pretrained`` renames as it loads). A key that transformers would merge
    with others keeps its own name: see :func:`_converted_names`."""
    names = {k: k for k in keys}
    conversions = _conversions(model)
    if conversions is None:
        return names
    from transformers.core_model_loading import rename_source_key

    present = dict.fromkeys(own, True)
    prefix = getattr(model, "base_model_prefix", None) or None
    for k in keys:
        if k not in own:
            renamed, merged = rename_source_key(k, *conversions, prefix, present)
            if merged is None:
                names[k] = renamed
    return names


def _converted_names(model: nn.Module) -> str:
    """Why a ``transformers`` model's own folder may still not match it: keys that
    ``from_pretrained`` merges as it loads, which ``load_pretrained`` does not. Empty for any
    other model."""
    conversions = _conversions(model)
    if conversions is None or not conversions[1]:
        return ""
    name = type(model).__name__
    return (
        f". transformers saves a {name} with weights that from_pretrained merges as it loads "
        "(a mixture of experts' per-expert weights into one tensor); load_pretrained reads "
        f"whole tensors only. Load it with {name}.from_pretrained(path) before wrapping (then "
        "ShardedModule(model, ...)); or once so, then shardwrap.export(path, model) from the "
        "wrapped model: export writes the model's own tensors, which load_pretrained reads"
    )


def _open(stack: ExitStack, path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(f"load_pretrained: {path} is missing")
    try:
        return stack.enter_context(safe_open(path, framework="pt"))
    except Exception as e:
        raise ValueError(f"load_pretrained: {path} is corrupt: {e}") from e


def _weight_files(folder: Path, stack: ExitStack) -> tuple[dict[str, str], dict[str, Any]]:
    """Tensor name -> file name, from the single weights file or else the index (the order
    ``from_pretrained`` reads them in); file -> handle."""
    if (folder / WEIGHTS).is_file():
        if (folder / INDEX).is_file():
            warnings.warn(
                f"load_pretrained: {folder} holds both {WEIGHTS} and {INDEX}; it reads "
                f"{WEIGHTS}, as transformers' from_pretrained does. One of them is left from "
                "an earlier save: delete it",
                stacklevel=5,
            )
        handle = _open(stack, folder / WEIGHTS)
        return {k: WEIGHTS for k in handle.keys()}, {WEIGHTS: handle}
    if (folder / INDEX).is_file():
        where = _weight_map(folder / INDEX)
        outside = sorted({str(f) for f in where.values() if not is_plain_name(f)})
        if outside:
            raise ValueError(
                f"load_pretrained: {folder / INDEX} names files outside {folder}: {outside}; "
                "an index names weight files beside it"
            )
        return where, {f: _open(stack, folder / f) for f in sorted(set(where.values()))}
    pickled = [
        n for n in ("pytorch_model.bin", "pytorch_model.bin.index.json") if (folder / n).exists()
    ]
    hint = (
        f" ({pickled[0]}: pickled weights, which it does not read; load them with "
        "from_pretrained before wrapping, or save them again with save_pretrained, which writes "
        "safetensors)"
        if pickled
        else ""
    )
    raise FileNotFoundError(f"load_pretrained: {folder} holds neither {WEIGHTS} nor {INDEX}{hint}")


def _weight_map(index: Path) -> dict[str, str]:
    """The index's ``weight_map``: tensor name to the file beside it that holds it.

    Raises:
        ValueError: naming the index and what is wrong: not JSON (or nested too deep), no
            ``weight_map``, or one that is not a mapping of names to file names.
    """
    try:
        parsed = json.loads(index.read_text())
    except (ValueError, RecursionError) as e:
        raise ValueError(
            f"load_pretrained: {index} is corrupt: {e!r}. Export the model again, or delete "
            "the index where the folder holds one model.safetensors"
        ) from None
    where = parsed.get("weight_map") if isinstance(parsed, dict) else None
    if not isinstance(where, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in where.items()
    ):
        raise ValueError(
            f'load_pretrained: {index} is corrupt: its "weight_map" must map each tensor\'s '
            f"name to the file that holds it, got {type(where).__name__}. Export the model "
            "again, or fix the index"
        )
    return where


def _rows(
    handle: Any, key: str, shape: tuple[int, ...], start: int, stop: int, block: Any = None
) -> Tensor:
    """Elements ``[start, stop)`` of the flattened tensor ``key``, reading whole rows only; of
    its block ``block = (split, index)`` (a tensor-parallel rank's, ``engine/shards/split.py``)
    where given."""
    if len(shape) == 0:
        return handle.get_tensor(key).reshape(-1)[start:stop]
    split, index = block if block is not None else (Split(shape), 0)
    rows = split.block_shape
    row = math.prod(rows[1:])
    first, last = start // row, -(-stop // row)
    at = [slice(None)] * len(shape)
    if split.is_split and split.dim == 0:
        at[0] = slice(index * rows[0] + first, index * rows[0] + last)
    else:
        at[0] = slice(first, last)
        if split.is_split:
            assert split.dim is not None
            n = rows[split.dim]
            at[split.dim] = slice(index * n, (index + 1) * n)
    stored = handle.get_slice(key)[tuple(at)]
    return stored.reshape(-1)[start - first * row : stop - first * row]


def load_pretrained(path: str | Path, model: nn.Module, *, strict: bool = True) -> _Keys:
    """Load a folder written by :func:`export` (or ``save_pretrained``) into a sharded model.

    Each rank reads only the rows of each tensor that cover its own pieces, memory-mapped,
    so no rank holds the whole model. A tied parameter loads from any of its names; where the
    files hold several of them, they must hold the same values. Everything is checked on
    every rank before anything is modified. Call on every rank.

    Args:
        path: the folder, with ``model.safetensors`` or ``model.safetensors.index.json`` (the
            former where it holds both, as ``from_pretrained`` reads them, with a warning).
        model: a model wrapped with :class:`ShardedModule`, at any world size and policy.
        strict: raise on names missing from the files or unknown to the model; with
            ``False`` such parameters keep their values and unknown names are ignored.

    Returns:
        The model's names the files lack and the files' names the model lacks, as
        ``nn.Module.load_state_dict`` returns them (both empty where ``strict`` held).

    Raises:
        FileNotFoundError: no weights in ``path``, or a file named by the index is missing.
        ValueError: names (with ``strict``) or shapes that differ, two saved names of one
            parameter (tied names holding different values; a name saved both as it is and
            as ``from_pretrained`` would rename it), or a corrupt file.
    """
    model, root = wrapped_root(model, "load_pretrained")
    folder = agree_path(root.mesh.control, root.mesh.control_device, "load_pretrained", path)
    params = root.params
    buffers = persistent_buffers(model, params)
    state = nn.Module.state_dict(model, keep_vars=True)
    keys = _Keys([], [])
    with ExitStack() as stack:
        plan: dict[str, tuple[Any, str]] = {}  # canonical name or buffer key -> (handle, key)

        def prepare() -> int:
            saved_at, handles = _weight_files(folder, stack)
            name_of = _model_names(model, list(saved_at), state)
            _refuse_two_names_for_one(folder, name_of)
            where = {name_of[k]: f for k, f in saved_at.items()}
            saved_key = {name_of[k]: k for k in saved_at}
            keys_of: dict[int, list[str]] = {}
            for k, v in state.items():
                keys_of.setdefault(id(v), []).append(k)
            wanted = [(p.name, p.shape, keys_of[id(p.shard)]) for p in params]
            wanted += [(k, tuple(v.shape), [k]) for k, v in buffers.items()]
            missing, shapes = [], []
            for name, shape, names in wanted:
                found = next((k for k in names if k in where), None)
                if found is None:
                    missing.append(name)
                    continue
                handle, key = handles[where[found]], saved_key[found]
                if key not in handle.keys():
                    raise ValueError(
                        f"load_pretrained: {folder / INDEX} says {folder / where[found]} holds "
                        f"'{key}', which that file lacks: the index and the weights are of "
                        "different exports. Export the model again"
                    )
                saved = tuple(handle.get_slice(key).get_shape())
                if saved != shape:
                    shapes.append(f"'{key}': file {saved}, model {shape}")
                else:
                    for other in names:
                        if other != found and other in where:
                            tied = (handles[where[other]], saved_key[other])
                            _refuse_tied_that_differ(folder, (handle, key), tied, shape)
                plan[name] = (handle, key)
            unexpected = [saved_key[k] for k in where if k not in state]
            ignore_missing, ignore_unexpected = _ignored(model)
            missing = [k for k in missing if not ignore_missing.search(k)]
            unexpected = [k for k in unexpected if not ignore_unexpected.search(k)]
            keys.missing_keys.extend(missing)
            keys.unexpected_keys.extend(unexpected)
            problems = [f"shape mismatch: {few(shapes, quote=False)}"] if shapes else []
            if strict and missing:
                problems.append(f"missing from the files: {few(missing)}")
            if strict and unexpected:
                problems.append(f"not in the model: {few(unexpected)}")
            if problems:
                raise ValueError(
                    f"load_pretrained: {folder} does not match the model; "
                    + "; ".join(problems)
                    + (_converted_names(model) if missing or unexpected else "")
                )
            return 0

        agree(root.mesh.control, root.mesh.control_device, "load_pretrained", prepare)
        with torch.no_grad():
            for p in params:
                piece = p.group.pieces[p.index]
                if p.name in plan and piece.numel > 0:
                    handle, key = plan[p.name]
                    spec = p.group.specs[p.index]
                    block = (spec.split, spec.index) if spec is not None else None
                    p.shard.copy_(_rows(handle, key, p.shape, piece.start, piece.stop, block))
            for k, v in buffers.items():
                if k in plan:
                    v.copy_(plan[k][0].get_tensor(plan[k][1]))
    return keys


class _Keys(NamedTuple):
    """What :func:`load_pretrained` returns, as ``nn.Module.load_state_dict`` does."""

    missing_keys: list[str]
    unexpected_keys: list[str]


def _refuse_two_names_for_one(folder: Path, name_of: Mapping[str, str]) -> None:
    """Raise where two saved names are one name of the model (a name saved both as it is and
    as ``from_pretrained`` renames it: which one it takes is its own rule)."""
    seen: dict[str, str] = {}
    for saved, name in name_of.items():
        if name in seen:
            raise ValueError(
                f"load_pretrained: {folder} holds both '{seen[name]}' and '{saved}', which are "
                f"both the model's '{name}' (one of them under an older or a base model's "
                "name). Keep one of them in the files, or load the folder with from_pretrained "
                "before wrapping"
            )
        seen[name] = saved


_COMPARED = 1 << 22  # elements of two tied tensors compared at a time


def _refuse_tied_that_differ(
    folder: Path, first: tuple[Any, str], other: tuple[Any, str], shape: tuple[int, ...]
) -> None:
    """Raise unless two saved names of one tied parameter hold the same values: the files
    are of a model whose weights were not tied (``from_pretrained`` unties them then), and a
    tied parameter holds one of them. Compared a few rows at a time."""
    numel = math.prod(shape)
    row = math.prod(shape[1:]) if shape else 1
    step = max(row, _COMPARED // row * row)
    for start in range(0, numel, step):
        stop = min(numel, start + step)
        a = _rows(*first, shape, start, stop)
        b = _rows(*other, shape, start, stop)
        if a.dtype != b.dtype or not torch.equal(a, b):
            raise ValueError(
                f"load_pretrained: {folder} holds '{first[1]}' and '{other[1]}' with different "
                "values, where this model ties them into one parameter: they were saved from "
                "a model whose weights were not tied, which from_pretrained unties as it loads "
                "(config.tie_word_embeddings=False). Build the model untied before wrapping "
                "(from_pretrained(path), or the config with tie_word_embeddings=False), then "
                "wrap it and load"
            )
