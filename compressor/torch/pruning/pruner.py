"""``TorchPruner`` (alias ``Pruner``): wraps layers in :class:`PrunerModuleWrapper` and keeps masks current.

Clock: ``compress()`` computes the first masks; after every ``optimizer.step()`` the optimizer hook
calls :meth:`TorchPruner.step`, which calls ``calc_mask(wrapper, wrapper_idx)`` for every wrapper
(the seeds' contract: return ``{'weight_mask': ..., 'bias_mask': ...}`` or None, or assign
``wrapper.weight_mask`` yourself) and re-masks the weights in place.

:class:`OneShotPruner` is the base of the built-in one-shot pruners: one masker, masks computed once per
layer (as soon as the masker's statistics are ready), never recomputed. A user subclass that overrides
``calc_mask`` (a class outside this package, :func:`~compressor.core.clock.user_override`) gets it called
after every ``optimizer.step()``, as the seeds promise; the built-ins keep their no-recompute fast path.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from ...core.clock import user_override
from ...core.errors import ConfigError, ModelError
from ...core.interrupts import commit_changes, deferred_interrupts, record_undo, undone_on_error
from ...core.matching import LayerInfo
from ..compressor import Compressor
from .dependency import DependencyAwareMixin
from .masker import WeightMasker
from .wrapper import PrunerModuleWrapper

__all__ = ["TorchPruner", "Pruner", "OneShotPruner"]


_ACCEPTS_IDX: dict[Any, bool] = {}


def _accepts_wrapper_idx(fn: Any) -> bool:
    """Seed examples define ``calc_mask(self, wrapper)``, ``(wrapper, **kwargs)`` or ``(wrapper, wrapper_idx=None)``."""
    key = getattr(fn, "__func__", fn)
    if key not in _ACCEPTS_IDX:
        try:
            params = inspect.signature(fn).parameters.values()
            _ACCEPTS_IDX[key] = any(p.name == "wrapper_idx" or p.kind is inspect.Parameter.VAR_KEYWORD
                                    for p in params)
        except (TypeError, ValueError):
            _ACCEPTS_IDX[key] = True
    return _ACCEPTS_IDX[key]


class TorchPruner(Compressor):
    """Base of all PyTorch pruners; subclasses implement :meth:`calc_mask`."""

    _kind = "pruner"

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None):
        super().__init__(model, config_list, optimizer)
        self.current_epoch = 0
        self._mask_round = 0

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        if not isinstance(getattr(module, "weight", None), torch.Tensor):
            raise ConfigError(
                f"{type(self).__name__}: layer {layer_info.name!r} ({layer_info.type}) has no weight tensor to prune"
            )

    def _create_wrapper(self, module: nn.Module, layer_info: LayerInfo, config: dict[str, Any]) -> nn.Module:
        return PrunerModuleWrapper(module, layer_info.name, layer_info.type, config, self)

    # ---------------------------------------------------------------- masks
    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        """Masks of ``wrapper`` now, or None to keep its current masks."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask()")

    def update_mask(self) -> None:
        """Run ``calc_mask`` on every wrapper, store returned masks, and re-mask changed layers."""
        self._mask_round += 1
        pass_idx = _accepts_wrapper_idx(self.calc_mask)
        for idx, wrapper in enumerate(self.modules_wrapper):
            masks = self.calc_mask(wrapper, wrapper_idx=idx) if pass_idx else self.calc_mask(wrapper)
            if masks is not None:
                wrapper.set_masks(masks)
        self.apply_masks()

    def apply_masks(self) -> None:
        """Re-mask in place every layer whose weights or masks changed since it was last masked
        (after an optimizer step: all that were stepped), in one multi-tensor multiply."""
        stale = [w for w in self.modules_wrapper if w._versions() != w._seen]
        if not stale:
            return
        tensors: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        for w in stale:
            w._mask_pairs(tensors, masks)
        # the weights change here for good: inside compress() this is its commit (the masks set before it are
        # no longer put back on an error)
        with torch.no_grad():
            try:
                torch._foreach_mul_(tensors, masks)
            except RuntimeError:
                check_not_sharded(tensors, type(self).__name__)
                raise
            commit_changes()
            for w in stale:
                w._mark_masked()

    def compress(self) -> nn.Module:
        """Compute the initial masks and return the (wrapped) model. A Ctrl-C while it runs takes effect when it
        has finished (the model pruned); an error (a ``calc_mask`` raising) before the weights are masked puts
        every mask it set back: the model is as before."""
        with deferred_interrupts(), undone_on_error():
            self._undoable_round()
            self.update_mask()
        return self.bound_model

    def _undoable_round(self) -> None:
        """Inside :func:`~compressor.core.interrupts.undone_on_error`: what a mask round changes besides the
        masks is put back too if it does not finish (the pruner's own state, torch's grad mode)."""
        on, state = torch.is_grad_enabled(), self.state_dict()
        record_undo(("grad",), lambda: torch.set_grad_enabled(on), change=False)
        record_undo(("pruner", id(self)), lambda: self.load_state_dict(state), change=False)

    def mark_weights_stale(self) -> None:
        """Make the next :meth:`apply_masks` re-mask every layer: the optimizer hook calls it after a fused
        optimizer step, whose kernels move the weights without bumping the version counters that
        :meth:`apply_masks` reads to find the layers that moved."""
        for w in self.modules_wrapper:
            object.__setattr__(w, "_seen", None)

    def step(self) -> None:
        """After ``optimizer.step()``: update masks, then zero the pruned weights the step moved."""
        self.update_mask()

    def update_epoch(self, epoch: int) -> None:
        self.current_epoch = int(epoch)

    def _wrapper_index(self, wrapper: nn.Module) -> int:
        for i, w in enumerate(self.modules_wrapper):
            if w is wrapper:
                return i
        raise ValueError(f"{getattr(wrapper, 'name', wrapper)!r} is not a wrapper of this pruner")

    # ---------------------------------------------------------------- state, export, report
    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.current_epoch}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.current_epoch = int(state.get("epoch", 0))

    def export_model(self, model_path: str | None, mask_path: str | None = None, onnx_path: str | None = None,
                     input_shape: tuple[int, ...] | None = None, device: Any = None, dummy_input: Any = None,
                     compressed_path: str | None = None, hf_path: str | None = None, hf_sparse_format: str = "dense",
                     **onnx_kwargs: Any) -> None:
        """Save a state_dict loadable into the ORIGINAL model class (pruned weights zeroed), optionally
        the masks (``{layer: {'weight': mask, 'bias': mask}}``) and an ONNX file checked with onnxruntime.
        ONNX inputs: ``dummy_input`` (a tensor, a tuple, or a dict of keyword arguments such as
        ``{'input_ids': ids, 'attention_mask': mask}``) or ``input_shape`` (a random float tensor); the
        graph has dynamic batch (and token sequence) axes; ``onnx_kwargs`` go to ``torch.onnx.export``.
        ``compressed_path``: also the same state_dict as a compressed file (kept values, positions, entropy
        coded; :mod:`compressor.core.cmpk`), read by ``compressor.unpack`` / ``load_compressed``.
        ``hf_path``: a Hugging Face model as a compressed-tensors checkpoint folder (pruned layers stored as
        ``hf_sparse_format``: ``'dense'``, ``'bitmask'``, ``'2:4'`` or ``'auto'``; one-shot quantized layers
        of a quantizer composed on top packed; see :mod:`compressor.torch.hf_checkpoint`); ``model_path``
        may then be None."""
        from ...core.atomic import transaction
        from .. import families
        from .export import export_pruned_model

        with transaction():  # every artifact, the hf_path folder included, lands or none does (core.atomic)
            if hf_path is not None:
                families.save_checkpoint(self.bound_model, hf_path, sparse_format=hf_sparse_format)
                if model_path is None and mask_path is None and onnx_path is None and compressed_path is None:
                    return
            export_pruned_model(self, model_path, mask_path, onnx_path, input_shape, device, dummy_input,
                                compressed_path=compressed_path, **onnx_kwargs)

    def load_model_state_dict(self, state: dict[str, Any]) -> None:
        """Load a state_dict of the original model (or of the wrapped model) into the wrapped model."""
        from .export import load_into_wrapped

        load_into_wrapped(self, state)

    def report(self, dummy_input: Any = None, strict: bool = False) -> Any:
        """Per-layer and total sparsity: a list of dicts whose ``str()`` is a table. With ``dummy_input``
        also dense vs after-speedup params and MACs (the speedup runs on a copy)."""
        from .report import sparsity_report

        return sparsity_report(self, dummy_input=dummy_input, strict=strict)


Pruner = TorchPruner


def check_not_sharded(tensors: list[torch.Tensor], what: str) -> None:
    """Explain the failure of masking parameters that FSDP has sharded (DTensors): masks are full-size
    tensors and the criteria need whole weights, so pruning under FSDP is not supported."""
    if any(type(t).__name__ == "DTensor" for t in tensors):
        raise ModelError(
            f"{what}: the pruned weights are sharded (FSDP / DTensor); pruners need whole weights and full-size "
            f"masks, so they do not work under FSDP. Prune with DDP (or on one device), export, then train the "
            f"pruned model with FSDP. See docs/guides/distributed.md"
        )


class OneShotPruner(DependencyAwareMixin, TorchPruner):
    """Masks each layer once with ``masker_class`` at its config's ``sparsity``."""

    masker_class: type[WeightMasker] = WeightMasker
    required_keys = ("sparsity",)

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None,
                 dependency_aware: bool = False, dummy_input: Any = None, **masker_kwargs: Any):
        self._init_dependency(dependency_aware, dummy_input)
        super().__init__(model, config_list, optimizer)
        self._dummy_input = None  # traced already: do not keep the user's tensors alive
        self._calculated: set[int] = set()
        self.masker = self.masker_class(model, self, **masker_kwargs)

    def _all_calculated(self) -> bool:
        return len(self._calculated) == len(self.modules_wrapper)

    def _update_groups(self) -> None:
        """One decision per channel group not decided yet (groups wait until every scored member's
        statistics are ready)."""
        self._calculated.update(self._group_round(lambda i: i not in self._calculated,
                                                  lambda i: self.sparsity_for(self.modules_wrapper[i], i)))

    def update_mask(self) -> None:
        if self._dependency is None:
            return super().update_mask()
        self._mask_round += 1
        self._update_groups()
        # selected layers in no group (the plan's warning says why) stay unpruned: speedup could not remove them
        self._calculated.update(self._ungrouped_indices())
        if self._all_calculated():
            self.masker.stop_statistics()
        self.apply_masks()

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self.masker_class.check_layer(layer_info, module)

    def compress(self) -> nn.Module:
        if len(self._calculated) < len(self.modules_wrapper):
            self.masker.start_statistics()
        return super().compress()

    def step(self) -> None:
        self.apply_masks()  # first zero what the step moved, so statistics see the masked weights
        pending = len(self._calculated) < len(self.modules_wrapper)
        if pending:
            self.masker.after_step()
        if pending or user_override(self, "calc_mask"):
            # built-ins stop once every layer is masked; a user's calc_mask runs at every step (seed 000)
            self.update_mask()

    def sparsity_for(self, wrapper: nn.Module, wrapper_idx: int) -> float:
        return wrapper.config["sparsity"]

    def calc_mask(self, wrapper: nn.Module, wrapper_idx: int | None = None) -> dict[str, Any] | None:
        idx = self._wrapper_index(wrapper) if wrapper_idx is None else wrapper_idx
        if idx in self._calculated or not self.masker.statistics_ready(idx):
            return None
        masks = self.masker.calc_mask(self.sparsity_for(wrapper, idx), wrapper, idx)
        self._calculated.add(idx)
        if self._all_calculated():
            self.masker.stop_statistics()
        return masks

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "calculated": sorted(self._calculated)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self._calculated = set(state.get("calculated", ()))
        if self._all_calculated():
            self.masker.stop_statistics()
