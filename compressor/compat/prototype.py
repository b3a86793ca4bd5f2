"""The seed-004 prototype API, framework-free part shared by ``torchCompressor`` and ``tfCompressor``.

The prototype builds a compressor from a configure list alone and instruments a model when called::

    pruner = torchCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])
    pruner(model)          # instruments the model in place and returns it

:class:`PrototypeCompressor` translates that onto the modern classes (``compressor.torch`` /
``compressor.tf``): built-in names map to the modern algorithm of the same name (``AGPruner`` ->
``AGPPruner``, ``QATquantizer`` -> ``QAT_Quantizer``); a designer's subclass that overrides
``calc_mask(layer_info, weight)`` / ``quantize_weight(layer_info, weight)`` runs inside a modern adapter
class the backend shim supplies. No algorithm lives here.

Clocks: the prototype has no optimizer hook; the user calls ``step()`` and ``update_epoch(epoch)``.
Whatever a subclass puts in those methods runs first, then the modern compressor is advanced and a
designer's ``calc_mask`` is evaluated again (masks are computed at instrumentation and after each of
these calls, never per forward).

State lives in ``self.__dict__`` with defaults, so a subclass whose ``__init__`` does not call
``super().__init__`` (as seed 004 shows) works: the model arrives at ``__call__(model)``.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ..core.algorithms import resolve_algorithm_name
from ..core.config import load_configs, normalize_config_list
from ..core.errors import ConfigError

__all__ = ["BUILTIN_PROTOTYPES", "Configure", "PrototypeCompressor", "PrototypePruner", "PrototypeQuantizer",
           "PrunerAdapterMixin", "QuantizerAdapterMixin", "define_builtins"]

Configure = list[dict[str, Any]]


def _clocked(fn: Callable[..., Any], clock: str) -> Callable[..., Any]:
    """Wrap ``step`` / ``update_epoch`` so that, after the outermost call returns, the modern compressor
    is advanced too (once, even when subclasses chain through ``super()``)."""
    if getattr(fn, "_prototype_clock", None):
        return fn

    @functools.wraps(fn)
    def run(self: PrototypeCompressor, *args: Any, **kwargs: Any) -> Any:
        depth = self.__dict__.get("_clock_depth", 0)
        self.__dict__["_clock_depth"] = depth + 1
        try:
            out = fn(self, *args, **kwargs)
        finally:
            self.__dict__["_clock_depth"] = depth
        if depth == 0:
            self._advance(clock, *args, **kwargs)
        return out

    run._prototype_clock = clock  # type: ignore[attr-defined]
    return run


class PrototypeCompressor:
    """Base of the seed-004 classes. Backend shims set ``_backend``, ``_namespace`` and ``_adapter`` (and
    may override the ``_modern_step`` / ``_configure_modern`` hooks); :class:`PrototypePruner` /
    :class:`PrototypeQuantizer` set ``_kind`` and ``_method``; built-in names set ``_modern``."""

    #: 'torch' or 'tf' (set by the backend shim)
    _backend: str = ""
    #: the modern backend package whose classes built-in names resolve to (set by the backend shim)
    _namespace: Any = None
    #: 'pruner' or 'quantizer'
    _kind: str = ""
    #: the designer's method (``calc_mask`` / ``quantize_weight``) and the class whose stub it overrides
    _method: str = ""
    _base: type | None = None
    #: the modern class that runs a designer's method (set by the backend shim)
    _adapter: type = object
    #: modern algorithm name for built-in classes; None for designers' subclasses
    _modern: str | None = None
    #: prototype-only key names -> modern names, per class (e.g. SensitivityPruner's 'sparsity')
    _legacy_renames: Mapping[str, str] = {}
    #: keys filled in when an entry lacks them (quantizers: the prototype quantized weights only)
    _legacy_defaults: Mapping[str, Any] = {}
    #: a designer's extra config keys (names from ``core.config.OPTIONAL_KEYS`` or ``key_spec`` objects)
    config_keys: tuple[Any, ...] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for clock in ("step", "update_epoch"):
            if clock in cls.__dict__:
                setattr(cls, clock, _clocked(cls.__dict__[clock], clock))

    def __init__(self, configure: Configure | str | os.PathLike | None = None) -> None:
        """``configure``: a configure list, or the path of a YAML file (see :meth:`load_configure`)."""
        if isinstance(configure, (str, os.PathLike)):
            self.load_configure(configure)
        elif configure is not None:
            self._set_configure(configure)

    # ------------------------------------------------------------------ configure
    def _translate(self, configure: Any) -> Any:
        """The configure list with this class's prototype-only keys renamed and defaults filled in."""
        if not isinstance(configure, (list, tuple)) or not (self._legacy_renames or self._legacy_defaults):
            return configure
        out = []
        for entry in configure:
            if isinstance(entry, Mapping):
                entry = dict(entry)
                for old, new in self._legacy_renames.items():
                    if old in entry and new not in entry:
                        entry[new] = entry.pop(old)
                for key, value in self._legacy_defaults.items():
                    entry.setdefault(key, copy.deepcopy(value))
            out.append(entry)
        return out

    def _set_configure(self, configure: Any) -> None:
        translated = self._translate(configure)
        self._normalise(translated)  # refuse a bad configure now, not when the model arrives
        self.__dict__["_configure"] = translated

    def _normalise(self, configure: Any) -> Configure:
        modern = self._modern_class()
        cls = modern if modern is not None else self._adapter_class()
        keys = getattr(cls, "config_keys", ()) if modern is not None else tuple(self.config_keys)
        required = getattr(cls, "required_keys", ())
        with _quiet_legacy_keys():
            return normalize_config_list(configure, extra_keys=keys, required=required, what=type(self).__name__)

    def load_configure(self, config_path: str | os.PathLike) -> Configure:
        """Read the configure list from a YAML file: a bare list, or sections ``Name: {config: [...]}``
        (seed 004: ``tfAGPruner:``). The section named after this class is used (with or without a
        ``tf``/``torch`` prefix, prototype or modern name); a file with one section needs no name."""
        sections = load_configs(config_path)
        if None in sections:
            configure = sections[None]
        else:
            configure = self._pick_section(sections, os.fspath(config_path))
        self._set_configure(configure)
        return self.__dict__["_configure"]

    def _pick_section(self, sections: dict[str | None, Any], path: str) -> Any:
        own = {type(self).__name__, resolve_algorithm_name(type(self).__name__)[1]}
        if self._modern:
            own.add(self._modern)
        ranked = []
        for name in sections:
            backend, modern = resolve_algorithm_name(str(name))
            if name in own or modern in own:
                ranked.append((0 if backend in (None, self._backend) else 1, name))
        if ranked:
            return sections[min(ranked)[1]]
        if len(sections) == 1:
            return next(iter(sections.values()))
        raise ConfigError(f"{type(self).__name__}.load_configure: {path!r} has no section for "
                          f"{type(self).__name__}; sections: {sorted(map(str, sections))}")

    @property
    def configure_list(self) -> Configure | None:
        """The configure list given to ``__init__`` / :meth:`load_configure` (None if none yet)."""
        return self.__dict__.get("_configure")

    # ------------------------------------------------------------------ instrumentation
    def preprocess_model(self, model: Any) -> None:
        """Called with the model before it is instrumented; override to prepare it."""

    def __call__(self, model: Any) -> Any:
        """Instrument ``model`` in place (masks / quantized weights from now on) and return it."""
        if self.__dict__.get("_compressor") is not None:
            raise ConfigError(f"{type(self).__name__} has already instrumented a model; create a new "
                              f"{type(self).__name__} for another model")
        configure = self.__dict__.get("_configure")
        if configure is None:
            if self._modern_class() is not None:
                raise ConfigError(f"{type(self).__name__} needs a configure list: "
                                  f"{type(self).__name__}([{{...}}]) or .load_configure('config.yaml')")
            configure = self._translate([{"op_types": ["default"]}])  # a designer's class: every weighted layer
        self._normalise(configure)
        self.preprocess_model(model)
        with _quiet_legacy_keys():
            compressor = self._build(model, copy.deepcopy(configure))
        self.__dict__["_compressor"] = compressor
        compressor.compress()
        return model

    @property
    def compressor(self) -> Any:
        """The modern compressor doing the work (after ``__call__``), e.g. for ``export_model``."""
        return self.__dict__.get("_compressor")

    def __getattr__(self, name: str) -> Any:
        # modern features (export_model, report, get_modules_wrapper, ...) through the prototype object
        if not name.startswith("_"):
            compressor = self.__dict__.get("_compressor")
            if compressor is not None:
                return getattr(compressor, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ clocks
    def step(self) -> None:
        """Call after each training step (e.g. after ``optimizer.step()``)."""

    def update_epoch(self, epoch: int) -> None:
        """Call at the start of each epoch."""

    def _advance(self, clock: str, *args: Any, **kwargs: Any) -> None:
        compressor = self.__dict__.get("_compressor")
        if compressor is None:
            return
        if clock == "step":
            self._modern_step(compressor)
        else:  # the prototype's TF flavour also passed a session: only the epoch goes on
            epoch = args[0] if args else kwargs.get("epoch")
            if epoch is not None:
                compressor.update_epoch(int(epoch))
        refresh = getattr(compressor, "refresh", None)
        if refresh is not None:  # a designer's calc_mask sees the new state
            refresh()

    # ------------------------------------------------------------------ backend hooks
    def _modern_class(self) -> type | None:
        """The modern class of a built-in name, or None when a designer's method must be adapted."""
        if getattr(type(self), self._method) is not getattr(self._base, self._method):
            return None  # the designer's method runs through the adapter
        if self._modern is None:
            raise NotImplementedError(f"{type(self).__name__} must implement {self._method}(self, layer_info, weight)")
        return getattr(self._namespace, self._modern)

    def _adapter_class(self) -> type:
        """The modern class that runs a designer's ``calc_mask`` / ``quantize_weight``; it is built as
        ``adapter(model, configure, prototype)`` and has ``refresh()`` (re-evaluate the designer's masks)."""
        return self._adapter

    def _build(self, model: Any, configure: Configure) -> Any:
        """The modern compressor instrumenting ``model`` (not yet compressed)."""
        modern = self._modern_class()
        if modern is None:
            return self._adapter_class()(model, configure, self)
        compressor = modern(model, configure)
        self._configure_modern(compressor)
        return compressor

    def _modern_step(self, compressor: Any) -> None:
        """Backend hook: tell the modern compressor that one training step (optimizer update) happened."""
        compressor.step()

    def _configure_modern(self, compressor: Any) -> None:
        """Backend hook: adjust a freshly built modern compressor before ``compress()``."""


for _clock in ("step", "update_epoch"):
    setattr(PrototypeCompressor, _clock, _clocked(getattr(PrototypeCompressor, _clock), _clock))


class PrototypePruner(PrototypeCompressor):
    """Prototype pruner base: implement ``calc_mask(self, layer_info, weight)`` returning the mask."""

    _kind = "pruner"
    _method = "calc_mask"

    def calc_mask(self, layer_info: Any, weight: Any) -> Any:
        """The mask of ``weight`` (same shape, in the backend's layout; True/1 keeps a weight). Called when
        the model is instrumented and after every ``step()`` / ``update_epoch()``."""
        raise NotImplementedError(f"{type(self).__name__} must implement calc_mask(self, layer_info, weight)")


class PrototypeQuantizer(PrototypeCompressor):
    """Prototype quantizer base: implement ``quantize_weight(self, layer_info, weight)`` returning the new
    weight. Configure entries quantize weights by default (``quant_types: ['weight']``)."""

    _kind = "quantizer"
    _method = "quantize_weight"
    _legacy_renames = {"q_bits": "quant_bits"}
    _legacy_defaults = {"quant_types": ["weight"]}

    def quantize_weight(self, layer_info: Any, weight: Any) -> Any:
        """The quantized ``weight`` (in the backend's layout); called in every forward of the layer."""
        raise NotImplementedError(f"{type(self).__name__} must implement quantize_weight(self, layer_info, weight)")


PrototypePruner._base = PrototypePruner
PrototypeQuantizer._base = PrototypeQuantizer


class _AdapterMixin:
    """What a backend's adapter (a modern compressor running a designer's prototype method) keeps."""

    def _adopt(self, prototype: PrototypeCompressor) -> None:
        self.prototype = prototype
        self.config_keys = tuple(prototype.config_keys)


class PrunerAdapterMixin(_AdapterMixin):
    """Mixed into the backend's pruner adapter: the modern clocks alone never evaluate a designer's
    ``calc_mask``; it runs only inside :meth:`_designer_due` (``refresh()``, a newly built layer)."""

    _due = False

    @contextlib.contextmanager
    def _designer_due(self) -> Iterator[None]:
        self._due = True
        try:
            yield
        finally:
            self._due = False


class QuantizerAdapterMixin(_AdapterMixin):
    """Mixed into the backend's quantizer adapter: a designer's ``quantize_weight`` quantizes weights only."""

    required_keys = ("quant_types",)
    supported_quant_types = ("weight",)


#: The seed-004 built-in names both shims define, in this order: prototype name -> (kind, modern name,
#: prototype-only key renames, docstring; ``{ns}`` is the modern namespace)
BUILTIN_PROTOTYPES: dict[str, tuple[str, str, dict[str, str], str]] = {
    "LevelPruner": ("pruner", "LevelPruner", {},
                    "Magnitude pruning to ``sparsity`` per layer (modern :class:`{ns}.LevelPruner`)."),
    "AGPruner": ("pruner", "AGPPruner", {},
                 "Automated gradual pruning; call ``update_epoch(epoch)`` each epoch (modern ``AGPPruner``)."),
    "SensitivityPruner": ("pruner", "SensitivityPruner", {"sparsity": "sensitivity"},
                          "Han et al. 2015: prune ``|w| < s * std(w)``. The prototype named ``s`` 'sparsity'; it is "
                          "passed on as\n    ``sensitivity`` (modern :class:`{ns}.SensitivityPruner`)."),
    "QATquantizer": ("quantizer", "QAT_Quantizer", {}, "Quantization-aware training (modern ``QAT_Quantizer``)."),
    "DoReFaQuantizer": ("quantizer", "DoReFaQuantizer", {},
                        "DoReFa weight quantization (modern :class:`{ns}.DoReFaQuantizer`)."),
}


def define_builtins(module: str, pruner_base: type, quantizer_base: type) -> tuple[type, ...]:
    """The classes of :data:`BUILTIN_PROTOTYPES` (in its order) for one shim: each subclasses the shim's
    ``pruner_base`` / ``quantizer_base`` and names its modern class; they present themselves as defined in
    ``module`` (the backend module's ``__name__``)."""
    ns = pruner_base._namespace.__name__
    classes = []
    for name, (kind, modern, renames, doc) in BUILTIN_PROTOTYPES.items():
        attrs: dict[str, Any] = {"__module__": module, "__qualname__": name, "__doc__": doc.format(ns=ns),
                                 "_modern": modern}
        if renames:
            attrs["_legacy_renames"] = renames
        classes.append(type(name, (pruner_base if kind == "pruner" else quantizer_base,), attrs))
    return tuple(classes)


class _quiet_legacy_keys(warnings.catch_warnings):
    """The prototype's own key names (support_type, support_op, prune) are not deprecated here."""

    def __enter__(self) -> Any:
        out = super().__enter__()
        warnings.filterwarnings("ignore", message=r"config_list\[\d+\]: legacy key", category=DeprecationWarning)
        return out
