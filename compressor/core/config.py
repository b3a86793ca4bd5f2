"""Parse, normalise and validate a ``config_list``.

A config_list is a list of dicts; each dict selects layers (``op_types`` / ``op_names``) and says how to
compress them. :func:`normalize_config_list` checks every entry before any model is touched and returns
fresh dicts in one canonical form:

* legacy keys of the seed-004 prototype are mapped (``support_type`` -> ``op_types``, ``support_op`` ->
  ``op_names``, ``prune: False`` -> ``exclude: True``) with a DeprecationWarning;
* ``exclude`` is always present (bool);
* ``quant_bits`` is always a dict ``{quant_type: bits}`` covering ``quant_types``.

Errors are :class:`ConfigError` naming the entry index, the key, the bad value and what is allowed.
Algorithms add keys of their own through :class:`KeySpec` (see ``Compressor.config_keys``).
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError
from .sparse_pattern import (  # noqa: F401  (re-exported: config is where users look for them)
    SPARSE_PATTERN_ALLOWED,
    parse_sparse_pattern,
    resolve_sparse_pattern,
)

QUANT_TYPES = ("weight", "input", "output")
QUANT_DTYPES = ("int", "uint")
QUANT_SCHEMES = ("per_tensor_affine", "per_tensor_symmetric", "per_channel_affine", "per_channel_symmetric")


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


@dataclass(frozen=True)
class KeySpec:
    """How one config key is checked. ``check`` returns the normalised value or raises ValueError(allowed)."""

    name: str
    check: Callable[[Any], Any]
    allowed: str


def _fraction(lo_inclusive: float, hi_exclusive: float) -> Callable[[Any], Any]:
    def check(v: Any) -> float:
        if not _is_number(v) or not math.isfinite(v) or not (lo_inclusive <= v < hi_exclusive):
            raise ValueError
        return float(v)

    return check


def _int_at_least(lo: int) -> Callable[[Any], Any]:
    def check(v: Any) -> int:
        if not _is_int(v) or v < lo:
            raise ValueError
        return int(v)

    return check


def _positive_number(v: Any) -> float:
    if not _is_number(v) or not math.isfinite(v) or v <= 0:
        raise ValueError
    return float(v)


def _str_list(v: Any) -> list[str]:
    if not isinstance(v, (list, tuple)) or not v or not all(isinstance(s, str) and s for s in v):
        raise ValueError
    return list(v)


def _bool(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError
    return v


def _quant_types(v: Any) -> list[str]:
    if isinstance(v, str):
        raise ValueError
    items = _str_list(v)
    if any(t not in QUANT_TYPES for t in items) or len(set(items)) != len(items):
        raise ValueError
    return items


def _bits(v: Any) -> int:
    if not _is_int(v) or not 1 <= v <= 32:
        raise ValueError
    return int(v)


def _quant_bits(v: Any) -> int | dict[str, int]:
    if isinstance(v, Mapping):
        if not v:
            raise ValueError
        out = {}
        for k, b in v.items():
            if k not in QUANT_TYPES:
                raise ValueError
            out[k] = _bits(b)
        return out
    return _bits(v)


def _choice(options: Iterable[str]) -> Callable[[Any], Any]:
    opts = tuple(options)

    def check(v: Any) -> str:
        if v not in opts:
            raise ValueError
        return v

    return check


def _quant_choice_or_dict(options: Iterable[str]) -> Callable[[Any], Any]:
    base = _choice(options)

    def check(v: Any) -> Any:
        if isinstance(v, Mapping):
            if not v or any(k not in QUANT_TYPES for k in v):
                raise ValueError
            return {k: base(x) for k, x in v.items()}
        return base(v)

    return check


_SPECS = [
    KeySpec("sparsity", _fraction(0.0, 1.0), "a number with 0 <= sparsity < 1"),
    KeySpec("op_types", _str_list, "a non-empty list of layer type names, e.g. ['Conv2d', 'Linear'] or ['default']"),
    KeySpec("op_names", _str_list, "a non-empty list of layer names, e.g. ['conv1', 'features.3']"),
    KeySpec("exclude", _bool, "True (skip the matched layers) or False"),
    KeySpec("quant_types", _quant_types, f"a list drawn from {list(QUANT_TYPES)}, without repeats"),
    KeySpec("quant_bits", _quant_bits, "an int in 1..32, or a dict {quant_type: int in 1..32}"),
    KeySpec("quant_start_step", _int_at_least(0), "an int >= 0"),
    KeySpec("initial_sparsity", _fraction(0.0, 1.0), "a number with 0 <= initial_sparsity < 1"),
    KeySpec("final_sparsity", _fraction(0.0, 1.0), "a number with 0 <= final_sparsity < 1"),
    KeySpec("start_epoch", _int_at_least(0), "an int >= 0"),
    KeySpec("end_epoch", _int_at_least(0), "an int >= 0"),
    KeySpec("frequency", _int_at_least(1), "an int > 0"),
]
#: Keys every compressor understands.
COMMON_KEYS: dict[str, KeySpec] = {s.name: s for s in _SPECS}

def _sparse_pattern(v: Any) -> str:
    n, m = parse_sparse_pattern(v)  # ValueError -> the key's 'allowed' message
    return f"{n}:{m}"


#: Keys that algorithms may opt into by listing them in ``config_keys``.
OPTIONAL_KEYS: dict[str, KeySpec] = {
    s.name: s
    for s in [
        KeySpec("quant_dtype", _quant_choice_or_dict(QUANT_DTYPES), f"one of {list(QUANT_DTYPES)} or a dict per quant type"),
        KeySpec("quant_scheme", _quant_choice_or_dict(QUANT_SCHEMES), f"one of {list(QUANT_SCHEMES)} or a dict per quant type"),
        KeySpec("sensitivity", _positive_number, "a number > 0 (threshold = sensitivity * std of the layer's weights)"),
        KeySpec("sparse_pattern", _sparse_pattern, SPARSE_PATTERN_ALLOWED),
    ]
}

#: seed-004 prototype key -> modern key
LEGACY_KEYS = {"support_type": "op_types", "support_layer": "op_types", "support_op": "op_names", "prune": "exclude"}


def key_spec(name: str, check: Callable[[Any], Any], allowed: str) -> KeySpec:
    """Declare an algorithm-specific config key (used in ``Compressor.config_keys``)."""
    return KeySpec(name, check, allowed)


def _fmt(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _err(index: int | None, key: str | None, value: Any, allowed: str) -> ConfigError:
    where = "config_list" if index is None else f"config_list[{index}]"
    if key is None:
        return ConfigError(f"{where}: {allowed}, got {_fmt(value)}")
    return ConfigError(f"{where}: {key!r} = {_fmt(value)} is invalid; allowed: {allowed}")


def _legacy(index: int, entry: dict) -> dict:
    """Map seed-004 keys onto the modern ones, warning once per entry."""
    used = [k for k in entry if k in LEGACY_KEYS]
    if not used:
        return entry
    out = {k: v for k, v in entry.items() if k not in LEGACY_KEYS}
    for old in used:
        new, value = LEGACY_KEYS[old], entry[old]
        if old == "prune":
            if not isinstance(value, bool):
                raise _err(index, old, value, "True or False (prune: False excludes the layers)")
            value = not value
        elif old in ("support_type", "support_layer") and isinstance(value, str):
            value = [value]
        elif old == "support_op" and isinstance(value, str):
            value = [value]
        if new in out and out[new] != value:
            raise _err(index, old, entry[old], f"only one of {old!r} and {new!r} (they mean the same)")
        out[new] = value
    warnings.warn(
        f"config_list[{index}]: legacy key(s) {used} are deprecated; use "
        + ", ".join(f"{k!r} -> {LEGACY_KEYS[k]!r}" for k in used),
        DeprecationWarning,
        stacklevel=4,
    )
    return out


def normalize_config_list(
    config_list: Any,
    *,
    extra_keys: Iterable[str | KeySpec] = (),
    required: Iterable[str] = (),
    what: str = "compressor",
) -> list[dict[str, Any]]:
    """Validate ``config_list`` and return normalised copies of its entries.

    ``extra_keys`` names keys of :data:`OPTIONAL_KEYS` or gives new :class:`KeySpec` objects;
    ``required`` keys must be present in every entry that is not ``exclude: True``.
    The input is never modified.
    """
    specs = dict(COMMON_KEYS)
    for k in extra_keys:
        if isinstance(k, KeySpec):
            specs[k.name] = k
        elif k in OPTIONAL_KEYS:
            specs[k] = OPTIONAL_KEYS[k]
        else:
            raise TypeError(f"unknown config key declaration {k!r}")
    required = tuple(required)

    if isinstance(config_list, Mapping):
        raise _err(None, None, type(config_list).__name__,
                   "config_list must be a list of dicts (wrap a single dict in a list)")
    if not isinstance(config_list, (list, tuple)) or not config_list:
        raise _err(None, None, config_list, "config_list must be a non-empty list of dicts")

    result = []
    for i, raw in enumerate(config_list):
        if not isinstance(raw, Mapping):
            raise _err(i, None, raw, "each entry must be a dict")
        for k in raw:
            if not isinstance(k, str):
                raise _err(i, None, k, "keys must be strings")
        entry = _legacy(i, dict(raw))
        out: dict[str, Any] = {}
        for k, v in entry.items():
            spec = specs.get(k)
            if spec is None:
                known = sorted(set(specs) | set(LEGACY_KEYS))
                close = difflib.get_close_matches(k, known, n=1, cutoff=0.6)
                hint = f" (did you mean {close[0]!r}?)" if close else ""
                raise ConfigError(
                    f"config_list[{i}]: unknown key {k!r}{hint}; {what} accepts: {', '.join(sorted(specs))}"
                )
            try:
                out[k] = spec.check(copy.deepcopy(v))
            except ValueError:
                raise _err(i, k, v, spec.allowed) from None
        out.setdefault("exclude", False)
        if "op_types" not in out and "op_names" not in out:
            raise ConfigError(
                f"config_list[{i}]: names no layers; give 'op_types' (e.g. ['default'], ['Conv2d']) "
                f"and/or 'op_names' (e.g. ['conv1'])"
            )
        _check_cross(i, out, required, what)
        result.append(out)
    return result


def _check_cross(i: int, out: dict[str, Any], required: tuple[str, ...], what: str) -> None:
    if not out["exclude"]:
        missing = [k for k in required if k not in out]
        if missing:
            raise ConfigError(f"config_list[{i}]: {what} needs key(s) {missing} in every non-excluded entry")
    if "initial_sparsity" in out and "final_sparsity" in out and out["initial_sparsity"] > out["final_sparsity"]:
        raise _err(i, "initial_sparsity", out["initial_sparsity"],
                   f"a value <= final_sparsity ({out['final_sparsity']})")
    bits = out.get("quant_bits")
    qtypes = out.get("quant_types")
    if bits is not None:
        if isinstance(bits, dict):
            if qtypes is None:
                out["quant_types"] = qtypes = list(bits)
            extra = [t for t in bits if t not in qtypes]
            if extra:
                raise _err(i, "quant_bits", bits, f"keys among quant_types {qtypes} (extra: {extra})")
            missing = [t for t in qtypes if t not in bits]
            if missing:
                raise _err(i, "quant_bits", bits, f"a bit width for every quant type in {qtypes} (missing: {missing})")
        else:
            if qtypes is None:
                raise ConfigError(f"config_list[{i}]: 'quant_bits' = {bits} needs 'quant_types' (e.g. ['weight'])")
            out["quant_bits"] = {t: bits for t in qtypes}
    elif qtypes is not None and not out["exclude"] and "quant_bits" in required:
        raise ConfigError(f"config_list[{i}]: 'quant_types' = {qtypes} needs 'quant_bits' (e.g. 8 or {{'weight': 8}})")
    for key in ("quant_dtype", "quant_scheme"):
        v = out.get(key)
        if isinstance(v, dict) and qtypes is not None:
            extra = [t for t in v if t not in qtypes]
            if extra:
                raise _err(i, key, v, f"keys among quant_types {qtypes}")


def load_configs(path: str | os.PathLike) -> dict[str | None, list[dict[str, Any]]]:
    """Read a YAML config file (``yaml.safe_load``).

    A bare list is returned as ``{None: list}``; seed 004's format (``AlgoName: {config: [...]}``, or
    ``AlgoName: [...]``) as ``{AlgoName: list}``. Entries are returned raw: validate them with
    :func:`normalize_config_list` (the compressors do this themselves).
    """
    import yaml

    p = os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(f"config file {p!r} does not exist")
    try:
        with open(p, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p!r} is not valid YAML: {e}") from None
    if isinstance(data, list):
        return {None: data}
    if isinstance(data, Mapping) and data:
        out: dict[str | None, list[dict[str, Any]]] = {}
        for name, body in data.items():
            if isinstance(body, Mapping):
                unknown = [k for k in body if k != "config"]
                if "config" not in body or unknown:
                    raise ConfigError(
                        f"config file {p!r}: section {name!r} must hold only 'config: [...]' (found keys {list(body)})"
                    )
                body = body["config"]
            if not isinstance(body, list):
                raise ConfigError(f"config file {p!r}: section {name!r} must be a list of dicts, got {type(body).__name__}")
            out[str(name)] = body
        return out
    raise ConfigError(
        f"config file {p!r} must hold a list of dicts or a mapping 'AlgorithmName: {{config: [...]}}', "
        f"got {type(data).__name__}"
    )


def load_config(path: str | os.PathLike, algorithm: str | None = None) -> list[dict[str, Any]]:
    """Return the config list of ``path``; with several algorithm sections, ``algorithm`` picks one."""
    sections = load_configs(path)
    if None in sections:
        return sections[None]
    if algorithm is not None:
        if algorithm in sections:
            return sections[algorithm]
        raise ConfigError(f"config file {os.fspath(path)!r} has no section {algorithm!r}; sections: {sorted(sections)}")
    if len(sections) == 1:
        return next(iter(sections.values()))
    raise ConfigError(
        f"config file {os.fspath(path)!r} has several sections {sorted(sections)}; pass algorithm=NAME to pick one"
    )
