"""One-shot compression of language models (Wanda, SparseGPT, GPTQ, RTN, AWQ), written once for both backends.

The data path, each hop a module of this package::

    config entry --config.quant_spec_of--> QuantSpec (once per layer, carried on its LayerTask / wrapper)
        |
    calibration batches --driver.run_sequential--> per block: backend.run_block observes each layer's input
        |                                          (observe.py) into a GramAccumulator (statistics.py)
    statistics --method.compress (prune_methods.py, quant_methods.py, awq_method.py)--> solvers
        |        (sparse.py: Wanda / SparseGPT; quantize.py: RTN / GPTQ; awq.py; linalg.py: the OBS sweep)
    LayerResult (weight, mask, QuantizedWeight: codes.py) --steps.commit_layer--> backend.write
        |                                                   (after memory.Undo's copy of the layer)
    codes in the wrappers' layout (codes.store_codes) --backend export--> compressed-tensors / Keras low-bit

``protocol.py`` declares everything the driver asks a backend (:class:`OneShotBackend`); ``memory.py`` holds what a
run does with memory (undo copies on disk, heap trimming, Gram matrices in pages of their own); ``arrays.py`` the
solvers' argument checks. Every solver takes numpy arrays in the canonical ``[out, in]`` layout and computes in
float64, so the same weights and statistics give the same masks and codes on torch and Keras.

Conventions, shared with the rest of :mod:`compressor.core`: masks are bool, True = keep; ties in any ranking prune
the lower (flat, row-major ``[out, in]``) index first; a sparsity ``s`` over ``n`` weights prunes ``floor(n * s)``;
N:M keeps N of every M consecutive input columns of each row; quantization rounds half to even, ``q = clip(round(w
/ scale + zp), qmin, qmax)``, the real range always contains 0; symmetric = signed narrow range ``[-(2^(b-1)-1),
2^(b-1)-1]`` (``narrow=False``: the full signed range, compressed-tensors' int4), affine = unsigned ``[0, 2^b - 1]``.
``H = sum_t x_t^T x_t`` is the Hessian of the layer's squared output error up to the factor 2; every algorithm here
is invariant to that scale (damping is relative).
"""

from .arrays import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, row_chunks
from .awq import (
    AWQ_CLIP_GRID,
    AWQ_CLIP_MAX_SHRINK,
    AWQ_DUO_CHOICES,
    AWQ_N_GRID,
    AwqSearch,
    AwqWeight,
    awq_candidates,
    awq_clip_ratios,
    awq_clip_search,
    awq_effective,
    awq_grid,
    awq_linear_loss,
    awq_quantize,
    awq_scales,
    awq_search,
    awq_weight_mean,
    layer_output_error,
)
from .awq_method import AwqMethod, search_inputs, search_subset
from .codes import QuantizedWeight, QuantSpec, store_codes, stored_code_width, stored_codes_to_full
from .config import (
    FORWARD_DTYPES,
    ONESHOT_KEYS,
    ONESHOT_SKIP_HINT,
    QUANT_SCHEME_KEY,
    forward_in_float64,
    quant_spec_of,
    weight_only_config,
)
from .driver import mean_error, run_sequential
from .linalg import damp_hessian, hessian_factor
from .memory import release_freed_heap
from .method import OneShotMethod
from .observe import ObserveCalls, ObservedAll
from .protocol import LayerResult, LayerTask, OneShotBackend, OneShotReport
from .prune_methods import SparseGPTMethod, WandaMethod
from .quant_methods import GptqMethod, RtnMethod
from .quantize import gptq_quantize, rtn_quantize
from .sparse import MASK_SCOPES, SparseGPTResult, sparsegpt_prune, wanda_mask, wanda_scores
from .statistics import GramAccumulator, RowSource

__all__ = [
    "GramAccumulator", "RowSource", "damp_hessian", "hessian_factor", "wanda_scores", "wanda_mask", "SparseGPTResult",
    "sparsegpt_prune", "MASK_SCOPES", "QuantSpec", "QuantizedWeight", "rtn_quantize", "gptq_quantize",
    "stored_code_width", "store_codes", "stored_codes_to_full", "awq_grid", "awq_candidates", "AWQ_DUO_CHOICES",
    "awq_scales", "awq_weight_mean", "AwqWeight", "awq_quantize", "awq_effective", "AwqSearch", "awq_search",
    "awq_linear_loss", "layer_output_error", "awq_clip_ratios", "awq_clip_search", "AWQ_CLIP_GRID",
    "AWQ_CLIP_MAX_SHRINK", "AWQ_N_GRID", "DEFAULT_DAMP", "DEFAULT_BLOCK_SIZE", "row_chunks",
    "LayerTask", "LayerResult", "OneShotBackend", "OneShotMethod", "OneShotReport", "WandaMethod",
    "SparseGPTMethod", "GptqMethod", "RtnMethod", "AwqMethod", "ONESHOT_KEYS", "QUANT_SCHEME_KEY",
    "ONESHOT_SKIP_HINT", "FORWARD_DTYPES", "forward_in_float64", "weight_only_config", "quant_spec_of",
    "run_sequential", "mean_error", "search_subset", "search_inputs", "ObserveCalls", "ObservedAll",
    "release_freed_heap",
]
