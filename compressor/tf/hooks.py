"""The clock of TF compressors: an optimizer hook (every update) and a Keras callback (every epoch).

Which to use when
-----------------
* Pass the optimizer to the compressor (``LevelPruner(model, cfg, optimizer)``), or let the callback
  hook ``model.optimizer``: after every ``optimizer.apply`` / ``apply_gradients`` (what ``model.fit``
  and custom training loops call) the compressor's ``step()`` runs INSIDE the traced train step
  (step counter, masks re-applied / recomputed with ``tf.cond``), so it works under ``tf.function``,
  ``model.fit`` graph mode and XLA. The hook wraps ``apply`` on the optimizer instance once, whatever
  the number of compressors (no stacking); ``compressor.unhook()`` removes it.
* ``model.fit`` users add ``CompressionCallback(compressor)`` (alias ``PruningCallback``): it calls
  ``update_epoch(epoch)`` at each epoch begin (AGP schedules) and, if the compressor has no optimizer
  yet, hooks ``model.optimizer`` at train begin.
* Custom loops call ``compressor.update_epoch(epoch)`` themselves; with an unhooked optimizer, call
  ``compressor.step()`` after each update (inside your ``tf.function`` is fine).
"""

from __future__ import annotations

from typing import Any

import keras

from ..core.errors import ConfigError

__all__ = ["check_optimizer", "hook_optimizer", "unhook_optimizer", "hooked_compressors", "CompressionCallback", "PruningCallback"]

_HOOKS = "_compressor_hooks"
_ORIGINAL = "_compressor_original_apply"


def check_optimizer(optimizer: Any, what: str = "compressor") -> None:
    """Refuse anything that is not ``None`` or a Keras 3 optimizer (before touching the model)."""
    if optimizer is not None and not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ConfigError(f"{what}: optimizer must be a keras.optimizers.Optimizer (Keras 3) or None, "
                          f"got {type(optimizer).__module__}.{type(optimizer).__qualname__}")


def hooked_compressors(optimizer: Any) -> list[Any]:
    """Compressors whose ``step`` runs after ``optimizer.apply``, in hook order."""
    return list(vars(optimizer).get(_HOOKS, ()))


def hook_optimizer(optimizer: Any, compressor: Any) -> None:
    """Make ``compressor._after_optimizer_apply`` run right after each ``optimizer.apply``. Idempotent."""
    hooks = vars(optimizer).get(_HOOKS)
    if hooks is None:
        original = optimizer.apply
        hooks = []

        def apply(grads, trainable_variables=None):
            grads = list(grads)
            out = original(grads, trainable_variables)
            variables = optimizer._trainable_variables if trainable_variables is None else list(trainable_variables)
            for c in list(hooks):
                c._after_optimizer_apply(grads, variables)
            return out

        object.__setattr__(optimizer, _ORIGINAL, original)
        object.__setattr__(optimizer, _HOOKS, hooks)
        object.__setattr__(optimizer, "apply", apply)
    if not any(c is compressor for c in hooks):
        hooks.append(compressor)


def unhook_optimizer(optimizer: Any, compressor: Any) -> None:
    """Undo :func:`hook_optimizer` for ``compressor``; the optimizer is restored when no hook is left."""
    hooks = vars(optimizer).get(_HOOKS)
    if hooks is None:
        return
    hooks[:] = [c for c in hooks if c is not compressor]
    if not hooks:
        object.__delattr__(optimizer, "apply")
        object.__delattr__(optimizer, _HOOKS)
        object.__delattr__(optimizer, _ORIGINAL)


class CompressionCallback(keras.callbacks.Callback):
    """Drives a compressor from ``model.fit``: ``update_epoch`` at each epoch begin; hooks
    ``model.optimizer`` at train begin when the compressor was built without an optimizer; pruners
    re-apply their masks at train and epoch begin (weights written with ``set_weights`` /
    ``load_weights`` between ``fit`` calls are masked again)."""

    def __init__(self, compressor: Any) -> None:
        super().__init__()
        self.compressor = compressor

    def on_train_begin(self, logs: Any = None) -> None:
        c = self.compressor
        opt = getattr(self.model, "optimizer", None)
        if opt is not None and not any(x is c for x in hooked_compressors(opt)):
            c.hook_optimizer(opt)  # also retraces: fit made its train function before this callback ran
        self._remask()

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self.compressor.update_epoch(epoch)
        self._remask()

    def _remask(self) -> None:
        apply = getattr(self.compressor, "apply_masks", None)
        if apply is not None:
            apply()


PruningCallback = CompressionCallback
