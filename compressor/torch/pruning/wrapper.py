"""``PrunerModuleWrapper``: holds the original layer, its bool masks and its config.

Masks are applied to the layer's weights IN PLACE (under ``no_grad``), and only when something changed:
the wrapper remembers the version counters of the weight, the bias and their masks, and re-masks in
``forward`` only when one of them moved (the optimizer stepped, a checkpoint was loaded, a mask was
recomputed). The pruner also re-masks right after every ``optimizer.step()`` because momentum and weight
decay move pruned weights. So an unchanged model runs at dense speed: no ``weight * mask`` per forward,
no second copy of the weight, and ``weight`` stays a Parameter of the original layer (optimizers built
before or after wrapping keep working). Masks are bool buffers (1 byte per weight) on the weight's
device, saved in the state_dict as ``<name>.weight_mask`` / ``<name>.bias_mask``.

Writing a weight through ``.data`` bypasses version counting: call :meth:`PrunerModuleWrapper.apply_masks`
after such writes.

``nn.DataParallel`` replicas (rebuilt from the original model at every forward) never write masks or
weights: their weights are copies of the original's, which the pruner keeps masked, and their mask buffers
are the original's (device 0) or copies. If the original's weights changed since they were last masked (a
checkpoint load, a write), a replica computes with ``weight * mask`` out of place until the next optimizer
step re-masks the original. :func:`replica_origin` maps a replica (e.g. the module a forward hook receives)
to the wrapper it was copied from.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ...core.pruner_config import MASK_NAMES, mask_to_set
from ..compressor import innermost_module


def replica_origin(module: nn.Module) -> nn.Module:
    """The module a DataParallel replica was copied from (``module`` itself if it is not a replica)."""
    return module.__dict__.get("_replica_of", module)


class PrunerModuleWrapper(nn.Module):
    """Wraps ``module`` (name ``module_name``, type name ``module_type``) for ``pruner`` with ``config``.

    ``multiplier_cache`` (class or instance attribute): keep a copy of each mask in the weight's dtype
    (not saved in the state_dict, rebuilt when the mask changes) for the in-place re-mask after each
    optimizer step. On CPU float*float runs about twice as fast as float*uint8 (torch's mixed-dtype
    path), which is most of the pruner's per-step cost. ``None`` (default): cache for CPU weights only;
    on accelerators the multiply is bandwidth-bound, so reading a 1-byte mask beats reading a 4-byte
    copy, and model memory matters more. ``True`` / ``False``: always / never (False saves 4 bytes per
    float32 weight on CPU).
    """

    multiplier_cache: bool | None = None

    def __init__(self, module: nn.Module, module_name: str, module_type: str, config: dict[str, Any], pruner: Any):
        super().__init__()
        self.module = module
        self.name = module_name
        self.type = module_type
        self.config = config
        layer = innermost_module(module)
        object.__setattr__(self, "_layer", layer)  # the original layer, not registered twice
        object.__setattr__(self, "_pruner_ref", weakref.ref(pruner) if pruner is not None else None)
        object.__setattr__(self, "_seen", None)
        object.__setattr__(self, "_mul_cache", [None, None])
        # fast path for plain layers whose weight/bias are Parameters (not parametrizations/properties)
        direct = "weight" in layer._parameters and (getattr(layer, "bias", None) is None or "bias" in layer._parameters)
        object.__setattr__(self, "_layer_params", layer._parameters if direct else None)
        weight = layer.weight
        self.register_buffer("weight_mask", torch.ones_like(weight, dtype=torch.bool))
        bias = getattr(layer, "bias", None)
        if torch.is_tensor(bias):
            self.register_buffer("bias_mask", torch.ones_like(bias, dtype=torch.bool))
        else:
            self.register_buffer("bias_mask", None)
        self._mark_bias_pristine()

    # -------------------------------------------------------------- convenient views
    @property
    def pruner(self) -> Any:
        """The pruner that owns this wrapper (None in a pickled or deep-copied model)."""
        ref = self._pruner_ref
        return None if ref is None else ref()

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # torch.save(model) / deepcopy: drop the weak link to the pruner
        state["_pruner_ref"] = None
        state["_seen"] = None
        state["_mul_cache"] = [None, None]
        return state

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped layer's weight Parameter (masked in place)."""
        return self._replica_layer().weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self._replica_layer(), "bias", None)

    # -------------------------------------------------------------- masks
    def __setattr__(self, name: str, value: Any) -> None:
        buffers = self.__dict__.get("_buffers")
        if buffers is not None and buffers.get(name) is not None and not self.__dict__.get("_is_replica"):
            # (a DataParallel replica gets its buffer copies assigned, not copied into the original's)
            if name in MASK_NAMES:
                self.set_mask(name, value)
                return
            if isinstance(value, (bool, int, float)) and not torch.is_tensor(value):
                with torch.no_grad():
                    buffers[name].fill_(value)  # e.g. wrapper.if_calculated = True on a tensor attribute
                return
        super().__setattr__(name, value)

    def set_mask(self, name: str, value: Any) -> None:
        """Copy ``value`` (bool or 0/1 numbers, any device) into mask buffer ``name`` in place."""
        current = self._buffers.get(name)
        if not mask_to_set(self.name, name, current is not None, value):
            return
        value = torch.as_tensor(value, device=current.device)
        if value.dtype != torch.bool:
            value = value != 0
        if tuple(value.shape) != tuple(current.shape):
            raise ValueError(f"{self.name}: {name} has shape {tuple(value.shape)}, expected {tuple(current.shape)}")
        with torch.no_grad():
            current.copy_(value)

    def set_masks(self, masks: dict[str, Any]) -> None:
        """Set the masks given in ``masks`` ({'weight_mask': ..., 'bias_mask': ...}); others are kept."""
        for key, value in masks.items():
            if key not in MASK_NAMES:
                raise ValueError(f"{self.name}: unknown mask {key!r}; allowed: {list(MASK_NAMES)}")
            self.set_mask(key, value)

    def _versions(self) -> tuple[int, ...]:
        # Plain dict lookups instead of nn.Module.__getattr__: this runs on every forward.
        params, buffers = self._layer_params, self._buffers
        w = params.get("weight") if params is not None else None
        if w is None:  # not a plain Parameter (e.g. a parametrization added after wrapping)
            w = self._layer.weight
        bm = buffers["bias_mask"]
        if bm is None:
            return (id(w), w._version, buffers["weight_mask"]._version)
        b = params.get("bias") if params is not None else None
        if b is None:
            b = self._layer.bias
        return (id(w), w._version, buffers["weight_mask"]._version, id(b), b._version, bm._version)

    def _mark_bias_pristine(self) -> None:
        """Remember the bias mask as never written (all True): such a bias needs no masking."""
        bm = self._buffers["bias_mask"]
        object.__setattr__(self, "_bias_pristine", None if bm is None else (id(bm), bm._version))

    def _bias_is_pristine(self) -> bool:
        bm = self._buffers["bias_mask"]
        return bm is None or self.__dict__.get("_bias_pristine") == (id(bm), bm._version)

    def _multiplier(self, slot: int, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """What ``tensor`` is multiplied by to mask it: the mask in ``tensor``'s dtype (cached per mask
        version) or, without the cache, a uint8 view sharing the bool mask's bytes (float*uint8 takes
        torch's vectorised path, float*bool does not)."""
        use = self.multiplier_cache
        if use is False or (use is None and tensor.device.type != "cpu"):
            return mask.view(torch.uint8)
        cache = self.__dict__["_mul_cache"]
        entry = cache[slot]
        key = (id(mask), mask._version, tensor.dtype)
        if entry is None or entry[0] != key:
            entry = (key, mask.to(tensor.dtype))
            cache[slot] = entry
        return entry[1]

    def _mask_pairs(self, tensors: list[torch.Tensor], masks: list[torch.Tensor]) -> None:
        """Append (tensor, multiplier) pairs of what needs masking. A bias whose mask was never written
        (the usual case: most pruners mask weights only) is skipped."""
        params, buffers = self._layer_params, self._buffers
        w = self._layer.weight if params is None or "weight" not in params else params["weight"]
        tensors.append(w)
        masks.append(self._multiplier(0, w, buffers["weight_mask"]))
        if not self._bias_is_pristine():
            b = self._layer.bias if params is None or "bias" not in params else params["bias"]
            tensors.append(b)
            masks.append(self._multiplier(1, b, buffers["bias_mask"]))

    def _mark_masked(self) -> None:
        object.__setattr__(self, "_seen", self._versions())

    def apply_masks(self) -> None:
        """Zero the pruned weights (and bias) in place now."""
        tensors: list[torch.Tensor] = []
        masks: list[torch.Tensor] = []
        self._mask_pairs(tensors, masks)
        with torch.no_grad():
            for t, m in zip(tensors, masks):
                t.mul_(m)
        self._mark_masked()

    def is_stale(self) -> bool:
        """True if the weights or masks changed since the layer was last masked."""
        return self._versions() != self._seen

    def refresh(self) -> bool:
        """Re-mask if the weights or masks changed since the last masking; True if it did."""
        origin = self.__dict__.get("_replica_of")
        if origin is not None:  # a DataParallel replica never writes weights
            if origin.is_stale():
                warnings.warn(f"{self.name}: weights changed since they were last masked and this DataParallel "
                              f"replica cannot re-mask them; call pruner.apply_masks() after loading or writing "
                              f"weights", RuntimeWarning, stacklevel=2)
            return False
        if self._versions() != self._seen:
            self.apply_masks()
            return True
        return False

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        origin = self.__dict__.get("_replica_of")
        if origin is not None:
            return self._replica_forward(origin, args, kwargs)
        if self._versions() != self._seen:
            self.apply_masks()
        return self.module(*args, **kwargs)

    # -------------------------------------------------------------- nn.DataParallel
    def _replicate_for_data_parallel(self) -> PrunerModuleWrapper:
        replica = super()._replicate_for_data_parallel()
        # the replica's layer is a replica too, set by torch after this returns: resolved at its forward
        for key, value in (("_replica_of", self), ("_layer", None), ("_layer_params", None), ("_seen", None),
                           ("_mul_cache", [None, None])):
            object.__setattr__(replica, key, value)
        return replica

    def _replica_layer(self) -> nn.Module:
        """The wrapped layer (in a DataParallel replica: the replica's, resolved on first use)."""
        layer = self.__dict__["_layer"]
        if layer is None:
            layer = innermost_module(self.module)
            object.__setattr__(self, "_layer", layer)
        return layer

    def _replica_forward(self, origin: PrunerModuleWrapper, args: tuple, kwargs: dict[str, Any]) -> Any:
        layer = self._replica_layer()
        if not origin.is_stale():
            return self.module(*args, **kwargs)  # copies of weights the pruner has masked
        prefix, module = "", self.module
        while module is not layer:
            prefix, module = prefix + "module.", module.module
        params = {prefix + "weight": layer.weight * self._buffers["weight_mask"]}
        if self._buffers["bias_mask"] is not None:
            params[prefix + "bias"] = layer.bias * self._buffers["bias_mask"]
        return torch.func.functional_call(self.module, params, args, kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> nn.Module:
        pristine = self._bias_is_pristine()
        out = super()._apply(fn, recurse)
        object.__setattr__(self, "_seen", None)  # tensors may have been replaced (model.to(device))
        object.__setattr__(self, "_mul_cache", [None, None])
        if pristine:
            self._mark_bias_pristine()
        return out

    def extra_repr(self) -> str:
        return f"name={self.name!r}, type={self.type!r}"
