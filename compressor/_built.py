"""Which built-in algorithms each backend implements so far (the registry advertises only these).

One line per owner so parallel work does not collide; becomes "all of core.algorithms" when complete.
"""

TORCH_PRUNERS: set[str] = {"WandaPruner", "SparseGPTPruner", "LevelPruner", "AGPPruner", "SensitivityPruner", "SlimPruner", "L1FilterPruner", "L2FilterPruner", "FPGMPruner", "ActivationAPoZRankFilterPruner", "ActivationMeanRankFilterPruner", "TaylorFOWeightFilterPruner", "LotteryTicketPruner"}
TORCH_QUANTIZERS: set[str] = {"GptqQuantizer", "RtnQuantizer", "AwqQuantizer", "NaiveQuantizer", "QAT_Quantizer", "DoReFaQuantizer", "BNNQuantizer", "LsqQuantizer", "PtqQuantizer"}
TF_PRUNERS: set[str] = {"WandaPruner", "SparseGPTPruner", "LevelPruner", "AGPPruner", "SensitivityPruner", "SlimPruner", "L1FilterPruner", "L2FilterPruner", "FPGMPruner", "ActivationAPoZRankFilterPruner", "ActivationMeanRankFilterPruner", "TaylorFOWeightFilterPruner", "LotteryTicketPruner"}
TF_QUANTIZERS: set[str] = {"GptqQuantizer", "RtnQuantizer", "AwqQuantizer", "NaiveQuantizer", "QAT_Quantizer", "DoReFaQuantizer", "BNNQuantizer", "LsqQuantizer", "PtqQuantizer"}

BUILT: dict[str, set[str] | None] = {"torch": TORCH_PRUNERS | TORCH_QUANTIZERS, "tf": TF_PRUNERS | TF_QUANTIZERS}
