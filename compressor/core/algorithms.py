"""Names of the built-in algorithms every backend provides (one list, so backends stay in step)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

PRUNERS = (
    "LevelPruner",
    "AGPPruner",
    "SensitivityPruner",
    "SlimPruner",
    "L1FilterPruner",
    "L2FilterPruner",
    "FPGMPruner",
    "ActivationAPoZRankFilterPruner",
    "ActivationMeanRankFilterPruner",
    "TaylorFOWeightFilterPruner",
    "LotteryTicketPruner",
    "WandaPruner",
    "SparseGPTPruner",
)
QUANTIZERS = ("NaiveQuantizer", "QAT_Quantizer", "DoReFaQuantizer", "BNNQuantizer", "LsqQuantizer", "PtqQuantizer",
              "GptqQuantizer", "RtnQuantizer", "AwqQuantizer")


#: The public names both backends' ``pruning`` packages export, by the submodule that defines them (in
#: import order). Each backend's ``pruning/__init__.py`` resolves it with :func:`export_table`, adding the
#: names only it has.
PRUNING_EXPORTS: dict[str, tuple[str, ...]] = {
    "activation": ("ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker",
                   "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker"),
    "agp": ("AGPPruner",),
    "export": ("apply_compression_results",),
    "filters": ("FPGMPruner", "FPGMPrunerMasker", "L1FilterPruner", "L1FilterPrunerMasker", "L2FilterPruner",
                "L2FilterPrunerMasker"),
    "level": ("LevelPruner", "LevelPrunerMasker"),
    "lottery": ("LotteryTicketPruner",),
    "masker": ("WeightMasker",),
    "oneshot": ("SparseGPTPruner", "WandaPruner"),
    "pruner": ("OneShotPruner", "Pruner"),
    "sensitivity": ("SensitivityPruner",),
    "slim": ("SlimPruner", "SlimPrunerMasker"),
    "taylor": ("TaylorFOWeightFilterPruner", "TaylorFOWeightFilterPrunerMasker"),
    "wrapper": ("PrunerModuleWrapper",),
}


def export_table(package: str, table: Mapping[str, tuple[str, ...]], namespace: dict[str, Any],
                 extra: Mapping[str, tuple[str, ...]] | None = None) -> list[str]:
    """Import ``package.<module>`` for each module of ``table`` (then of ``extra``: a backend's own names,
    per module) and bind the names listed for it in ``namespace``. Returns the names, sorted (``__all__``).
    A name a module lacks is an ``ImportError`` naming both."""
    names: list[str] = []
    merged: dict[str, list[str]] = {m: list(ns) for m, ns in table.items()}
    for module, extra_names in (extra or {}).items():
        merged.setdefault(module, []).extend(extra_names)
    for module, module_names in merged.items():
        mod = importlib.import_module(f"{package}.{module}")
        for name in module_names:
            if not hasattr(mod, name):
                raise ImportError(f"{package}.{module} does not define {name!r} (listed in the export table)")
            namespace[name] = getattr(mod, name)
            names.append(name)
    return sorted(names)


def register_builtins(registry, backend: str, module: str, implemented=None) -> None:
    """Register the built-in algorithms of ``backend`` lazily as ``module:Name``.

    ``implemented`` limits the names while a backend is being built up.
    """
    for kind, names in (("pruner", PRUNERS), ("quantizer", QUANTIZERS)):
        for n in names:
            if implemented is None or n in implemented:
                registry.register(backend, n, f"{module}:{n}", kind=kind)


#: Seed-004 prototype names whose modern name differs (the other prototype names are unchanged).
LEGACY_NAMES = {"AGPruner": "AGPPruner", "QATquantizer": "QAT_Quantizer"}
#: Prefixes that seed-004 YAML section names carry to name a backend (``tfAGPruner``).
LEGACY_BACKEND_PREFIXES = {"torch": "torch", "tf": "tf"}


def resolve_algorithm_name(name: str) -> tuple[str | None, str]:
    """Split a seed-004 class or YAML section name into ``(backend or None, modern algorithm name)``.

    ``'tfAGPruner' -> ('tf', 'AGPPruner')``, ``'QATquantizer' -> (None, 'QAT_Quantizer')``,
    ``'LevelPruner' -> (None, 'LevelPruner')``. A prefix counts only when an upper-case letter follows
    it, so names that merely start with ``tf`` are kept whole. Unknown names come back unchanged.
    """
    backend = None
    for prefix, b in LEGACY_BACKEND_PREFIXES.items():
        rest = name[len(prefix):]
        if name.startswith(prefix) and rest[:1].isupper():
            backend, name = b, rest
            break
    return backend, LEGACY_NAMES.get(name, name)
