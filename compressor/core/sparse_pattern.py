"""N:M semi-structured sparsity patterns (``sparse_pattern: '2:4'``): parsing and the config rule.

Below both :mod:`compressor.core.config` (which validates the key) and :mod:`compressor.core.pruning`
(which builds the masks); imports only the errors module.
"""

from __future__ import annotations

from typing import Any

from .errors import ConfigError

__all__ = ["SPARSE_PATTERN_ALLOWED", "parse_sparse_pattern", "nm_sparsity", "resolve_sparse_pattern"]

SPARSE_PATTERN_ALLOWED = ("a string 'N:M' with integers 1 <= N < M, e.g. '2:4' (keep the N largest |w| of every M "
                          "consecutive weights along the layer's input axis)")


def parse_sparse_pattern(pattern: Any) -> tuple[int, int]:
    """``(n, m)`` of an ``'N:M'`` pattern string (keep N of every M); ValueError unless ``1 <= N < M``."""
    if not isinstance(pattern, str):
        raise ValueError(f"sparse_pattern must be a string 'N:M' (e.g. '2:4'), got {pattern!r}")
    parts = pattern.strip().split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"sparse_pattern must look like 'N:M' with integers (e.g. '2:4'), got {pattern!r}")
    n, m = (int(p) for p in parts)
    if not 1 <= n < m:
        raise ValueError(f"sparse_pattern {pattern!r}: need 1 <= N < M, got N={n}, M={m}")
    return n, m


def nm_sparsity(n: int, m: int) -> float:
    """The sparsity of an N:M pattern, ``(m - n) / m``."""
    return (m - n) / m


def resolve_sparse_pattern(config_list: list[dict[str, Any]], sparsity_key: str, what: str) -> None:
    """For entries with ``sparse_pattern``: fill in ``sparsity_key`` (``'sparsity'`` / ``'final_sparsity'``)
    as the pattern's ``(M - N) / M``, or refuse a different value given with it (in place, on normalised
    entries). The input dimension of each layer is checked when layers are matched."""
    for i, c in enumerate(config_list):
        if c.get("exclude") or "sparse_pattern" not in c:
            continue
        target = nm_sparsity(*parse_sparse_pattern(c["sparse_pattern"]))
        for key in dict.fromkeys((sparsity_key, "sparsity")):
            if key in c and abs(c[key] - target) > 1e-9:
                raise ConfigError(
                    f"config_list[{i}]: {key!r} = {c[key]} contradicts 'sparse_pattern' = {c['sparse_pattern']!r}, "
                    f"which prunes {target:g}; give the pattern alone (or {key}: {target:g})")
        c[sparsity_key] = target
