"""PyTorch Lightning integration: :class:`CompressionCallback` (imports ``lightning``; install the
``lightning`` extra).

    pruner = AGPPruner(module.net, config_list)     # no optimizer: configure_optimizers makes it
    pruner.compress()
    lightning.Trainer(max_epochs=10, callbacks=[CompressionCallback(pruner)]).fit(module, loader)
"""

from __future__ import annotations

from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("compressor.torch.lightning_callback needs PyTorch Lightning: "
                      "pip install 'compressor[lightning]' (lightning>=2.0)") from e

from ..core.errors import ConfigError
from .callbacks import LoopDriver

__all__ = ["CompressionCallback"]


class CompressionCallback(Callback):
    """Drives ``compressor`` from ``lightning.Trainer.fit``: hooks ``trainer.optimizers[optimizer_index]``
    (the torch optimizer under Lightning's wrapper) at train start, ``update_epoch(trainer.current_epoch)``
    at each train epoch start, masks re-applied at both."""

    def __init__(self, compressor: Any, optimizer_index: int = 0) -> None:
        self.driver = LoopDriver(compressor)
        self.compressor = compressor
        self.optimizer_index = optimizer_index

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        optimizers = list(trainer.optimizers)
        if not 0 <= self.optimizer_index < len(optimizers):
            raise ConfigError(f"CompressionCallback(optimizer_index={self.optimizer_index}): the Trainer has "
                              f"{len(optimizers)} optimizer(s); pass an index in 0..{len(optimizers) - 1}")
        self.driver.train_begin(optimizers[self.optimizer_index])

    def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
        self.driver.epoch_begin(trainer.current_epoch)

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.driver.step_end()
