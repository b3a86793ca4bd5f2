"""TF / Keras 3 pruning: the ``TfPruner`` base, ``WeightMasker`` and every built-in pruner of the seeds.

The names both backends export are listed once, in :data:`compressor.core.algorithms.PRUNING_EXPORTS`.
Also re-exports the shared TF framework (``Compressor``, ``LayerWrapper``, the optimizer hook and the
``CompressionCallback`` / ``PruningCallback`` for ``model.fit``).
"""

from ...core.algorithms import PRUNING_EXPORTS, export_table
from ..compressor import Compressor, LayerWrapper, strip_model
from ..hooks import CompressionCallback, PruningCallback

#: names only the tf backend exports, by submodule
_TF_ONLY = {"pruner": ("TfPruner",), "export": ("load_masks",), "wrapper": ("PrunerLayerWrapper",)}

__all__ = export_table(__name__, PRUNING_EXPORTS, globals(), _TF_ONLY) + [
    "CompressionCallback", "Compressor", "LayerWrapper", "PruningCallback", "strip_model"]
__all__.sort()
