"""Recipes of the streaming one-shot command (``compressor oneshot SRC OUT --recipe RECIPE.yaml``).

A recipe is a YAML list of stages, each a one-key mapping from a one-shot algorithm's name (as
``compressor list`` prints it) to its config_list; the stages run in order on every block::

    - SparseGPTPruner: [{sparse_pattern: '2:4', op_types: [Linear]}]
    - GptqQuantizer: [{quant_types: [weight], quant_bits: 4, group_size: 128, op_types: [Linear]},
                      {op_names: [lm_head], exclude: true}]

:func:`load_recipe` reads and validates every stage before the checkpoint is touched, with the checks the
algorithm's class runs on its config (the key checks of :func:`~compressor.core.config.normalize_config_list`
with the class's ``config_keys`` / ``required_keys``, then the one-shot checks of core: N:M patterns for the
pruners, the weight grid for the quantizers), so no model is needed. :func:`recipe_hash` names a recipe, so a
resumed run can tell whether it was started with the same one.
"""

from __future__ import annotations

import copy
import difflib
import hashlib
import json
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, ConfigWarning

__all__ = ["ONESHOT_ALGORITHMS", "RecipeStage", "build_compressors", "load_recipe", "recipe_hash"]

#: the algorithms a streamed recipe may name, and their kind: the one-shot methods, which compress a block from
#: its calibration statistics alone (no training loop, no whole-model pass)
ONESHOT_ALGORITHMS: dict[str, str] = {
    "WandaPruner": "pruner",
    "SparseGPTPruner": "pruner",
    "GptqQuantizer": "quantizer",
    "RtnQuantizer": "quantizer",
    "AwqQuantizer": "quantizer",
}

#: what every structural error shows
RECIPE_EXAMPLE = (
    "a recipe is a YAML list of stages, each a one-key mapping from an algorithm name to its config_list, e.g.\n"
    "- SparseGPTPruner: [{sparse_pattern: '2:4', op_types: [Linear]}]\n"
    "- GptqQuantizer: [{quant_bits: 4, group_size: 128, op_types: [Linear]}, {op_names: [lm_head], exclude: true}]"
)


@dataclass(frozen=True)
class RecipeStage:
    """One stage of a recipe: the algorithm's ``name`` and ``cls`` (the backend's class), the user's
    ``config_list`` (a deep copy, as written) and its ``normalized`` form (what the class builds from:
    canonical keys, ``quant_bits`` per quant type, N:M patterns' sparsity filled in)."""

    name: str
    cls: type
    config_list: list[dict[str, Any]]
    normalized: list[dict[str, Any]]


def _read(source: Any, what: str) -> tuple[Any, str]:
    """The parsed recipe and the label its errors start with (``what`` plus the file name, if any)."""
    import yaml

    if isinstance(source, (list, tuple)):
        return list(source), what
    if isinstance(source, os.PathLike) or (isinstance(source, str) and "\n" not in source and (
            os.path.isfile(source) or source.strip().endswith((".yaml", ".yml")))):
        path = os.fspath(source)
        label = f"{what} {path!r}"
        if not os.path.isfile(path):
            raise ConfigError(f"{label}: no such file")
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{label}: cannot be read as UTF-8 text ({e})") from None
    elif isinstance(source, str):
        text, label = source, what
    else:
        raise ConfigError(f"{what}: expected a YAML file path, a YAML string or a list of stages, got "
                          f"{type(source).__name__}; {RECIPE_EXAMPLE}")
    try:
        return yaml.safe_load(text), label
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"{label}: not valid YAML: {where}{problem}; {RECIPE_EXAMPLE}") from None


def _structure(data: Any, label: str) -> list[tuple[str, Any]]:
    """``[(name, config_list)]`` of a parsed recipe; a ConfigError with the example when it is not a list of
    one-key mappings to lists."""
    if data is None or (isinstance(data, (list, tuple)) and not data):
        raise ConfigError(f"{label}: no stages; {RECIPE_EXAMPLE}")
    if not isinstance(data, (list, tuple)):
        raise ConfigError(f"{label}: expected a list of stages, got {type(data).__name__}; {RECIPE_EXAMPLE}")
    out = []
    for i, stage in enumerate(data):
        if not isinstance(stage, Mapping):
            raise ConfigError(f"{label}: stage {i} is a {type(stage).__name__} ({stage!r:.60}), not a one-key "
                              f"mapping 'AlgorithmName: [config entries]'; {RECIPE_EXAMPLE}")
        if len(stage) != 1:
            raise ConfigError(f"{label}: stage {i} has {len(stage)} keys {[str(k) for k in stage]}; each stage "
                              f"is a mapping with exactly one key, the algorithm name (one stage per "
                              f"algorithm); {RECIPE_EXAMPLE}")
        (name, config_list), = stage.items()
        if not isinstance(name, str):
            raise ConfigError(f"{label}: stage {i}: the key {name!r} is not an algorithm name; {RECIPE_EXAMPLE}")
        if not isinstance(config_list, (list, tuple)):
            raise ConfigError(f"{label}: stage {i} ({name}): the config_list must be a list of dicts, got "
                              f"{type(config_list).__name__}; {RECIPE_EXAMPLE}")
        out.append((name, config_list))
    return out


def _check_name(i: int, name: str, backend: str, label: str) -> None:
    """Refuse a name that is not a one-shot algorithm (a known one or a typo: with a did-you-mean hint)."""
    from .registry import registry

    if name in ONESHOT_ALGORITHMS:
        return
    allowed = list(ONESHOT_ALGORITHMS)
    if registry().has(backend, name):
        raise ConfigError(f"{label}: stage {i} ({name}): {name} is not a one-shot algorithm and cannot be "
                          f"streamed; a recipe takes: {', '.join(allowed)}")
    # the same hint as the registry and the config keys (difflib, cutoff 0.6), case-insensitive
    lowered = {n.lower(): n for n in allowed}
    close = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    hint = f" (did you mean {lowered[close[0]]!r}?)" if close else ""
    raise ConfigError(f"{label}: stage {i}: no one-shot algorithm {name!r}{hint}; a recipe takes: "
                      f"{', '.join(allowed)}")


def _normalize(name: str, cls: type, config_list: Sequence[Any]) -> list[dict[str, Any]]:
    """The stage's config_list checked as ``cls`` checks it, without a model (see the module docstring)."""
    from .config import normalize_config_list
    from .oneshot import quant_spec_of, weight_only_config
    from .pruning import nm_validate_config

    quantizer = ONESHOT_ALGORITHMS[name] == "quantizer"
    entries = weight_only_config(list(config_list)) if quantizer else list(config_list)
    out = normalize_config_list(entries, extra_keys=getattr(cls, "config_keys", ()),
                                required=getattr(cls, "required_keys", ()), what=name)
    if not quantizer:
        nm_validate_config(out, name)
        return out
    for j, c in enumerate(out):
        if c["exclude"]:
            continue
        if c.get("quant_types") != ["weight"]:
            raise ConfigError(f"config_list[{j}]: {name} quantizes weights only: quant_types must be ['weight'] "
                              f"(or left out), got {c.get('quant_types')}")
        try:
            quant_spec_of(c, name)
        except ConfigError as e:  # its message starts with the name, which the stage's label already gives
            raise ConfigError(f"config_list[{j}]: {str(e).removeprefix(name + ': ')}") from None
    return out


def load_recipe(source: str | os.PathLike[str] | Sequence[Any], backend: str,
                what: str = "recipe") -> list[RecipeStage]:
    """The stages of a recipe (a YAML file's path, a YAML string or an already-parsed list), each checked and
    resolved to ``backend``'s class (``registry().get``, which imports the backend) before anything is read.

    Raises ConfigError naming the stage (index and algorithm), what is wrong and what is allowed;
    ``what`` starts every message (e.g. ``'--recipe'``), followed by the file name when ``source`` is a file.
    """
    from .registry import registry

    reg = registry()
    if backend not in reg.backends:
        raise ConfigError(f"{what}: unknown backend {backend!r}; one of {sorted(reg.backends)}")
    data, label = _read(source, what)
    if isinstance(source, str) and isinstance(data, str):
        raise ConfigError(f"{what}: {source!r} is neither an existing file nor a YAML list of stages; "
                          f"{RECIPE_EXAMPLE}")
    stages = _structure(data, label)
    for i, (name, _) in enumerate(stages):
        _check_name(i, name, backend, label)
    out = []
    for i, (name, config_list) in enumerate(stages):
        cls = reg.get(backend, name)
        try:
            normalized = _normalize(name, cls, config_list)
        except ConfigError as e:
            raise ConfigError(f"{label}: stage {i} ({name}): {e}") from None
        out.append(RecipeStage(name, cls, copy.deepcopy(list(config_list)), normalized))
    return out


def _canonical(value: Any) -> Any:
    """``value`` as JSON-able data with sorted keys (tuples as lists); other objects are refused, so the hash
    never depends on a ``repr``."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise ConfigError(f"recipe value {value!r} ({type(value).__name__}) is not a YAML scalar, list or mapping")


def recipe_hash(stages: Sequence[RecipeStage]) -> str:
    """The sha256 (hex) of the canonical JSON of ``[(name, config_list), ...]``: the same for the same stages
    whatever the key order and across runs and machines, so a resumed run can tell whether its recipe changed.
    It hashes the entries as the user wrote them (``quant_bits: 4`` and ``{weight: 4}`` differ)."""
    payload = [[s.name, _canonical(s.config_list)] for s in stages]
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def build_compressors(stages: Sequence[RecipeStage], model: Any, layer_names: Callable[[], list[str]],
                      source: str = "checkpoint", hint: Callable[[str], str] = lambda message: "",
                      echo: bool = True) -> list[Any]:
    """The recipe's compressors on ``model``, stage by stage. A config entry that matches no layer is only a warning
    in memory; a streamed run refuses it (it would cost a whole run to notice): a ConfigError naming the stage, the
    message, ``hint(message)`` and a few of the model's layer names (``layer_names()``: e.g. its Linear layers;
    ``source``: what the model was read from). Other warnings are passed on (``echo``; off in all but one process of
    a run over several)."""
    out = []
    for i, stage in enumerate(stages):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", ConfigWarning)
            out.append(stage.cls(model, stage.config_list))
        for w in caught:
            if issubclass(w.category, ConfigWarning) and "match no layer" in str(w.message):
                raise ConfigError(f"--recipe: stage {i} ({stage.name}): {w.message}{hint(str(w.message))}; the "
                                  f"{source}'s layers are named like {layer_names()[:3]}")
            if echo:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    return out
