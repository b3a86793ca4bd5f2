"""Tied (shared) parameters under a compressor: one weight used by several modules.

Hugging Face language models tie the LM head to the token embedding (``lm_head.weight`` IS
``transformer.wte.weight``). Compressing the weight through one of its users changes it for all of them,
so a compressor decides per tie, before the model changes:

* **every user selected** (e.g. ``op_names: ['transformer.wte', 'lm_head']``): the weight is compressed
  once, consistently, with one config (users whose config entries differ are a ``ConfigError``). A pruner
  wraps the first user in model order; the others read the same Parameter, which is masked in place. A
  quantizer wraps every user, each quantizing the same weight with the same config into the same values
  (a quantizer that learns per-layer parameters, e.g. LSQ's step size, is refused: the users would drift
  apart). Exports then hold the same compressed values under every key of the tie.
* **some users not selected**: compressing would silently change a layer the config does not select (the
  classic case: ``'default'`` selects ``lm_head`` -- a Linear -- but excludes embeddings). A layer selected
  by its type is left out with a ``ConfigWarning`` naming the tie; a layer named in ``op_names`` is a
  ``ConfigError`` (name every user, or untie the weights first, e.g. ``config.tie_word_embeddings=False``).

Every tie the compressor compressed is listed in ``compressor.tied_weights`` (``{weight key: [keys of
the same Parameter]}``) and reported with a ``ConfigWarning``.
"""

from __future__ import annotations

import warnings
from typing import Any

from torch import nn

from ..core.errors import ConfigError, ConfigWarning
from ..core.matching import LayerInfo

__all__ = ["resolve_ties", "check_tie_wrappers"]


def _visible(path: str, hidden: list[str]) -> str:
    """The layer name core sees for a module path (the inside of a wrapper is the wrapper)."""
    for p in hidden:  # longest first
        if path == p or path.startswith(p + "."):
            return p
    return path


def parameter_users(model: nn.Module, hidden: list[str]) -> dict[int, list[tuple[str, str]]]:
    """``id(parameter) -> [(layer name, parameter name)]`` for every parameter owned directly by a module
    (a module shared under two paths counts once)."""
    users: dict[int, list[tuple[str, str]]] = {}
    for path, module in model.named_modules():
        layer = _visible(path, hidden)
        for pname, p in module._parameters.items():
            if p is None:
                continue
            entry = (layer, pname)
            lst = users.setdefault(id(p), [])
            if entry not in lst:
                lst.append(entry)
    return users


def _key(layer: str, pname: str) -> str:
    return f"{layer}.{pname}" if layer else pname


def resolve_ties(model: nn.Module, selected: list[tuple[LayerInfo, dict[str, Any]]], modules: dict[str, nn.Module],
                 kind: str, what: str) -> tuple[list[tuple[LayerInfo, dict[str, Any]]], dict[str, list[str]]]:
    """Apply the rules of this module to ``selected``; returns the layers to wrap and the ties compressed."""
    from .modules import innermost_module, is_wrapper

    hidden = sorted((n for n, m in model.named_modules() if n and is_wrapper(m)), key=len, reverse=True)
    users = parameter_users(model, hidden)
    config_of = {info.name: cfg for info, cfg in selected}
    order = {name: i for i, name in enumerate(modules)}
    drop: set[str] = set()
    ties: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    for info, cfg in selected:
        if info.name in drop:
            continue
        layer = innermost_module(modules[info.name])
        for pname, p in layer._parameters.items():
            if p is None:
                continue
            group = users.get(id(p), [])
            layers = sorted({name for name, _ in group}, key=lambda n: order.get(n, len(order)))
            if len(layers) < 2:
                continue
            keys = [_key(n, pn) for n, pn in group]
            others = [n for n in layers if n != info.name]
            unselected = [n for n in others if n not in config_of]
            if unselected:
                if info.name in cfg.get("op_names", ()):
                    raise ConfigError(
                        f"{what}: layer {info.name!r} is selected by name, but its {pname} is tied to "
                        f"{[k for k in keys if not k.startswith(info.name + '.')]} (one Parameter: {keys}); "
                        f"compressing it would also change {unselected}, which the config does not select. "
                        f"Select every user of the weight (op_names {layers}) to compress it once for all, "
                        f"or untie the weights (e.g. a Hugging Face model's config.tie_word_embeddings=False)")
                skipped[info.name] = (f"{info.name!r}: its {pname} is the same Parameter as "
                                      f"{[k for k in keys if not k.startswith(info.name + '.')]}, used by "
                                      f"{unselected} which the config does not select")
                drop.add(info.name)
                break
            differing = [n for n in others if config_of[n] is not cfg and config_of[n] != cfg]
            if differing:
                raise ConfigError(
                    f"{what}: the tied weight {keys} (one Parameter) is compressed once for all its users "
                    f"{layers}, but {info.name!r} and {differing} get different config entries; give them "
                    f"the same entry")
            ties.setdefault(keys[0], keys)
            if kind == "pruner":  # the first user masks the shared Parameter in place for all
                drop.update(n for n in layers if n != layers[0])
    if skipped:
        warnings.warn(
            f"{what}: tied weights: {'; '.join(skipped.values())}. These layers are left uncompressed, so the "
            f"shared weight stays intact ('default' excludes embeddings). To compress such a weight, select "
            f"every layer that uses it (op_names), or untie it first", ConfigWarning, stacklevel=4)
    if ties:
        warnings.warn(f"{what}: tied weights compressed once for all their users: "
                      f"{'; '.join(str(v) for v in ties.values())}", ConfigWarning, stacklevel=4)
    return [(info, cfg) for info, cfg in selected if info.name not in drop], ties


def check_tie_wrappers(wrappers: list[nn.Module], ties: dict[str, list[str]], what: str) -> None:
    """A quantizer that learns parameters per wrapper cannot keep the users of a tied weight identical."""
    if not ties:
        return
    tied_layers = {k.rsplit(".", 1)[0] if "." in k else "" for keys in ties.values() for k in keys}
    learned = [w.name for w in wrappers if getattr(w, "name", None) in tied_layers
               and any(p is not None for p in w._parameters.values())]
    if learned:
        raise ConfigError(f"{what} learns parameters per layer ({learned}), so the users of a tied weight "
                          f"{list(ties.values())} would be quantized differently; untie the weights or leave "
                          f"these layers out")
