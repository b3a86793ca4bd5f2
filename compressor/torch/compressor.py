"""``Compressor``: the shared base of ``TorchPruner`` and ``TorchQuantizer``.

Construction validates everything first and mutates the model last, so on any error the user's model
is exactly as before:

1. the model must be an ``nn.Module`` (else :class:`ModelError`), the optimizer ``None`` or a torch
   optimizer, and ``config_list`` is normalised by :func:`normalize_config_list`;
2. layers are selected with :func:`match_layers` (last matching entry wins);
3. :meth:`Compressor.validate_config` / :meth:`Compressor.validate_layer` let an algorithm refuse a selected layer (``ConfigError``);
4. one wrapper per layer is built by :meth:`Compressor._create_wrapper`, then the wrappers replace the
   modules in their parents (the only mutation), then the optimizer is hooked (see ``hooks.py``).

Layers with several weight matrices (``nn.LSTM``/``GRU``/``RNN`` and cells, ``nn.MultiheadAttention``) are
compressed one matrix at a time: each becomes one layer per matrix (``lstm.weight_hh_l0``), wrapped like
a Linear, inside a :class:`~compressor.torch.slots.SlottedLayer` that stands in the model for the layer.

Layers already wrapped by a compressor are seen under their own name and the type of the module they
wrap; a second compressor of the same kind may not wrap them again (``ConfigError``), one of the other
kind (a quantizer over a pruner) wraps the existing wrapper.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import torch_plugin
from ..core.config import KeySpec, normalize_config_list
from ..core.errors import ConfigError, ModelError
from ..core.interrupts import deferred_interrupts
from ..core.matching import LayerInfo, match_layers
from . import families, hooks
from .distributed import refuse_wrapped_model
from .modules import (  # noqa: F401  (re-exported)
    _WRAPPER_FLAG,
    innermost_module,
    is_wrapper,
    named_wrappers,
    torch_base_type,
)
from .ties import check_tie_wrappers, resolve_ties

__all__ = ["Compressor", "is_wrapper", "innermost_module"]

def _wrapper_owner(module: nn.Module) -> str:
    return getattr(module, "_compressor_owner_name", "a")


class Compressor:
    """Base of TorchPruner and TorchQuantizer.

    Subclasses declare ``config_keys`` (names from ``core.config.OPTIONAL_KEYS`` or ``KeySpec`` objects),
    ``required_keys`` (keys every non-excluded entry must have), optionally ``default_types`` (what
    ``op_types: ['default']`` means), and implement :meth:`_create_wrapper`.
    """

    config_keys: tuple[str | KeySpec, ...] = ()
    required_keys: tuple[str, ...] = ()
    default_types: tuple[str, ...] = torch_plugin.DEFAULT_TYPES
    #: the advice of the warning on what ``'default'`` leaves out (None: add those types to op_types)
    default_skip_hint: str | None = None
    #: wrappers of one kind are never nested in each other ('pruner', 'quantizer')
    _kind: str = "compressor"
    #: under torch.distributed, reduce per-rank data statistics over the ranks before masks / scales are
    #: derived from them (see :mod:`compressor.torch.distributed`); set False on an instance to opt out
    sync_ranks: bool = True

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None):
        what = type(self).__name__
        if not isinstance(model, nn.Module):
            raise ModelError(f"{what}: model must be a torch.nn.Module, got {type(model).__module__}.{type(model).__qualname__}")
        refuse_wrapped_model(model, what)
        hooks.check_optimizer(optimizer, what)
        self.config_list: list[dict[str, Any]] = normalize_config_list(
            config_list, extra_keys=self.config_keys, required=self.required_keys, what=what
        )
        self.validate_config(self.config_list)
        self.bound_model: nn.Module = model
        self.optimizer: torch.optim.Optimizer | None = optimizer

        layers, modules = self._enumerate_layers(model)
        selected = match_layers(layers, self.config_list, self.default_types, what=what, skip_hint=self.default_skip_hint)
        selected = self._substitute_layers(selected, layers, modules)
        selected, ties = resolve_ties(model, selected, modules, self._kind, what)
        from .slots import expand_slots  # recurrent / attention layers: one slot per weight matrix

        selected, slot_plan = expand_slots(what, selected, modules)
        for layer, config in selected:
            module = modules[layer.name]
            if layer.name == "":
                raise ConfigError(
                    f"{what}: the model itself ({type(model).__name__}) is selected; a compressor wraps layers "
                    f"inside a model, so put it in a container such as nn.Sequential"
                )
            if is_wrapper(module) and getattr(module, _WRAPPER_FLAG) == self._kind:
                raise ConfigError(
                    f"{what}: layer {layer.name!r} is already wrapped by {_wrapper_owner(module)} "
                    f"{self._kind}; call unhook() and _unwrap_model() on that {self._kind} (or export and reload "
                    f"the model) before compressing it again"
                )
            self._check_direct_reads(model, layer, module, what)
            self.validate_layer(layer, innermost_module(module), config)
        extra = self._extra_layers(model, selected, layers, modules)
        selected = self._filter_selected(selected) + extra

        wrappers = []
        for layer, config in selected:
            wrapper = self._create_wrapper(modules[layer.name], layer, config)
            if not isinstance(wrapper, nn.Module):
                raise TypeError(f"{what}._create_wrapper must return an nn.Module, got {type(wrapper).__name__}")
            wrappers.append(wrapper)
        check_tie_wrappers(wrappers, ties, what)
        slots = [slot_plan.places.get(layer.name) or self._parent_slots(model, modules[layer.name])
                 for layer, _ in selected]

        # ---- mutation starts here: nothing below may fail on user input ----
        self.modules_to_compress: list[tuple[LayerInfo, dict[str, Any]]] = selected
        #: tied weights compressed once for all their users: ``{weight key: [keys of the same Parameter]}``
        self.tied_weights: dict[str, list[str]] = ties
        self.modules_wrapper: list[nn.Module] = wrappers
        self._wrapper_names: list[str] = [layer.name for layer, _ in selected]
        self._collectors: dict[int, list[Any]] = {}
        self._collector_ids = itertools.count()
        self._slot_containers = slot_plan.containers
        # every module's children, recorded before the first change: an exception or Ctrl-C part way (or in a
        # family plug-in) puts the model's structure back as it was, with a second Ctrl-C held back meanwhile
        children = [(m, dict(m._modules)) for m in model.modules()]
        hooked = False
        try:
            slot_plan.install(model)
            for wrapper, places in zip(wrappers, slots):
                object.__setattr__(wrapper, _WRAPPER_FLAG, self._kind)
                object.__setattr__(wrapper, "_compressor_owner_name", what)
                for parent, attr in places:
                    setattr(parent, attr, wrapper)
            if optimizer is not None:
                hooks.install(optimizer, self)
                hooked = True
            families.on_compress(model)  # model-family plug-ins (e.g. Hugging Face save_pretrained)
        except BaseException:
            with deferred_interrupts():
                if hooked:
                    hooks.uninstall(optimizer, self)
                for m, kids in children:
                    m._modules.clear()
                    m._modules.update(kids)
            raise

    # ------------------------------------------------------------------ selection
    @staticmethod
    def _enumerate_layers(model: nn.Module) -> tuple[list[LayerInfo], dict[str, nn.Module]]:
        """Layers as core sees them; the inside of existing wrappers is hidden behind the wrapper."""
        layers: list[LayerInfo] = []
        modules: dict[str, nn.Module] = {}
        hidden: list[str] = []
        for name, module in model.named_modules():
            if any(name.startswith(p) for p in hidden):
                continue
            inner = innermost_module(module)
            if is_wrapper(module):
                hidden.append(name + "." if name else "")
            base = torch_base_type(inner)
            layers.append(LayerInfo(name, type(inner).__name__, _weight_facts(inner), (base,) if base else ()))
            modules[name] = module
        return layers, modules

    @staticmethod
    def _parent_slots(model: nn.Module, target: nn.Module) -> list[tuple[nn.Module, str]]:
        """Every ``(parent, attribute)`` holding ``target`` (a shared module is replaced everywhere)."""
        return [(parent, attr) for parent in model.modules()
                for attr, child in parent._modules.items() if child is target]

    def _check_direct_reads(self, model: nn.Module, layer: LayerInfo, module: nn.Module, what: str) -> None:
        """Hook for subclasses: refuse (ConfigError) a selected layer whose parent reads its weights directly
        instead of calling it, when the wrapper acts in its forward (quantizers). The default accepts it
        (pruners mask weights in place, so direct reads see the masked weights)."""

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        """Hook for subclasses: cross-entry checks on the normalised config (raise ConfigError)."""

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        """Hook for subclasses: raise ConfigError if ``module`` cannot be compressed with ``config``."""

    def _substitute_layers(self, selected: list[tuple[LayerInfo, dict[str, Any]]], layers: list[LayerInfo],
                           modules: dict[str, nn.Module]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Hook for subclasses: the layers actually wrapped for the config's selection (e.g. a pruner
        selecting attention modules wraps their value projections). Called before anything is
        validated or changed; may raise ConfigError."""
        return selected

    def _extra_layers(self, model: nn.Module, selected: list[tuple[LayerInfo, dict[str, Any]]],
                      layers: list[LayerInfo], modules: dict[str, nn.Module]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Hook for subclasses: layers to wrap besides the config's (e.g. the norms a dependency-aware
        pruner masks with their convs). Called before anything is changed; may raise ConfigError."""
        return []

    def _filter_selected(self, selected: list[tuple[LayerInfo, dict[str, Any]]]) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """Hook for subclasses: the validated selection without the layers that will not be wrapped after all
        (e.g. those a dependency-aware pruner finds speedup could never shrink). Called after
        :meth:`_extra_layers`, before anything is changed."""
        return selected

    def _create_wrapper(self, module: nn.Module, layer_info: LayerInfo, config: dict[str, Any]) -> nn.Module:
        """Build (without touching the model) the wrapper that will replace ``module``."""
        raise NotImplementedError(f"{type(self).__name__} must implement _create_wrapper()")

    # ------------------------------------------------------------------ accessors
    def get_modules_to_compress(self) -> list[tuple[LayerInfo, dict[str, Any]]]:
        """``(LayerInfo, config)`` of every wrapped layer, in model order."""
        return list(self.modules_to_compress)

    def get_modules_wrapper(self) -> list[nn.Module]:
        """The wrappers, in model order."""
        return list(self.modules_wrapper)

    def set_wrappers_attribute(self, name: str, value: Any) -> None:
        """Give every wrapper an attribute ``name``: tensors become (cloned, persistent) buffers on the
        wrapper's device, so they are saved and moved with the model; other values are deep-copied per
        wrapper."""
        for wrapper in self.modules_wrapper:
            if torch.is_tensor(value):
                device = _module_device(wrapper)
                v = value.detach().clone()
                if device is not None:
                    v = v.to(device)
                if name in wrapper._buffers:
                    wrapper._buffers[name] = v
                else:
                    wrapper.register_buffer(name, v)
            else:
                setattr(wrapper, name, copy.deepcopy(value))

    def add_activation_collector(self, fn: Callable[[nn.Module, tuple, Any], Any]) -> int:
        """Call ``fn(wrapper, input, output)`` after every forward of every wrapper; returns an id."""
        cid = next(self._collector_ids)
        self._collectors[cid] = [w.register_forward_hook(fn) for w in self.modules_wrapper]
        return cid

    def remove_activation_collector(self, collector_id: int) -> None:
        """Remove a collector added by :meth:`add_activation_collector` (unknown id: ValueError)."""
        handles = self._collectors.pop(collector_id, None)
        if handles is None:
            raise ValueError(f"no activation collector with id {collector_id!r}; known: {sorted(self._collectors)}")
        for h in handles:
            h.remove()

    # ------------------------------------------------------------------ clocks
    def update_epoch(self, epoch: int) -> None:
        """Called by the user at the start of each epoch; the default does nothing."""

    def step(self) -> None:
        """Called by the optimizer hook after every ``optimizer.step()``; the default does nothing."""

    def compress(self) -> nn.Module:
        """Prepare the compression (subclasses compute initial masks etc.) and return the model."""
        return self.bound_model

    # ------------------------------------------------------------------ optimizer hook
    def hook_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Run :meth:`step` after ``optimizer.step()`` (e.g. a fine-tuning optimizer made after compress());
        the previously hooked optimizer, if different, is released. Idempotent."""
        hooks.check_optimizer(optimizer, type(self).__name__)
        if self.optimizer is not None and self.optimizer is not optimizer:
            hooks.uninstall(self.optimizer, self)
        self.optimizer = optimizer
        hooks.install(optimizer, self)

    def unhook(self) -> None:
        """Remove this compressor's hook from its optimizer (the optimizer behaves as before)."""
        hooks.uninstall(self.optimizer, self)

    def _unwrap_model(self) -> nn.Module:
        """Put the original modules back into the model (the wrappers' state stays with the wrappers)."""
        from .slots import unwrap_containers

        for wrapper in self.modules_wrapper:
            for parent, attr in self._parent_slots(self.bound_model, wrapper):
                setattr(parent, attr, wrapper.module)
        unwrap_containers(self.bound_model)
        return self.bound_model

    def _wrap_model(self) -> nn.Module:
        """Undo :meth:`_unwrap_model`."""
        from .slots import rewrap_containers

        rewrap_containers(self.bound_model, getattr(self, "_slot_containers", []))
        for wrapper in self.modules_wrapper:
            for parent, attr in self._parent_slots(self.bound_model, wrapper.module):
                if parent is not wrapper:
                    setattr(parent, attr, wrapper)
        return self.bound_model

    def state_dict(self) -> dict[str, Any]:
        """The compressor's own position (schedule clocks); tensors live in the model's state_dict."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""


def _weight_facts(module: nn.Module) -> dict[str, Any]:
    """``LayerInfo.extra`` of a layer: its own parameter count and whether it has a weight a compressor
    can take (for the note on what ``op_types: ['default']`` leaves out)."""
    from .slots import slot_specs

    params = sum(p.numel() for p in module.parameters(recurse=False))
    weighted = isinstance(getattr(module, "weight", None), torch.Tensor) or slot_specs(module) is not None
    return {"params": params, "weighted": weighted}


def _module_device(module: nn.Module) -> torch.device | None:
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return None
