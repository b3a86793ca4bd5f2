"""Drive a compressor from a training loop: the plain-loop helper and the logic the Trainer / Lightning
callbacks share.

A compressor needs two things from a loop: its ``step()`` after every optimizer step (the optimizer hook,
:mod:`compressor.torch.hooks`) and ``update_epoch(epoch)`` at each epoch start (epoch schedules such as
AGP). Frameworks that create the optimizer themselves (``transformers.Trainer``, Lightning) get it hooked
by their callback when training starts: :class:`compressor.torch.trainer_callback.CompressionCallback`,
:class:`compressor.torch.lightning_callback.CompressionCallback`. Nothing here imports either framework.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch

from ..core.errors import ConfigError

__all__ = ["LoopDriver", "compression_epochs", "unwrap_optimizer"]


def unwrap_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The ``torch.optim.Optimizer`` that really steps, under wrappers that hold it as ``.optimizer``
    (accelerate's ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``): its step runs only on real
    updates (not on gradient-accumulation micro-steps, not when a gradient scaler skips the step)."""
    for _ in range(8):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"expected a torch.optim.Optimizer (or a wrapper holding one as .optimizer), "
                          f"got {type(optimizer).__name__}")
    return optimizer


class LoopDriver:
    """What every training-loop integration does with a compressor, in one place.

    ``train_begin(optimizer)`` hooks the loop's optimizer (replacing the one the compressor was built with,
    if different) and re-applies the masks (weights loaded from a checkpoint are masked again);
    ``epoch_begin(epoch)`` calls ``update_epoch`` (once per epoch number) and re-applies the masks;
    ``step_end()`` calls ``step()`` only when no optimizer could be hooked."""

    def __init__(self, compressor: Any) -> None:
        if not (hasattr(compressor, "update_epoch") and hasattr(compressor, "hook_optimizer")):
            raise ConfigError(f"expected a compressor (a pruner or quantizer after compress()), "
                              f"got {type(compressor).__name__}")
        self.compressor = compressor
        self.manual_steps = False
        self._epoch: int | None = None

    def train_begin(self, optimizer: Any | None) -> None:
        """Hook ``optimizer`` (None: fall back to :meth:`step_end` calling ``step()``)."""
        if optimizer is None:
            self.manual_steps = self.compressor.optimizer is None
        else:
            self.compressor.hook_optimizer(unwrap_optimizer(optimizer))
            self.manual_steps = False
        self._remask()

    def epoch_begin(self, epoch: float | int) -> None:
        """``update_epoch(floor(epoch))`` the first time each epoch number is seen."""
        e = int(math.floor(float(epoch) + 1e-9))
        if e != self._epoch:
            self._epoch = e
            self.compressor.update_epoch(e)
        self._remask()

    def step_end(self) -> None:
        """After an optimizer step, when no optimizer is hooked."""
        if self.manual_steps:
            self.compressor.step()

    def _remask(self) -> None:
        apply = getattr(self.compressor, "apply_masks", None)
        if apply is not None:
            apply()


def compression_epochs(compressor: Any, optimizer: torch.optim.Optimizer, epochs: int | range,
                       ) -> Iterator[int]:
    """The plain-loop helper: hooks ``optimizer`` and yields the epoch numbers, calling
    ``update_epoch(epoch)`` before each one is run::

        for epoch in compression_epochs(pruner, optimizer, 10):
            for x, y in loader:
                optimizer.zero_grad(); loss_fn(model(x), y).backward(); optimizer.step()

    ``epochs``: a count (epochs ``0..epochs-1``) or a range (e.g. ``range(start, 10)`` when resuming)."""
    driver = LoopDriver(compressor)
    driver.train_begin(optimizer)
    for epoch in (range(epochs) if isinstance(epochs, int) else epochs):
        driver.epoch_begin(epoch)
        yield epoch
