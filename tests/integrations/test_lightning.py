"""``shardwrap.lightning``'s strategy as Lightning's ``Trainer`` builds it, in this process:
``strategy="shardwrap"`` finds it by name; precisions it does not run are refused by name when
the ``Trainer`` is built (``"bf16-true"``, ``"16-true"``, ``"64-true"``, and an autocast
precision together with shardwrap's own ``mixed_precision``), as are ``process_group`` and
``device``, which the strategy chooses; float16's loss scaler becomes a ``ShardedGradScaler``;
a later ``Trainer`` asking other options of a model already sharded is refused.
Training, checkpoints and resuming under torchrun: ``tests/e2e/test_lightning.py``.

Run: ``OMP_NUM_THREADS=1 .venv/bin/python -m pytest tests/integrations/test_lightning.py``
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.precision import MixedPrecision as AutocastPrecision

from shardwrap import MixedPrecision, ShardedGradScaler
from shardwrap.lightning import ShardwrapStrategy

pytestmark = pytest.mark.stage3  # no stage involved


@pytest.fixture(autouse=True)
def no_default_group_left() -> Iterator[None]:
    """A ``Trainer`` sets a launcher's variables (``LOCAL_RANK``, ``MASTER_ADDR``,
    ``MASTER_PORT``) and, once it fits or validates, starts torch.distributed's default group
    (of this process alone); both are undone after each test, so that the tests that run after
    it in this process find neither."""
    saved = dict(os.environ)
    yield
    if dist.is_initialized():
        dist.destroy_process_group()
    for name in set(os.environ) - set(saved):
        del os.environ[name]
    os.environ.update(saved)


def _trainer(**kw: object) -> pl.Trainer:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on loggers and workers
        return pl.Trainer(accelerator="cpu", devices=1, logger=False, **kw)


def test_strategy_shardwrap_is_found_by_name() -> None:
    assert isinstance(_trainer(strategy="shardwrap").strategy, ShardwrapStrategy)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "64-true"])
def test_precisions_it_does_not_run_are_refused_by_name(precision: str) -> None:
    with pytest.raises(ValueError, match=f"precision='{precision}'.*MixedPrecision"):
        _trainer(strategy="shardwrap", precision=precision)


def test_autocast_with_shardwraps_own_mixed_precision_is_refused() -> None:
    strategy = ShardwrapStrategy(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="precision='bf16-mixed'.*choose one"):
        _trainer(strategy=strategy, precision="bf16-mixed")


@pytest.mark.parametrize("chosen", ["process_group", "device"])
def test_what_the_strategy_chooses_is_refused(chosen: str) -> None:
    with pytest.raises(ValueError, match=f"chooses {chosen} itself"):
        ShardwrapStrategy(**{chosen: None})


def test_float16_loss_scaling_skips_steps_on_every_rank_alike() -> None:
    """Lightning runs ``"16-mixed"`` as ``"bf16-mixed"`` on the CPU, so the plugin a GPU run
    gets is handed to the strategy directly."""
    plugin = AutocastPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    ShardwrapStrategy().precision_plugin = plugin
    assert isinstance(plugin.scaler, ShardedGradScaler)


class _Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        return self.layer(batch[0]).square().mean()

    def validation_step(self, batch: list[torch.Tensor], index: int) -> None:
        self.log("val", self.layer(batch[0]).square().mean())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_later_trainer_asking_other_options_is_refused_naming_them(tmp_path: Path) -> None:
    """A ``LightningModule`` sharded by one ``Trainer``'s strategy keeps how it was sharded: a
    later ``Trainer`` whose strategy asks other options (``stage=1`` after ``stage=2``) raises
    naming both, where they were dropped without a word; one given none reuses the model, as
    does one asking the same."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    torch.manual_seed(0)
    model = _Tiny()
    _trainer(strategy=ShardwrapStrategy(stage=2), max_steps=2, default_root_dir=tmp_path).fit(
        model, data
    )
    with pytest.raises(ValueError, match=r"earlier Trainer with stage=2.*Trainer's stage=1"):
        _trainer(strategy=ShardwrapStrategy(stage=1)).validate(model, data, verbose=False)
    for strategy in ("shardwrap", ShardwrapStrategy(stage=2)):
        _trainer(strategy=strategy).validate(model, data, verbose=False)


def test_resuming_from_a_weights_only_checkpoint_says_so(tmp_path: Path) -> None:
    """A checkpoint saved with ``save_weights_only=True`` holds no optimizer state: resuming
    ``fit`` from it raises Lightning's own error naming ``save_weights_only``, as under its
    other strategies (before: shardwrap's advice to pass ``optimizer=None``, which a Lightning
    user cannot); ``validate`` from it loads the weights."""
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4)))
    torch.manual_seed(0)
    saving = ModelCheckpoint(tmp_path, save_weights_only=True, save_last=True)
    _trainer(strategy="shardwrap", max_steps=2, callbacks=[saving]).fit(_Tiny(), data)
    last = str(tmp_path / "last.ckpt")
    with pytest.raises(KeyError, match="save_weights_only"):
        _trainer(strategy="shardwrap", max_steps=4, default_root_dir=tmp_path).fit(
            _Tiny(), data, ckpt_path=last
        )
    _trainer(strategy="shardwrap").validate(_Tiny(), data, ckpt_path=last, verbose=False)
