"""PyTorch pruning: the seeds' Pruner / WeightMasker / PrunerModuleWrapper framework and the pruners.

The names both backends export are listed once, in :data:`compressor.core.algorithms.PRUNING_EXPORTS`.
"""

from ...core.algorithms import PRUNING_EXPORTS, export_table

#: names from modules of this backend's own layout, by submodule
_TORCH_ONLY = {"pruner": ("TorchPruner",), "export": ("unwrapped_model", "unwrapped_state_dict"),
               "report": ("SparsityReport",)}

__all__ = export_table(__name__, PRUNING_EXPORTS, globals(), _TORCH_ONLY)
