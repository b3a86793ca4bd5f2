"""Names of the built-in algorithms every backend provides (one list, so backends stay in step)."""

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
