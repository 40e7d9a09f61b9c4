"""``shardwrap.lightning``: a strategy for Lightning's ``Trainer``.

``import shardwrap.lightning`` registers it, so that ``Trainer(strategy="shardwrap")`` shards
the ``LightningModule`` with ``ShardedModule``'s defaults (stage 3, the whole model one unit);
``Trainer(strategy=ShardwrapStrategy(auto_wrap=Block, stage=2))`` takes any of
``ShardedModule``'s options. Needs the ``lightning`` extra.

Design note. ``ShardedModule`` shards a module in place, so the strategy wraps a small root
around the ``LightningModule`` (:class:`LightningRoot`) and shards that: Lightning then runs
``training_step`` (and the validation, test and predict steps) inside the root's forward, as
it does for its FSDP strategy, and the root's hooks gather and release the parameters the
units do not hold around the whole step. The ``LightningModule``'s parameters are this rank's
pieces from then on, so ``configure_optimizers`` builds its optimizer over them, as on any
sharded model; clipping (``gradient_clip_val``: ``clip_grad_norm_`` over pieces takes the
global norm; by value, elementwise), accumulation (``accumulate_grad_batches``: each
micro-batch's gradient is reduced into the shards as it completes, so no full gradient is
kept) and the autocast precisions work as with DDP.

Precision: ``"32-true"``, ``"bf16-mixed"`` and ``"16-mixed"`` (autocast over fp32 shards; the
loss scaler becomes a :class:`~shardwrap.ShardedGradScaler`, so that every rank skips a step
alike). The ``"-true"`` precisions and Lightning's other plugins are refused by name when the
``Trainer`` is built: compute in bf16 with fp32 shards through
``ShardwrapStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))`` instead.

Checkpoints: Lightning's checkpoint path (``ModelCheckpoint``'s ``epoch=0-step=4.ckpt``) is a
folder holding a shardwrap checkpoint of the model and its optimizers (``shardwrap/``: every
rank writes its pieces, and any world size loads it) and, from rank 0, the rest of Lightning's
checkpoint (``lightning.pt``: loops, callbacks, schedulers, hyperparameters). So a run resumes
at another number of ranks; ``Trainer.fit(ckpt_path=...)`` restores both.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor, nn

from .checkpoint.load import load_checkpoint
from .checkpoint.save import save_checkpoint
from .engine.optim.grad_scaler import ShardedGradScaler
from .engine.wrap.policy import AutoWrap
from .engine.wrap.sharded_module import ShardedModule

__all__ = ["LightningRoot", "ShardwrapStrategy"]

SHARDS = "shardwrap"  # the model's and optimizers' shardwrap checkpoint, in the checkpoint path
LIGHTNING_STATE = "lightning.pt"  # the rest of Lightning's checkpoint, written by rank 0
ROOT_ATTR = "_shardwrap_lightning_root"  # on a LightningModule: the sharded root around it
WRAP_ATTR = "_shardwrap_lightning_wrap"  # on a LightningModule: the options it was sharded with


def _check_reused(sharded_with: dict[str, Any], asked: dict[str, Any]) -> None:
    """Refuse a strategy whose options would not apply: the ``LightningModule`` was sharded
    by an earlier ``Trainer`` with ``sharded_with``, and keeps how it was sharded. A strategy
    given no option (``strategy="shardwrap"``) reuses it as it is."""
    if asked == {"auto_wrap": None}:
        return
    keys = sorted(set(sharded_with) | set(asked))
    differ = [k for k in keys if not _same(sharded_with.get(k), asked.get(k))]
    if differ:
        then = ", ".join(f"{k}={sharded_with.get(k)!r}" for k in differ)
        now = ", ".join(f"{k}={asked.get(k)!r}" for k in differ)
        raise ValueError(
            f"ShardwrapStrategy: this LightningModule was sharded by an earlier Trainer with "
            f"{then}, and a sharded model keeps how it was sharded: this Trainer's {now} would "
            'not apply. Pass the same options, or none (strategy="shardwrap" reuses the '
            "model as it is); to shard it otherwise, make a new LightningModule and load the "
            "weights into it (shardwrap.load_checkpoint with a checkpoint of this run)."
        )


def _same(a: Any, b: Any) -> bool:
    """Whether two option values are alike: equal, or written alike (a policy built again)."""
    return bool(a == b) or repr(a) == repr(b)


class LightningRoot(nn.Module):
    """The sharded root around a ``LightningModule`` (``module``): Lightning's steps run inside
    its forward, so the root's hooks surround each step."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class ShardwrapStrategy(ParallelStrategy):
    """Train a ``LightningModule`` sharded with :class:`~shardwrap.ShardedModule`.

    Args:
        auto_wrap: which submodules become units, as for ``ShardedModule``.
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin:
            as for Lightning's other strategies (the ``Trainer`` sets them).
        process_group_backend: ``"gloo"`` or ``"nccl"``; by default the device's.
        timeout: how long a collective may wait for a silent rank before every rank raises.
        **wrap: any other keyword of ``ShardedModule`` (``stage``, ``mixed_precision``,
            ``offload``, ``compression``, ``checkpoint_activations``, ...); not
            ``process_group`` or ``device``, which the strategy chooses.

    Raises:
        ValueError: ``process_group`` or ``device`` among ``wrap``; a precision this strategy
            does not run (at ``Trainer(...)``, naming it and what to use).
    """

    strategy_name = "shardwrap"

    def __init__(
        self,
        auto_wrap: AutoWrap = None,
        *,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **wrap: Any,
    ) -> None:
        chosen = sorted({"process_group", "device"} & set(wrap))
        if chosen:
            raise ValueError(
                f"ShardwrapStrategy chooses {' and '.join(chosen)} itself (the Trainer's "
                "devices and its process group); leave them out"
            )
        self._wrap: dict[str, Any] = {"auto_wrap": auto_wrap, **wrap}  # the setters read it
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self.num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    # where and how many -------------------------------------------------------------

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def is_distributed(self) -> bool:
        """Lightning gives each rank its part of the data (a ``DistributedSampler``)."""
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Checkpoints load into the sharded model and its optimizers, so after both exist."""
        return True

    @property
    def lightning_restore_optimizer(self) -> bool:
        """The optimizers' state comes from the shardwrap checkpoint, not from Lightning."""
        return False

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """Refuse, when the ``Trainer`` is built, a precision the sharded model would not run."""
        if plugin is not None:
            _accept_precision(plugin, self._wrap.get("mixed_precision"))
        self._precision_plugin = plugin

    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if not self.cluster_environment.creates_processes_externally:
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )

    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self.set_world_ranks()
        assert self.cluster_environment is not None
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    def set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(
                self.node_rank * self.num_processes + self.local_rank
            )
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank

    # the model ----------------------------------------------------------------------

    def setup(self, trainer: Trainer) -> None:
        """Shard the ``LightningModule`` (once: a later ``fit``, ``validate`` or ``test``, by
        this ``Trainer`` or another, reuses its root), then build its optimizers over the
        pieces."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        root = getattr(self.model, ROOT_ATTR, None)
        if root is None:
            if trainer.state.fn == TrainerFn.FITTING and self._layer_sync:
                self.model = self._layer_sync.apply(self.model)
            self.model.to(self.root_device)
            root = ShardedModule(LightningRoot(self.model), **self._wrap)
            # on the module, unregistered: a later Trainer's validate or test finds it
            object.__setattr__(self.model, ROOT_ATTR, root)
            object.__setattr__(self.model, WRAP_ATTR, dict(self._wrap))
        else:
            _check_reused(getattr(self.model, WRAP_ATTR, {}), self._wrap)
        self.model = root
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        """Nothing: the model is moved before it is sharded (a sharded model refuses moves)."""

    def teardown(self) -> None:
        """Leave the sharded model where it is (Lightning's default moves it to the CPU)."""
        assert self.cluster_environment is not None and self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    # collectives --------------------------------------------------------------------

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(
        self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean"
    ) -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # checkpoints --------------------------------------------------------------------

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Empty: the model's state goes into the shardwrap checkpoint (:meth:`save_checkpoint`)."""
        return {}

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Tensor]:
        """Empty: the optimizers' state goes into the shardwrap checkpoint."""
        return {}

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the model."""

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Nothing: :meth:`load_checkpoint` loaded the optimizers."""

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any | None = None
    ) -> None:
        """Write the folder ``filepath``: the model and (unless Lightning saves weights only)
        its optimizers as a shardwrap checkpoint, on every rank; the rest from rank 0."""
        if storage_options is not None:
            raise TypeError(
                "ShardwrapStrategy.save_checkpoint(..., storage_options=...): shardwrap writes "
                "its checkpoints itself, not through a CheckpointIO"
            )
        path = Path(self.broadcast(str(filepath)))
        rest = dict(checkpoint)
        rest.pop("state_dict", None)
        optimizers = self._optimizers_to_save() if "optimizer_states" in rest else None
        rest.pop("optimizer_states", None)
        if self.is_global_zero and path.is_file():
            path.unlink()  # a file of another strategy's at this path
        self.barrier()
        save_checkpoint(path / SHARDS, self.model, optimizers)
        if self.is_global_zero:
            partial = path / f".{LIGHTNING_STATE}.partial"
            torch.save(rest, partial)
            os.replace(partial, path / LIGHTNING_STATE)
        self.barrier()

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        """Load the model (and, while fitting, its optimizers) from the folder
        ``checkpoint_path`` at this run's world size; return the rest for Lightning."""
        path = Path(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None
        state = torch.load(path / LIGHTNING_STATE, weights_only=weights_only)
        # A weights-only checkpoint (no "lr_schedulers") resumes no optimizer: load the model
        # alone, and Lightning then says what the checkpoint lacks, as for its own strategies.
        resumes = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        optimizers = self._optimizers_to_save() if resumes and "lr_schedulers" in state else None
        load_checkpoint(path / SHARDS, self.model, optimizers)
        return state

    def _optimizers_to_save(self) -> Any:
        """The optimizers as ``save_checkpoint`` takes them: none, one, or a list."""
        if not self.optimizers:
            return None
        return self.optimizers[0] if len(self.optimizers) == 1 else list(self.optimizers)


def _accept_precision(plugin: Precision, mixed_precision: Any) -> None:
    """Take ``plugin`` (its loss scaler made a ``ShardedGradScaler``), or raise for a precision
    the sharded model would not run, naming what to use."""
    if type(plugin) is Precision:
        return
    if type(plugin) is MixedPrecision:
        if mixed_precision is not None:
            raise ValueError(
                f"Trainer(precision={plugin.precision!r}) with ShardwrapStrategy(mixed_precision="
                "...): both would cast the computation; choose one"
            )
        if plugin.scaler is not None and not isinstance(plugin.scaler, ShardedGradScaler):
            plugin.scaler = ShardedGradScaler(plugin.device)  # every rank skips a step alike
        return
    name = getattr(plugin, "precision", type(plugin).__name__)
    raise ValueError(
        f"ShardwrapStrategy does not run Trainer(precision={name!r}): use '32-true', "
        "'bf16-mixed' or '16-mixed' (autocast over fp32 shards), or compute in bf16 with fp32 "
        "shards: ShardwrapStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))"
    )


StrategyRegistry.register(
    ShardwrapStrategy.strategy_name,
    ShardwrapStrategy,
    description="shardwrap: ZeRO stages 1-3 with flat per-unit shards (shardwrap.lightning)",
)
