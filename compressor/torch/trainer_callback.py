"""``transformers.Trainer`` integration: :class:`CompressionCallback` (imports transformers).

    pruner = AGPPruner(model, config_list)          # no optimizer: the Trainer makes it
    model = pruner.compress()
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[CompressionCallback(pruner)])
    trainer.train()

The callback hooks the optimizer the Trainer created (under accelerate's wrapper, so the compressor steps
once per real optimizer update, not per gradient-accumulation micro-batch) when training begins, and calls
``update_epoch`` at each epoch start. The schedule is the one a plain loop gives (tested step by step).
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from .callbacks import LoopDriver

__all__ = ["CompressionCallback"]


class CompressionCallback(TrainerCallback):
    """Drives ``compressor`` (any pruner or quantizer of ``compressor.torch``) from ``transformers.Trainer``:
    hooks the Trainer's optimizer at train begin, ``update_epoch(floor(state.epoch))`` at each epoch begin,
    masks re-applied at both (a resumed checkpoint's weights are masked again)."""

    def __init__(self, compressor: Any) -> None:
        self.driver = LoopDriver(compressor)
        self.compressor = compressor

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        self.driver.train_begin(optimizer)

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.epoch_begin(state.epoch or 0)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.driver.step_end()
