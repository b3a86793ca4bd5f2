"""PyTorch pruning: the seeds' Pruner / WeightMasker / PrunerModuleWrapper framework and the pruners."""

from .activation import (
    ActivationAPoZRankFilterPruner,
    ActivationAPoZRankFilterPrunerMasker,
    ActivationMeanRankFilterPruner,
    ActivationMeanRankFilterPrunerMasker,
)
from .agp import AGPPruner
from .export import apply_compression_results, unwrapped_model, unwrapped_state_dict
from .filters import (
    FPGMPruner,
    FPGMPrunerMasker,
    L1FilterPruner,
    L1FilterPrunerMasker,
    L2FilterPruner,
    L2FilterPrunerMasker,
)
from .level import LevelPruner, LevelPrunerMasker
from .lottery import LotteryTicketPruner
from .masker import WeightMasker
from .oneshot import SparseGPTPruner, WandaPruner
from .pruner import OneShotPruner, Pruner, TorchPruner
from .report import SparsityReport
from .sensitivity import SensitivityPruner
from .slim import SlimPruner, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPruner, TaylorFOWeightFilterPrunerMasker
from .wrapper import PrunerModuleWrapper

__all__ = [
    "AGPPruner", "ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker",
    "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker", "FPGMPruner", "FPGMPrunerMasker",
    "L1FilterPruner", "L1FilterPrunerMasker", "L2FilterPruner", "L2FilterPrunerMasker", "LevelPruner",
    "LevelPrunerMasker", "LotteryTicketPruner", "OneShotPruner", "Pruner", "PrunerModuleWrapper",
    "SensitivityPruner", "SlimPruner", "SlimPrunerMasker", "SparsityReport", "TaylorFOWeightFilterPruner",
    "TaylorFOWeightFilterPrunerMasker", "TorchPruner", "WeightMasker", "apply_compression_results",
    "unwrapped_model", "unwrapped_state_dict", "WandaPruner", "SparseGPTPruner",
]
