"""Backend-neutral layer matching: which config entry applies to which layer.

Backends describe their layers as :class:`LayerInfo` (name = module path / Keras layer path, type =
class name) and call :func:`match_layers`. Rules (design doc, pinned by tests):

* an entry matches a layer when the layer's type is in ``op_types`` (``'default'`` = the backend's
  weighted layer types; the other backend's names are accepted, ``Conv2d`` ~ ``Conv2D``) AND, if given,
  its name is in ``op_names``;
* for each layer the LAST matching entry wins; if that entry has ``exclude: True`` the layer is skipped;
* op_names / op_types that match no layer at all give a :class:`ConfigWarning` naming them;
* ``'default'`` says what it leaves out: one :class:`DefaultSkipWarning` naming the weighted layer types
  it skipped (Embedding, recurrent, attention, custom layers) and their share of the model's parameters.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError, ConfigWarning
from .layouts import MULTI_WEIGHT_TYPES, is_norm_type


class DefaultSkipWarning(ConfigWarning):
    """``op_types: ['default']`` left weighted layers of other types uncompressed (filter it to silence)."""

# Groups of names that denote the same kind of layer on PyTorch and Keras. A name matches every
# name of its group. Generic Keras names (BatchNormalization) cover all PyTorch ranks; a rank-specific
# PyTorch name matches the generic Keras one but not another rank.
_ALIAS_GROUPS: list[tuple[str, ...]] = [
    ("Conv1d", "Conv1D"),
    ("Conv2d", "Conv2D"),
    ("Conv3d", "Conv3D"),
    ("ConvTranspose1d", "Conv1DTranspose"),
    ("ConvTranspose2d", "Conv2DTranspose"),
    ("ConvTranspose3d", "Conv3DTranspose"),
    ("Linear", "Dense"),
    ("Embedding",),
    ("LayerNorm", "LayerNormalization"),
    ("GroupNorm", "GroupNormalization"),
    ("LSTM",),
    ("GRU",),
    ("RNN", "SimpleRNN"),
    ("LSTMCell",),
    ("GRUCell",),
    ("RNNCell", "SimpleRNNCell"),
    ("MultiheadAttention", "MultiHeadAttention"),
    ("PReLU",),
]
_GENERIC = {"BatchNormalization": ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm")}


def _build_aliases() -> dict[str, frozenset[str]]:
    table: dict[str, set[str]] = {}
    for group in _ALIAS_GROUPS:
        for name in group:
            table.setdefault(name, set()).update(group)
    for generic, specific in _GENERIC.items():
        table.setdefault(generic, {generic}).update(specific)
        for s in specific:
            table.setdefault(s, {s}).add(generic)
    return {k: frozenset(v) for k, v in table.items()}


TYPE_ALIASES: dict[str, frozenset[str]] = _build_aliases()


def type_names(name: str) -> frozenset[str]:
    """All layer type names that ``name`` in a config stands for."""
    return TYPE_ALIASES.get(name, frozenset({name}))


@dataclass(frozen=True)
class LayerInfo:
    """A layer as core sees it: its name (module path) and its type name (class name). ``bases``: names of
    framework layer classes the layer's class subclasses without changing their computation (HF
    EfficientNet's ``EfficientNetDepthwiseConv2d`` is a ``Conv2d``): ``op_types`` (``'default'`` included)
    match them too."""

    name: str
    type: str
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    bases: tuple[str, ...] = field(default=(), compare=False, hash=False, repr=False)

    def is_one_of(self, names: frozenset[str] | set[str]) -> bool:
        """The layer's type or one of its ``bases`` is in ``names``."""
        return self.type in names or any(b in names for b in self.bases)


def expand_op_types(op_types: Iterable[str], default_types: Iterable[str]) -> frozenset[str]:
    names: set[str] = set()
    for t in op_types:
        if t == "default":
            for d in default_types:
                names |= type_names(d)
        else:
            names |= type_names(t)
    return frozenset(names)


def entry_matches(entry: dict[str, Any], layer: LayerInfo, default_types: Iterable[str]) -> bool:
    if "op_types" in entry and not layer.is_one_of(expand_op_types(entry["op_types"], default_types)):
        return False
    if "op_names" in entry and layer.name not in entry["op_names"]:
        return False
    return True


def match_layers(
    layers: Sequence[LayerInfo],
    config_list: Sequence[dict[str, Any]],
    default_types: Iterable[str],
    *,
    require_match: bool = True,
    what: str = "compressor",
    skip_hint: str | None = None,
) -> list[tuple[LayerInfo, dict[str, Any]]]:
    """Return ``(layer, config)`` for every layer to compress, in the model's layer order.

    ``config_list`` must be normalised (:func:`~compressor.core.config.normalize_config_list`).
    With ``require_match`` a config that selects no layer at all is a :class:`ConfigError` listing the
    model's layer types, so nothing is wrapped silently.
    """
    default_types = tuple(default_types)
    selected: list[tuple[LayerInfo, dict[str, Any]]] = []
    for layer in layers:
        chosen = None
        for entry in config_list:
            if entry_matches(entry, layer, default_types):
                chosen = entry
        if chosen is not None and not chosen.get("exclude", False):
            selected.append((layer, chosen))

    names = {layer.name for layer in layers}
    types = {t for layer in layers for t in (layer.type, *layer.bases)}
    for i, entry in enumerate(config_list):
        missing = [n for n in entry.get("op_names", ()) if n not in names]
        if missing:
            warnings.warn(f"config_list[{i}]: op_names {missing} match no layer of the model", ConfigWarning, stacklevel=3)
        if "op_types" in entry:
            unused = [t for t in entry["op_types"]
                      if not (expand_op_types([t], default_types) & types)]
            if unused:
                warnings.warn(f"config_list[{i}]: op_types {unused} match no layer of the model", ConfigWarning,
                              stacklevel=3)

    default_skip_warning(layers, selected, config_list, default_types, what, skip_hint)
    if require_match and not selected:
        present = sorted(types)
        raise ConfigError(
            f"{what}: config_list selects no layer of the model. Layer types in the model: {present}; "
            f"'default' means {list(default_types)}"
        )
    return selected


def _inside(name: str, outer: str) -> bool:
    """True if layer ``name`` is ``outer`` or nested in it (torch paths use '.', Keras paths '/')."""
    return outer == "" or name == outer or name.startswith(outer + ".") or name.startswith(outer + "/")


def _mentioned(entry: dict[str, Any], layer: LayerInfo) -> bool:
    """The entry names ``layer`` itself (op_names, or op_types other than 'default')."""
    if layer.name in entry.get("op_names", ()):
        return True
    return layer.is_one_of(expand_op_types([t for t in entry.get("op_types", ()) if t != "default"], ()))


def default_skip_warning(layers: Sequence[LayerInfo], selected: Sequence[tuple[LayerInfo, dict[str, Any]]],
                         config_list: Sequence[dict[str, Any]], default_types: Iterable[str],
                         what: str = "compressor", hint: str | None = None) -> None:
    """Warn once when ``'default'`` leaves weighted layers of other types uncompressed.

    Backends describe each layer's own parameters in ``LayerInfo.extra``: ``params`` (count) and
    ``weighted`` (it has a weight a compressor could take). A weighted layer inside a recurrent or
    attention layer (a Keras cell or EinsumDense, torch's ``out_proj``) counts as that outer layer's type,
    the one to put in ``op_types``. Layers the user named (op_names, or their type in op_types) and
    normalisation layers are not reported. ``hint``: what the compressor tells the user to do instead of
    the default advice (add the types to op_types), e.g. for compressors that take Linear layers only.
    """
    if not any("default" in e.get("op_types", ()) and not e.get("exclude", False) for e in config_list):
        return
    if not any("params" in layer.extra for layer in layers):
        return
    defaults = expand_op_types(["default"], default_types)
    chosen = [info.name for info, _ in selected]
    total = sum(int(layer.extra.get("params", 0)) for layer in layers)
    owners = [layer for layer in layers if layer.type in MULTI_WEIGHT_TYPES]
    skipped: dict[str, dict[str, Any]] = {}
    for layer in layers:
        n = int(layer.extra.get("params", 0))
        if n <= 0 or not layer.extra.get("weighted", False) or any(_inside(layer.name, c) for c in chosen):
            continue
        outer = [o for o in owners if _inside(layer.name, o.name)]
        owner = min(outer, key=lambda o: len(o.name)) if outer else layer  # the outermost one
        if owner.is_one_of(defaults) or is_norm_type(owner.type):
            continue
        if any(_mentioned(e, owner) or _mentioned(e, layer) for e in config_list):
            continue
        entry = skipped.setdefault(owner.type, {"layers": set(), "params": 0})
        entry["layers"].add(owner.name)
        entry["params"] += n
    if not skipped or total <= 0:
        return
    parts = []
    for t, e in sorted(skipped.items(), key=lambda kv: -kv[1]["params"]):
        k = len(e["layers"])
        parts.append(f"{t} ({k} layer{'s' if k != 1 else ''}, {e['params'] / total:.1%} of the parameters)")
    warnings.warn(
        f"{what}: op_types ['default'] ({', '.join(default_types)}) leaves out weighted layers of type "
        f"{', '.join(parts)}; " + (hint or f"to compress them too, add {sorted(skipped)} to op_types (Embedding, "
                                            f"recurrent and attention layers are supported)"),
        DefaultSkipWarning, stacklevel=4)
