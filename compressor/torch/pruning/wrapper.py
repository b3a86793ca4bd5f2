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

Under ``torch.compile`` the version counters cannot be read without breaking the graph (they are host
integers dynamo cannot guard on), so a compiled forward masks OUT OF PLACE instead: it runs the layer with
``weight - where(mask, 0, weight).detach()`` (and the same for a bias with a mask), one fused elementwise
kernel. The value equals ``weight * mask`` exactly, so outputs are right even for weights written outside
an optimizer step; the gradient w.r.t. the weight is the same dense one an eager forward gives (eager uses
the in-place-masked weight directly). The stored weights are still zeroed in place, eagerly, after every
``optimizer.step()`` (the pruner's hook) and by :meth:`PrunerModuleWrapper.apply_masks`; the compiled
forward never writes them.

Where the wrapper keeps a float copy of the mask (``multiplier_cache``, CPU by default) the compiled forward
multiplies by that copy instead (``weight + (weight * m - weight).detach()``, the same exact value): inductor's
CPU kernels read a bool mask several times slower than a float one. That copy is brought up to date eagerly
by ``set_mask`` / ``set_masks`` / assigning ``wrapper.weight_mask = ...``, ``load_state_dict``,
``apply_masks`` and every optimizer step, i.e. by every way the pruners write masks; a mask edited IN PLACE
by other code (``wrapper.weight_mask[i] = False``) reaches compiled forwards at the next of those (eager
forwards see it at once). Without the copy (accelerators, ``multiplier_cache=False``) compiled forwards read
the bool mask itself.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import nn

from ...core.interrupts import record_undo, undo_active
from ...core.pruner_config import MASK_NAMES, mask_to_set
from ..modules import innermost_module
from ..slots import WeightSlot


def read_through_target(wrapper: nn.Module, name: str) -> nn.Module | None:
    """The layer an attribute lookup ``name`` that failed on ``wrapper`` falls back to, or None.

    Model code reads a wrapped layer's attributes (``conv.stride``, ``fc.in_features``, ``conv.padding``
    in HF MobileNetV2's TF-style padding); the wrapper answers with the ORIGINAL layer's (inside nested
    wrappers). Dunder names (``copy``/``pickle`` probe them) and the compressors' own bookkeeping names
    (``_compressor_*``: whether a module is a wrapper) are never read through. Writes are not forwarded.
    """
    if name.startswith("__") or name.startswith("_compressor"):
        return None
    module = wrapper.__dict__.get("_modules", {}).get("module")
    if module is None:  # being built or unpickled
        return None
    return innermost_module(module)


def effective_weight(layer: nn.Module) -> torch.Tensor:
    """The weight ``layer`` computes with. For a :class:`~compressor.torch.slots.WeightSlot` (one matrix of an
    attention or recurrent layer) that is what calling it returns, which may be a substitute set by an outer
    wrapper's ``functional_call``; for other layers ``layer.weight`` (functional_call replaces it)."""
    return layer() if isinstance(layer, WeightSlot) else layer.weight


def _masked(tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``tensor * mask`` (bit-exact for finite values) whose gradient w.r.t. ``tensor`` is the identity."""
    return tensor - torch.where(mask, 0, tensor).detach()


class ReadThrough(nn.Module):
    """Base of the compressors' module wrappers: an attribute the wrapper lacks is read from the wrapped
    layer (see :func:`read_through_target`), so model code reading ``conv.stride`` keeps working."""

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)  # the wrapper's own parameters, buffers and submodules
        except AttributeError:
            layer = read_through_target(self, name)
            if layer is None:
                raise
        return getattr(layer, name)


def replica_origin(module: nn.Module) -> nn.Module:
    """The module a DataParallel replica was copied from (``module`` itself if it is not a replica)."""
    return module.__dict__.get("_replica_of", module)


class PrunerModuleWrapper(ReadThrough):
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
        object.__setattr__(self, "_mul_cache", [None, None])  # ((mask id, version, dtype), float mask) per slot
        object.__setattr__(self, "_mul_live", [None, None])  # the same float masks alone (what compiled code reads)
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
        state["_mul_live"] = [None, None]
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
        if undo_active():  # inside compress(): the mask from before it, put back if compress() does not finish
            old = current.clone()
            record_undo(("mask", id(current)), lambda: self._restore_mask(current, old))
        with torch.no_grad():
            current.copy_(value)
        self._refresh_multipliers()

    def _restore_mask(self, current: torch.Tensor, old: torch.Tensor) -> None:
        with torch.no_grad():
            current.copy_(old)
        self._refresh_multipliers()

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

    def drop_multiplier_cache(self) -> None:
        """Forget the float copies of the masks (rebuilt on the next masking if ``multiplier_cache`` allows)."""
        object.__setattr__(self, "_mul_cache", [None, None])
        object.__setattr__(self, "_mul_live", [None, None])

    def _caches_multiplier(self, tensor: torch.Tensor) -> bool:
        use = self.multiplier_cache
        return use is True or (use is None and tensor.device.type == "cpu")

    def _multiplier(self, slot: int, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """What ``tensor`` is multiplied by to mask it: the mask in ``tensor``'s dtype (cached, updated in
        place when the mask's version moves, so compiled code holding it sees the update) or, without the
        cache, a uint8 view sharing the bool mask's bytes (float*uint8 takes torch's vectorised path,
        float*bool does not)."""
        if not self._caches_multiplier(tensor):
            return mask.view(torch.uint8)
        cache = self.__dict__["_mul_cache"]
        live = self.__dict__.setdefault("_mul_live", [None, None])
        entry = cache[slot]
        key = (id(mask), mask._version, tensor.dtype)
        if entry is not None and entry[0] == key:
            return entry[1]
        mul = entry[1] if entry is not None else None
        if mul is None or mul.dtype != tensor.dtype or mul.device != mask.device or mul.shape != mask.shape:
            mul = mask.to(tensor.dtype)
        else:
            with torch.no_grad():
                mul.copy_(mask)
        cache[slot] = (key, mul)
        live[slot] = mul
        return mul

    def _refresh_multipliers(self) -> None:
        """Bring the cached float masks that exist up to date with the bool masks (eager)."""
        cache = self.__dict__.get("_mul_cache")
        if cache is None or self.__dict__.get("_replica_of") is not None:
            return
        for slot, (name, mask) in enumerate((("weight", self._buffers["weight_mask"]),
                                             ("bias", self._buffers["bias_mask"]))):
            tensor = getattr(self._replica_layer(), name, None)
            if cache[slot] is not None and mask is not None and tensor is not None:
                self._multiplier(slot, tensor, mask)

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        super()._load_from_state_dict(*args, **kwargs)
        self._refresh_multipliers()  # masks loaded in place

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

    _NO_MARK = object()

    def masked_mark(self) -> Any:
        """What records the layer as masked now (None when its tensors changed since they were last masked): a
        caller that swaps the layer's tensors for copies of them (the one-shot float64 pass) gives it back with
        :meth:`set_mark` when the layer's own tensors are back."""
        return None if self.is_stale() else self._seen

    def set_mark(self, mark: Any = _NO_MARK) -> None:
        """Record the layer's current tensors as masked (no argument: they are copies of masked tensors, so the
        forward need not mask them again), or put back a ``mark`` from :meth:`masked_mark`."""
        object.__setattr__(self, "_seen", self._versions() if mark is PrunerModuleWrapper._NO_MARK else mark)

    def is_stale(self) -> bool:
        """True if the weights or masks changed since the layer was last masked."""
        return self._versions() != self._seen

    def refresh(self) -> bool:
        """Re-mask if the weights or masks changed since the last masking; True if it did. Under torch.compile
        it does nothing (False): compiled code masks out of place, see :meth:`masked_weight`."""
        if torch.compiler.is_compiling():
            return False
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

    def masked_weight(self) -> torch.Tensor:
        """The layer's weight times its mask, computed out of place, with the gradient of the weight itself
        (what compiled forwards use; equal to ``weight`` whenever the layer is masked in place)."""
        return self._masked(0, effective_weight(self._replica_layer()), self._buffers["weight_mask"])

    def masked_bias(self) -> torch.Tensor | None:
        """The layer's bias times its bias mask, out of place (None without a bias)."""
        bias = getattr(self._replica_layer(), "bias", None)
        mask = self._buffers["bias_mask"]
        return bias if bias is None or mask is None else self._masked(1, bias, mask)

    def _masked(self, slot: int, tensor: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        live = self.__dict__.get("_mul_live")  # (absent in wrappers pickled by older versions)
        mul = None if live is None else live[slot]
        if mul is not None and self._caches_multiplier(tensor) and mul.dtype == tensor.dtype:
            return tensor + (tensor * mul - tensor).detach()  # exact: w + 0 or w - w
        return _masked(tensor, mask)

    def _layer_prefix(self) -> str:
        """Path from ``self.module`` to the layer's tensors (``module.`` per nested wrapper)."""
        layer, prefix, module = self._replica_layer(), "", self.module
        while module is not layer:
            prefix, module = prefix + "module.", module.module
        return prefix

    def _compiled_forward(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        if isinstance(self.module, WeightSlot):
            return self.masked_weight()  # a slot's output is its (effective) weight
        prefix = self._layer_prefix()
        params = {prefix + "weight": self.masked_weight()}
        if self._buffers["bias_mask"] is not None:  # (the version-based "never written" shortcut is eager-only)
            params[prefix + "bias"] = self.masked_bias()
        return torch.func.functional_call(self.module, params, args, kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return self._compiled_forward(args, kwargs)
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
                           ("_mul_cache", [None, None]), ("_mul_live", [None, None])):
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
        object.__setattr__(self, "_mul_live", [None, None])
        if pristine:
            self._mark_bias_pristine()
        return out

    def extra_repr(self) -> str:
        return f"name={self.name!r}, type={self.type!r}"
