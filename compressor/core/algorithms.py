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
)
QUANTIZERS = ("NaiveQuantizer", "QAT_Quantizer", "DoReFaQuantizer", "BNNQuantizer", "LsqQuantizer")


def register_builtins(registry, backend: str, module: str, implemented=None) -> None:
    """Register the built-in algorithms of ``backend`` lazily as ``module:Name``.

    ``implemented`` limits the names while a backend is being built up.
    """
    for kind, names in (("pruner", PRUNERS), ("quantizer", QUANTIZERS)):
        for n in names:
            if implemented is None or n in implemented:
                registry.register(backend, n, f"{module}:{n}", kind=kind)
