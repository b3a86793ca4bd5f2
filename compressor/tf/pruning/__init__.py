"""TF / Keras 3 pruning: the ``TfPruner`` base, ``WeightMasker`` and every built-in pruner of the seeds.

Also re-exports the shared TF framework (``Compressor``, ``LayerWrapper``, the optimizer hook and the
``CompressionCallback`` / ``PruningCallback`` for ``model.fit``).
"""

from ..compressor import Compressor, LayerWrapper, strip_model
from ..hooks import CompressionCallback, PruningCallback
from .activation import (
    ActivationAPoZRankFilterPruner,
    ActivationAPoZRankFilterPrunerMasker,
    ActivationMeanRankFilterPruner,
    ActivationMeanRankFilterPrunerMasker,
)
from .agp import AGPPruner
from .export import apply_compression_results, load_masks
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
from .pruner import OneShotPruner, Pruner, TfPruner
from .sensitivity import SensitivityPruner
from .slim import SlimPruner, SlimPrunerMasker
from .taylor import TaylorFOWeightFilterPruner, TaylorFOWeightFilterPrunerMasker
from .wrapper import PrunerLayerWrapper, PrunerModuleWrapper

__all__ = [
    "AGPPruner", "ActivationAPoZRankFilterPruner", "ActivationAPoZRankFilterPrunerMasker",
    "ActivationMeanRankFilterPruner", "ActivationMeanRankFilterPrunerMasker", "CompressionCallback", "Compressor",
    "FPGMPruner", "FPGMPrunerMasker", "L1FilterPruner", "L1FilterPrunerMasker", "L2FilterPruner",
    "L2FilterPrunerMasker", "LayerWrapper", "LevelPruner", "LevelPrunerMasker", "LotteryTicketPruner",
    "OneShotPruner", "Pruner", "PrunerLayerWrapper", "PrunerModuleWrapper", "PruningCallback", "SensitivityPruner",
    "SlimPruner", "SlimPrunerMasker", "TaylorFOWeightFilterPruner", "TaylorFOWeightFilterPrunerMasker", "TfPruner",
    "WeightMasker", "apply_compression_results", "load_masks", "strip_model",
]
