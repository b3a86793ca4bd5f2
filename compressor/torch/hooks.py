"""The optimizer hook: runs ``compressor.step()`` after every ``optimizer.step()``.

Built on torch's ``Optimizer.register_step_post_hook`` (no patching of ``step``), so it survives
``zero_grad``, LR schedulers (which wrap ``step``) and custom ``Optimizer`` subclasses. A per-optimizer
registry makes installation idempotent: installing the same compressor twice on one optimizer is a
no-op, while different compressors sharing an optimizer each run exactly once per step.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..core.errors import ConfigError

# optimizer -> {id(compressor): (compressor, handle)}, in installation order. The hook closure holds
# the compressor strongly (like a patched step would), so ``model = Pruner(...).compress()`` keeps
# pruning while the optimizer lives; ``uninstall`` releases it.
_REGISTRY: weakref.WeakKeyDictionary[torch.optim.Optimizer, dict[int, tuple[Any, Any]]] = weakref.WeakKeyDictionary()


def check_optimizer(optimizer: Any, what: str = "compressor") -> None:
    """Refuse anything that is not ``None`` or a ``torch.optim.Optimizer`` (before touching the model)."""
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(
            f"{what}: optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )


def install(optimizer: torch.optim.Optimizer, compressor: Any) -> bool:
    """Hook ``compressor.step()`` after ``optimizer.step()``; False if it was already hooked."""
    entries = _REGISTRY.setdefault(optimizer, {})
    if id(compressor) in entries:
        return False

    def _after_step(opt: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if any(g.get("fused") for g in opt.param_groups):
            # fused kernels (AdamW(fused=True), the transformers.Trainer default) update the parameters
            # without bumping their version counters, which is how wrappers see that weights moved
            stale = getattr(compressor, "mark_weights_stale", None)
            if stale is not None:
                stale()
        compressor.step()

    handle = optimizer.register_step_post_hook(_after_step)
    entries[id(compressor)] = (compressor, handle)
    return True


def uninstall(optimizer: torch.optim.Optimizer | None, compressor: Any) -> bool:
    """Remove ``compressor``'s hook from ``optimizer``; False if it was not hooked."""
    if optimizer is None:
        return False
    entries = _REGISTRY.get(optimizer)
    if not entries or id(compressor) not in entries:
        return False
    _, handle = entries.pop(id(compressor))
    handle.remove()
    if not entries:
        del _REGISTRY[optimizer]
    return True


def hooked_compressors(optimizer: torch.optim.Optimizer) -> list[Any]:
    """The compressors hooked on ``optimizer``, in the order their hooks run."""
    return [c for c, _ in _REGISTRY.get(optimizer, {}).values()]
