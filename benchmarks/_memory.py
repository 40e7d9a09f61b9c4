"""Allocation tracking for the memory benchmarks, the tests and the planner's checks.

- :class:`StorageTracker`: ``shardwrap.track_allocations`` with two filters besides.
- :func:`training_peak`: the tracked peak of ranks (threads) training a model, from wrapping
  on, as ``shardwrap.estimate_memory`` plans it.
- Model families at two sizes (:func:`family_model`), fed as the planner feeds a
  ``transformers`` model (:func:`hf_batches`).

``TorchDispatchMode`` is per thread, so under ``benchmarks._ranks`` each rank tracks only its own
allocations.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed import ProcessGroup

import shardwrap.engine.wrap.sharded_module as sharded_module
import shardwrap.planning.planner as estimate_module
import shardwrap.tiers.home as home_module
from benchmarks._ranks import run_ranks
from shardwrap import AllocationTracker, Offload, ShardedModule, track_allocations

__all__ = [
    "FAMILIES",
    "StorageTracker",
    "family_model",
    "hf_batches",
    "hf_loss",
    "staged_on_cpu",
    "training_peak",
]


class StorageTracker(AllocationTracker):
    """:class:`shardwrap.AllocationTracker`, skipping some storages besides.

    Args:
        existing: tensors made before tracking (inputs) whose storages never count.
        ignore: tensors whose storage never counts.
    """

    def __init__(
        self, existing: tuple[Tensor, ...] = (), ignore: Callable[[Tensor], bool] | None = None
    ) -> None:
        super().__init__()
        self._existing = {t.untyped_storage()._cdata for t in existing}
        self._ignore = ignore

    def counts(self, t: Tensor) -> bool:
        if t.untyped_storage()._cdata in self._existing or (self._ignore and self._ignore(t)):
            return False
        return super().counts(t)


@contextlib.contextmanager
def staged_on_cpu(on: bool = True) -> Iterator[None]:
    """Run the host tier's staged path on the CPU, as its tests do (the engine builds a
    ``HostHome`` for a CPU device), and have the planner plan that path."""
    if not on:
        yield
        return
    build, tier = sharded_module.make_home, estimate_module._tier

    def staged(offload: Any, device: torch.device, rank: int) -> Any:
        if offload is not None and offload.device == "cpu":
            return home_module.HostHome(device)
        return build(offload, device, rank)

    def staged_tier(offload: str | None, device: str) -> Any:
        planned = tier(offload, device)
        if offload == "cpu":
            return dataclasses.replace(planned, staged=True, apart=False)
        return planned

    sharded_module.make_home, estimate_module._tier = staged, staged_tier
    try:
        yield
    finally:
        sharded_module.make_home, estimate_module._tier = build, tier


Loss = Callable[[nn.Module, Any], tuple[Tensor, Any]]


def training_peak(
    model: nn.Module,
    batches: Callable[[int, nn.Module], list[Any]],
    loss: Loss,
    *,
    world_size: int = 2,
    offload: str | None = None,
    timeout: float = 120.0,
    optimizer: Callable[[list[nn.Parameter]], Any] | None = None,
    **options: Any,
) -> int:
    """The largest peak of ``world_size`` ranks (threads) training ``model``, in bytes.

    Each rank wraps its own copy (each parameter's ``grad_dtype`` kept, which a deep copy
    drops), ``ShardedModule(copy, offload=..., **options)``, inside
    ``shardwrap.track_allocations()``, then takes one optimizer step per batch of
    ``batches(rank, copy)``, its loss and outputs from ``loss(model, batch)``; the outputs
    stay alive until the next forward returns, as in ``out = model(...)``. ``offload``:
    ``"disk"`` (files in a temporary folder) or ``"cpu"`` (the host tier, staged on the CPU).
    ``optimizer``: as ``estimate_memory`` takes it, ``fn(params)`` returning one optimizer or
    several (stepped in their order); default AdamW.
    """

    def fn(rank: int, pg: ProcessGroup, folder: str) -> int:
        plain = copy.deepcopy(model)
        for p, q in zip(plain.parameters(), model.parameters()):
            p.grad_dtype = q.grad_dtype
        steps = batches(rank, plain)
        tier = None
        if offload is not None:
            tier = Offload(device=offload, path=Path(folder) if offload == "disk" else None)
        with track_allocations() as tracked:
            m = ShardedModule(plain, process_group=pg, offload=tier, **options)
            made = (optimizer or _adamw)(list(m.parameters()))
            opts = [made] if isinstance(made, torch.optim.Optimizer) else list(made)
            for batch in steps:
                value, out = loss(m, batch)
                value.backward()
                for opt in opts:
                    opt.step()
                for opt in opts:
                    opt.zero_grad()
            del out
        return tracked.peak

    with tempfile.TemporaryDirectory() as folder, staged_on_cpu(offload == "cpu"):
        return max(run_ranks(world_size, lambda r, pg: fn(r, pg, folder), timeout=timeout))


def _adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4)


# Model families: Hugging Face classes from small configs, random weights -------------------

FAMILIES = ("gpt2", "llama", "qwen2", "bert", "t5", "vit")

# Per family: the class, and its config at two sizes: "test" (a few million parameters, for
# the suite) and "bench" (tens of millions: benchmarks/estimate.py).
_CONFIGS: dict[str, tuple[str, str, dict[str, dict[str, Any]]]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", {
        "test": dict(vocab_size=2048, n_positions=64, n_embd=128, n_layer=2, n_head=4),
        "bench": dict(vocab_size=50257, n_positions=256, n_embd=512, n_layer=8, n_head=8),
    }),
    "llama": ("LlamaForCausalLM", "LlamaConfig", {
        "test": dict(vocab_size=2048, hidden_size=128, intermediate_size=344, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "bench": dict(vocab_size=16000, hidden_size=512, intermediate_size=1376,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8,
                      max_position_embeddings=256),
    }),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {
        "test": dict(vocab_size=4096, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
        "bench": dict(vocab_size=32000, hidden_size=512, intermediate_size=1408,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                      max_position_embeddings=256),
    }),
    "bert": ("BertForMaskedLM", "BertConfig", {
        "test": dict(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=64),
        "bench": dict(vocab_size=30522, hidden_size=512, intermediate_size=2048,
                      num_hidden_layers=8, num_attention_heads=8, max_position_embeddings=256),
    }),
    "t5": ("T5ForConditionalGeneration", "T5Config", {
        "test": dict(vocab_size=2048, d_model=128, d_kv=32, d_ff=512, num_layers=2,
                     num_decoder_layers=2, num_heads=4),
        "bench": dict(vocab_size=32128, d_model=512, d_kv=64, d_ff=2048, num_layers=6,
                      num_decoder_layers=6, num_heads=8),
    }),
    "vit": ("ViTForImageClassification", "ViTConfig", {
        "test": dict(image_size=32, patch_size=8, hidden_size=128, intermediate_size=512,
                     num_hidden_layers=2, num_attention_heads=4, num_labels=10),
        "bench": dict(image_size=224, patch_size=16, hidden_size=384, intermediate_size=1536,
                      num_hidden_layers=12, num_attention_heads=6, num_labels=1000),
    }),
}  # fmt: skip


def family_model(family: str, size: str = "test") -> nn.Module:
    """A seeded ``transformers`` model of ``family`` (:data:`FAMILIES`) at ``size``, its
    config's defaults otherwise (dropout included)."""
    import transformers

    model_class, config_class, sizes = _CONFIGS[family]
    config = getattr(transformers, config_class)(**sizes[size])
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


def hf_batches(
    steps: int, batch: int, seq: int
) -> Callable[[int, nn.Module], list[dict[str, Tensor]]]:
    """Per rank, ``steps`` batches of what the planner feeds a ``transformers`` model: token
    ids as inputs and labels (and decoder inputs for an encoder-decoder), or images and one
    class label each."""

    def make(rank: int, model: nn.Module) -> list[dict[str, Tensor]]:
        config = model.config
        out = []
        for step in range(steps):
            g = torch.Generator().manual_seed(1000 * rank + step)
            if model.main_input_name == "pixel_values":
                size = (batch, config.num_channels, config.image_size, config.image_size)
                labels = torch.randint(config.num_labels, (batch,), generator=g)
                out.append({"pixel_values": torch.randn(size, generator=g), "labels": labels})
                continue
            ids = torch.randint(config.vocab_size, (batch, seq), generator=g)
            feed = {"input_ids": ids, "labels": ids}
            if config.is_encoder_decoder:
                feed["decoder_input_ids"] = ids
            out.append(feed)
        return out

    return make


def hf_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Any]:
    out = model(**batch)
    return out.loss, out
