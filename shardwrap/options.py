"""Options of ``ShardedModule``: frozen, keyword-only dataclasses validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

__all__ = ["Compression", "MixedPrecision", "Offload"]


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


PARAM_FORMATS = ("int8", "fp8")
GRAD_FORMATS = ("int8", "int4")
# Elements per scale, at most: a scale then costs 4 / 65536 bytes per element (0.006%), so a
# larger block saves nothing, only coarsens the scales and pads every shorter tensor to a whole
# block of zeros (a block of 10**9 made each small tensor's packing 4 GB, and no step finished).
MAX_BLOCK = 1 << 16


@dataclass(frozen=True, kw_only=True)
class Compression:
    """Quantize what the gathers and the gradient reductions send, to move fewer bytes.

    Each tensor a rank sends is cut into blocks of ``block`` elements; each block is sent as
    low-precision values scaled by the block's largest magnitude (one float32 scale per block).
    What the ranks keep stays exact: the shards (master weights), the optimizer state,
    checkpoints and exports never see a quantized value. Floating-point groups only; others
    are sent as they are. ``Compression()`` (both ``None``) changes nothing.

    Attributes:
        params: the format of the parameter all-gathers for compute (forward, backward, the
            refresh after a step at stages 1 and 2): ``None`` (exact), ``"int8"`` or
            ``"fp8"`` (``torch.float8_e4m3fn``, where torch has it). Every rank dequantizes
            the same bytes, its own shard's included, so all ranks compute with identical
            weights.
        grads: the format of the gradient reductions (the reduce-scatter, and with hybrid
            sharding the all-reduce across replicas): ``None`` (exact), ``"int8"`` or
            ``"int4"`` (two values a byte). Received pieces are dequantized and summed in
            float32, then averaged as without compression.
        error_feedback: with ``grads``, each rank keeps what quantization cut from what it
            sent (a residual as large as the flat gradient, per trainable group, in the
            reduction dtype) and adds it to the next reduction's gradient, so the error does
            not accumulate over steps. Ignored without ``grads``.
        block: elements per scale block, 1 to 65536: smaller blocks follow the values more
            closely and send more scales (4 bytes per block).
    """

    params: str | None = None
    grads: str | None = None
    error_feedback: bool = True
    block: int = 256

    def __post_init__(self) -> None:
        if self.params is not None and self.params not in PARAM_FORMATS:
            raise ValueError(
                f'Compression.params must be None, "int8" or "fp8", got {self.params!r}; '
                'e.g. Compression(params="int8").'
            )
        if self.params == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError(
                f'Compression.params="fp8" needs torch.float8_e4m3fn, which torch '
                f'{torch.__version__} lacks; use params="int8", or a torch that has it.'
            )
        if self.grads is not None and self.grads not in GRAD_FORMATS:
            raise ValueError(
                f'Compression.grads must be None, "int8" or "int4", got {self.grads!r}; '
                'e.g. Compression(grads="int8").'
            )
        if type(self.error_feedback) is not bool:
            raise ValueError(
                f"Compression.error_feedback must be True or False, got {self.error_feedback!r}."
            )
        if type(self.block) is not int or not 1 <= self.block <= MAX_BLOCK:
            raise ValueError(
                f"Compression.block must be a positive int (elements per scale) of at most "
                f"{MAX_BLOCK}, got {self.block!r}: a larger block saves no bytes and pads every "
                'shorter tensor to a whole block; e.g. Compression(params="int8", block=256).'
            )

    @property
    def enabled(self) -> bool:
        """Whether anything is compressed."""
        return self.params is not None or self.grads is not None
