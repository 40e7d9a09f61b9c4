"""One ``LightningModule`` trained by Lightning's ``Trainer`` under its DDP strategy and under
``strategy="shardwrap"``, and a run resumed from a ``ModelCheckpoint``.

Launched by tests/e2e/test_lightning.py:

    torchrun --standalone --nproc_per_node=2 tests/e2e/scripts/lightning_parity.py train OUT DIR
    torchrun --standalone --nproc_per_node=1 tests/e2e/scripts/lightning_parity.py resume OUT DIR

``train`` (2 ranks) fits each configuration twice, under ``"ddp"`` and under shardwrap: fp32 at
stages 1, 2 and 3 (units: the blocks); then ``gradient_clip_val``, ``accumulate_grad_batches``
and ``precision="bf16-mixed"`` with ``strategy="shardwrap"`` (its defaults: stage 3, the whole
model one unit); every run two epochs of 4 batches of 8 rows (each rank its 4). The stage-3
fp32 run also keeps a ``ModelCheckpoint`` of each epoch, and its trained model is then
validated by a new ``Trainer`` (as is DDP's). (On the CPU Lightning runs
``"16-mixed"`` as ``"bf16-mixed"``, so it is not run here.)
``resume`` (1 rank, the same global batch of 8) fits from the first epoch's checkpoint to the
end of the second. Rank 0 writes each run's losses (the global mean loss of every
``training_step``, in order), the validation losses and the files of the checkpoint.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor, nn

import shardwrap.lightning  # noqa: F401  (registers strategy="shardwrap")
from shardwrap.lightning import ShardwrapStrategy
from tests.support.launch import end_ranks

WIDTH, ROWS, GLOBAL_BATCH, EPOCHS = 16, 32, 8, 2


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.down(torch.tanh(self.up(x)))


class Regressor(pl.LightningModule):
    """Two residual blocks and a head, SGD with momentum; records each step's loss."""

    def __init__(self, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()  # the checkpoint's hyperparameters load back
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(WIDTH, 1)
        self.losses: list[Tensor] = []

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(x)).squeeze(-1)

    def training_step(self, batch: tuple[Tensor, Tensor], index: int) -> Tensor:
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.detach().float())
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], index: int) -> None:
        x, y = batch
        self.log("val", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


def _data(per_rank: int) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(ROWS, WIDTH, generator=g)
    y = torch.randn(ROWS, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=per_rank)


def _fit(strategy: Any, ckpt_dir: Path | None = None, resume: Path | None = None, **kw: Any):
    torch.manual_seed(0)
    model = Regressor()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=ckpt_dir is not None,
        callbacks=[pl.callbacks.ModelCheckpoint(dirpath=ckpt_dir, save_top_k=-1)]
        if ckpt_dir is not None
        else None,
        **kw,
    )
    data = _data(GLOBAL_BATCH // trainer.world_size)
    trainer.fit(model, data, ckpt_path=resume)
    losses = torch.stack(model.losses)
    losses = trainer.strategy.reduce(losses, reduce_op="mean")
    return [float(v) for v in losses], model, data


def _validate(strategy: Any, model: Regressor, data: Any) -> float:
    """The trained model's mean loss over the data, from a new Trainer."""
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=torch.distributed.get_world_size(),
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    return float(trainer.validate(model, data, verbose=False)[0]["val"])


def _train(out: Path, folder: Path) -> None:
    result: dict[str, Any] = {}
    for stage in (1, 2, 3):
        ckpt = folder / "checkpoints" if stage == 3 else None
        result[f"ddp-{stage}"], ddp_model, data = _fit("ddp")
        strategy = ShardwrapStrategy(auto_wrap=Block, stage=stage)
        result[f"shardwrap-{stage}"], model, _ = _fit(strategy, ckpt_dir=ckpt)
    result["validated"] = [_validate("ddp", ddp_model, data), _validate("shardwrap", model, data)]
    settings = {
        "clip": {"gradient_clip_val": 0.05},
        "accumulate": {"accumulate_grad_batches": 2},
        "bf16-mixed": {"precision": "bf16-mixed"},
    }
    for name, kw in settings.items():
        result[f"ddp-{name}"], *_ = _fit("ddp", **kw)
        result[f"shardwrap-{name}"], *_ = _fit("shardwrap", **kw)
    result["strategy"] = type(pl.Trainer(strategy="shardwrap", logger=False).strategy).__name__
    result["checkpoints"] = sorted(
        str(p.relative_to(folder / "checkpoints"))
        for p in (folder / "checkpoints").rglob("*")
        if p.is_file()
    )
    if torch.distributed.get_rank() == 0:
        out.write_text(json.dumps(result))


def _resume(out: Path, folder: Path) -> None:
    first = sorted((folder / "checkpoints").glob("epoch=0-*.ckpt"))[0]
    losses, *_ = _fit(ShardwrapStrategy(auto_wrap=Block), resume=first)
    out.write_text(json.dumps({"resumed": losses}))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")  # Lightning's advice on workers and logging
    mode, out, folder = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    torch.distributed.init_process_group("gloo")
    (_train if mode == "train" else _resume)(out, folder)
    end_ranks()
