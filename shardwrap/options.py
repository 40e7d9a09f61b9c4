"""Options of ``ShardedModule``: frozen, keyword-only dataclasses validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["MixedPrecision", "Offload"]


@dataclass(frozen=True, kw_only=True)
class MixedPrecision:
    """Compute in a low-precision dtype while the shards, the optimizer's master copy, stay full.

    Only floating-point parameters are affected; a group of another dtype is gathered as is.

    Attributes:
        param_dtype: dtype the parameters are gathered in and forward and backward compute
            with. The shard is cast straight into the all-gather's input, so the gather moves
            this dtype's bytes. ``None`` keeps the parameters' own dtype.
        reduce_dtype: dtype gradients are averaged in across ranks. They land in the shards'
            dtype either way. ``None`` means ``param_dtype``.
        output_dtype: dtype the model's floating-point outputs are cast to (e.g. float32
            logits for the loss). ``None`` leaves them as computed.
        buffer_dtype: dtype floating-point buffers (BatchNorm statistics, for one) are stored
            and used in. ``None`` leaves them as they are.
    """

    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype", "buffer_dtype"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"MixedPrecision.{name} must be a floating-point torch.dtype or None, got "
                    f"{value!r}; e.g. MixedPrecision(param_dtype=torch.bfloat16)."
                )

    def compute_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter stored in ``dtype`` computes in."""
        if self.param_dtype is None or not dtype.is_floating_point:
            return dtype
        return self.param_dtype

    def gradient_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a parameter stored in ``dtype`` has its gradient reduced in."""
        if not dtype.is_floating_point:
            return dtype
        return self.reduce_dtype or self.compute_dtype(dtype)


@dataclass(frozen=True, kw_only=True)
class Offload:
    """Keep the training state that grows with the model outside device memory.

    Attributes:
        device: ``"disk"``: the shards, their gradients and the optimizer state live in
            files under ``path`` (ZeRO-Infinity's tier); memory holds a few units at a time.
            ``"cpu"``: the same state in (pinned) host memory while the model computes on a
            GPU (ZeRO-Offload's tier): gathers copy the shards in, reduced gradients are
            copied out, and the optimizer steps on the CPU; any stage. With a CPU compute
            device it changes nothing, and says so.
        path: the folder for the disk tier's files (a fast local disk); each rank uses its
            own subfolder, locked while the model lives and removed when it is freed.
    """

    device: str = "disk"
    path: str | os.PathLike[str] | None = None

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "disk"):
            raise ValueError(
                f'Offload.device must be "cpu" or "disk", got {self.device!r}; e.g. '
                'Offload(device="disk", path="/nvme/run1").'
            )
        if self.device == "disk" and self.path is None:
            raise ValueError(
                'Offload.path: the disk tier needs a folder, e.g. Offload(device="disk", '
                'path="/nvme/run1").'
            )
        if self.device == "cpu" and self.path is not None:
            raise ValueError('Offload.path is for device="disk"; the cpu tier keeps no files.')
