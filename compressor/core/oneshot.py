"""One-shot compression math for language models: Wanda, SparseGPT, GPTQ, RTN and AWQ (issue 25).

Written once, for both backends. Every function takes **numpy arrays** (a backend converts the layer's
weight and the recorded statistics to numpy, in the canonical ``[out, in]`` layout: torch ``Linear`` as is,
HF ``Conv1D`` / Keras ``Dense`` transposed, ``EinsumDense`` reshaped) and computes in **float64**. These
are O(in^2)..O(in^3) solves over a whole layer, done once, on the host; one float64 numpy implementation
makes the parity requirement hold by construction: the same weights and the same statistics give the same
masks and integer codes on torch and Keras (bit for bit within one numpy / BLAS build), because the same
code computes them. No function here modifies its inputs. Layers that read the same input (q / k / v;
gate / up) can share one :class:`GramAccumulator`.

Statistics (what the sequential driver records per layer, :class:`GramAccumulator`): the Gram matrix
``H = sum_t x_t^T x_t`` of the layer's input rows (tokens), ``||X_j||_2 = sqrt(H_jj)`` and ``mean|X_j|``.
``H`` is the Hessian of the layer's squared output error ``||X W^T - X W'^T||^2`` up to the factor 2 (the
references use ``2/n sum x^T x``); every algorithm here is invariant to that scale (damping is relative).

Conventions, shared with the rest of :mod:`compressor.core`:

* masks are bool, True = keep; ties in any ranking prune the lower (flat, row-major ``[out, in]``) index
  first (:mod:`compressor.core.selection`); a sparsity ``s`` over ``n`` weights prunes ``floor(n * s)``;
* N:M (``sparse_pattern: 'N:M'``) keeps N of every M consecutive input columns of each row
  (:mod:`compressor.core.sparse_pattern`, :func:`compressor.core.pruning.nm_group_rank`);
* quantization follows :mod:`compressor.core.quant`: round half to even, ``q = clip(round(w / scale +
  zp), qmin, qmax)``, ``w_hat = (q - zp) * scale``; the real range always contains 0 (so a zero weight
  stays exactly 0); symmetric = signed narrow range ``[-(2^(b-1)-1), 2^(b-1)-1]``, zero point 0;
  affine = unsigned ``[0, 2^b - 1]`` with an integer zero point (:func:`compressor.core.quant.qparams`).
  ``narrow=False`` gives the full signed range ``[-2^(b-1), 2^(b-1)-1]`` with ``scale = max|w| /
  (2^(b-1) - 1/2)`` (compressed-tensors' symmetric int4: one more level than narrow).

The OBS sweep (SparseGPT, GPTQ). Both process the input columns left to right; when column ``j`` is fixed
to ``q_j`` (pruned to 0 or quantized), the not-yet-fixed columns ``k > j`` of the same row are corrected by
``-(w_j - q_j) / U_jj * U_jk`` where ``U`` is the upper Cholesky factor of the damped ``H^-1``
(``H^-1 = U^T U``; Frantar et al., GPTQ 2022, Alg. 1; SparseGPT 2023, Alg. 1), lazily: inside a block of
``block_size`` columns per column (a mat-vec), to the later columns once per block (a GEMM), as the
references do. ``U`` comes from one Cholesky of ``H`` (reversed) and one triangular inverse
(:func:`hessian_factor`). Every row is swept at once (no Python loop over rows).
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import quant as _q
from .ops import NumpyOps
from .pruning import nm_group_rank
from .selection import prune_count, smallest_k_mask
from .sparse_pattern import parse_sparse_pattern

__all__ = [
    "GramAccumulator", "damp_hessian", "hessian_factor",
    "wanda_scores", "wanda_mask",
    "SparseGPTResult", "sparsegpt_prune",
    "QuantSpec", "QuantizedWeight", "rtn_quantize", "gptq_quantize",
    "stored_code_width", "store_codes", "stored_codes_to_full",
    "awq_grid", "awq_candidates", "AWQ_DUO_CHOICES", "awq_scales", "awq_weight_mean", "AwqWeight", "awq_quantize", "awq_effective", "AwqSearch", "awq_search",
    "awq_linear_loss", "layer_output_error", "awq_clip_ratios", "awq_clip_search", "AWQ_CLIP_GRID",
    "AWQ_CLIP_MAX_SHRINK",
]

_NP = NumpyOps()
DEFAULT_DAMP = 0.01
DEFAULT_BLOCK_SIZE = 128
AWQ_N_GRID = 20
#: AWQ's weight clipping search (AutoAWQ's ``auto_clip``): ratios ``1 - i / AWQ_CLIP_GRID`` for
#: ``i < AWQ_CLIP_MAX_SHRINK * AWQ_CLIP_GRID`` of each group's largest magnitude (1.0, 0.95, ..., 0.55)
AWQ_CLIP_GRID = 20
AWQ_CLIP_MAX_SHRINK = 0.5
AWQ_MIN_SCALE = 1e-4  # the AWQ reference's clamp of mean|x|^alpha
#: rows per float32 Gram product (:meth:`GramAccumulator.add`): bounds the float32 rounding of one partial sum
GRAM_F32_ROWS = 1024
#: float64 values per row chunk of the per-channel sums of :meth:`GramAccumulator.add` (512 KiB)
SUM_CHUNK_VALUES = 1 << 16
#: values per row chunk of the row-independent weight computations (:func:`row_chunks`: 512 KiB float64)
ROW_CHUNK_VALUES = 1 << 16
#: columns per block of the Gram products of :meth:`GramAccumulator.add` (bounds their temporaries)
GRAM_COLS = 256


# ------------------------------------------------------------------------------------------- validation
#: arrays of at least this many bytes that live long and are freed as a whole (the Gram matrices, which the
#: solvers then factor in place) get pages of their own (:func:`own_pages`)
OWN_PAGES_BYTES = 1 << 20


def own_pages(shape: tuple[int, ...]) -> np.ndarray:
    """A zero float64 array of ``shape`` in an anonymous memory map of its own (below :data:`OWN_PAGES_BYTES`:
    ``np.zeros``). Its pages go back to the OS the moment the array is dropped, and it never sits in the
    allocator's heap between the calibration pass's short-lived buffers: a Gram matrix there (an LLM down
    projection's: 18 MiB at width 1536) left a hole that those buffers split when it was freed, and glibc
    raised its mmap threshold past it, so every later buffer of that size came from the heap too."""
    n = int(np.prod(shape, dtype=np.int64)) * 8
    if n < OWN_PAGES_BYTES:
        return np.zeros(shape)
    try:
        buf = mmap.mmap(-1, n)
    except (OSError, ValueError):  # no anonymous maps here: the allocator's memory
        return np.zeros(shape)
    return np.frombuffer(buf, dtype=np.float64).reshape(shape)


def _weight(weight: Any, what: str = "weight", copy: bool = True) -> np.ndarray:
    """``weight`` as a checked float64 ``[out, in]`` array: a copy, or with ``copy=False`` the array itself where it
    is float32 or float64 (for callers that only read it, a chunk of rows at a time, widened to float64 there:
    :func:`_rows64`)."""
    if copy:
        w = np.array(weight, dtype=np.float64, copy=True)
    else:
        w = np.asarray(weight)
        if w.dtype not in (np.float32, np.float64):
            w = np.asarray(w, dtype=np.float64)
    if w.ndim != 2 or 0 in w.shape:
        raise ValueError(f"{what} must be a non-empty 2-D array in the [out, in] layout, got shape {w.shape}")
    if not np.all(np.isfinite(w)):
        raise ValueError(f"{what} contains NaN or inf")
    return w


def _hessian(hessian: Any, n_in: int) -> np.ndarray:
    """A float64 copy of ``hessian`` to damp in place; a one-element list hands over the caller's only reference
    (:meth:`GramAccumulator.gram_for_solver`): that array itself is used (and changed), no copy."""
    if isinstance(hessian, list) and len(hessian) == 1:
        h = hessian.pop()
        if not (isinstance(h, np.ndarray) and h.dtype == np.float64 and h.flags.c_contiguous and h.flags.writeable):
            h = np.array(h, dtype=np.float64, copy=True)
    else:
        h = np.array(hessian, dtype=np.float64, copy=True)
    if h.shape != (n_in, n_in):
        raise ValueError(f"hessian must be [in, in] = [{n_in}, {n_in}] for a weight with {n_in} input columns, "
                         f"got shape {h.shape}")
    if not np.all(np.isfinite(h)):
        raise ValueError("hessian contains NaN or inf (check the calibration data)")
    if np.any(np.diag(h) < 0):
        raise ValueError("hessian has a negative diagonal entry: it must be a Gram matrix sum X^T X")
    return h


def _mask(mask: Any, shape: tuple[int, ...], what: str = "mask") -> np.ndarray | None:
    if mask is None:
        return None
    m = np.asarray(mask)
    if m.shape != shape:
        raise ValueError(f"{what} must have the weight's shape {shape}, got {m.shape}")
    if m.dtype != np.bool_:
        if not np.all((m == 0) | (m == 1)):
            raise ValueError(f"{what} must be bool (True = keep) or 0/1")
        m = m.astype(bool)
    return m.copy()


def _block_size(block_size: int) -> int:
    if isinstance(block_size, bool) or not isinstance(block_size, (int, np.integer)) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    return int(block_size)


def _sparsity_or_pattern(sparsity: float | None, sparse_pattern: str | None) -> tuple[float | None, tuple[int, int] | None]:
    if (sparsity is None) == (sparse_pattern is None):
        raise ValueError("give exactly one of sparsity (unstructured, in [0, 1)) and sparse_pattern ('N:M')")
    if sparse_pattern is not None:
        return None, parse_sparse_pattern(sparse_pattern)
    s = float(sparsity)  # type: ignore[arg-type]
    if not 0.0 <= s < 1.0:
        raise ValueError(f"sparsity must be in [0, 1), got {sparsity!r}")
    return s, None


def _check_nm_width(n_in: int, m: int, pattern: str) -> None:
    if n_in % m:
        raise ValueError(f"sparse_pattern {pattern!r}: the weight's input dimension {n_in} is not a multiple of M={m}")


# ------------------------------------------------------------------------------------------- statistics
def _float32_valued(a: np.ndarray) -> bool:
    """True when every value of ``a`` is a float32 value (rounding to float32 and back changes nothing)."""
    return bool(np.array_equal(a.astype(np.float32), a))


class GramAccumulator:
    """Input statistics of one layer over the calibration tokens, in float64.

    ``add(x)`` takes a batch of the layer's inputs, any shape ``[..., in]`` (tokens are all leading axes:
    ``[batch, seq, in]`` is ``batch * seq`` rows; a backend drops padded tokens before, if it wants them
    out), and accumulates

    * ``gram``: ``H = sum_t x_t^T x_t`` (``[in, in]``; only when ``gram=True``, the default), the
      statistic of SparseGPT and GPTQ;
    * ``sq_sum``: ``sum_t x_tj^2`` per input channel (the diagonal of ``H``), Wanda's ``||X_j||_2^2``;
    * ``abs_sum``: ``sum_t |x_tj|``, AWQ's ``mean|X_j|`` once divided by ``count``;
    * ``count``: the number of rows (tokens).

    ``gram=False`` keeps O(in) memory (Wanda and AWQ need no ``H``); ``sq_sum`` is then summed directly,
    which can differ from ``diag(H)`` in the last bit: a backend picks one mode per algorithm and uses
    it on both frameworks. The sums are float64; ``gram`` takes float32 products of float32-valued rows
    (see :meth:`add`), so the values and their grouping into batches are what decide its rounding.
    """

    def __init__(self, in_features: int, gram: bool = True):
        if isinstance(in_features, bool) or not isinstance(in_features, (int, np.integer)) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = int(in_features)
        self.count = 0
        self.gram: np.ndarray | None = own_pages((self.in_features,) * 2) if gram else None
        self._sq = np.zeros(self.in_features)
        self.abs_sum = np.zeros(self.in_features)
        #: set by the driver when no later layer reads this accumulator (see :meth:`gram_for_solver`)
        self.consumable = False

    def add(self, x: Any) -> None:
        """Accumulate a batch of input rows ``x`` (``[..., in]``); NaN / inf or a wrong width is a ValueError.

        The Gram matrix of rows that are float32 values (float32 input, or float64 input whose every value is a
        float32: what a float32 model computes, whichever dtype the backend hands over) is computed as float32
        products of at most :data:`GRAM_F32_ROWS` rows each, summed into the float64 ``gram`` (half the time of
        a float64 product; the references accumulate in float32 throughout). Other rows are multiplied in
        float64. So the result depends on the values and their grouping into ``add`` calls only, not on the
        dtype a backend passes. ``sq_sum`` / ``abs_sum`` are float64 sums of the float64 values."""
        a = np.asarray(x)
        if a.dtype != np.float32:
            a = np.asarray(a, dtype=np.float64)
        if a.ndim == 0 or a.shape[-1] != self.in_features:
            raise ValueError(f"layer input must end with the layer's input dimension {self.in_features}, "
                             f"got shape {a.shape}")
        a = a.reshape(-1, self.in_features)
        # the per-channel sums over row chunks (no float64 copy of the whole batch: two of them were the
        # largest transients of a calibration pass, 24 MiB for a 2048 x 768 float32 input), where that
        # reproduces the whole-array sums bit for bit: numpy sums a C-contiguous [rows, >= 2] array's axis 0
        # row after row, and each chunk's first row carries the sum so far
        chunked = self.in_features >= 2 and a.flags.c_contiguous
        step = max(1, SUM_CHUNK_VALUES // self.in_features) if chunked else max(a.shape[0], 1)
        if not all(np.isfinite(a[i:i + step]).all() for i in range(0, a.shape[0], step)):
            raise ValueError("calibration inputs contain NaN or inf")
        if self.gram is not None:
            # float32-valued rows? (the first row decides for most float64 rows, without a float32 copy of all)
            low = a if a.dtype == np.float32 else None
            if low is None and _float32_valued(a[:1]):
                low = a.astype(np.float32)
                low = low if np.array_equal(low, a) else None
            if low is not None:
                for i in range(0, low.shape[0], GRAM_F32_ROWS):
                    self._add_product(low[i:i + GRAM_F32_ROWS])
            else:
                self._add_product(np.asarray(a, dtype=np.float64))
        if not chunked:
            a64 = np.asarray(a, dtype=np.float64)
            if self.gram is None:
                self._sq += np.einsum("ti,ti->i", a64, a64)
            self.abs_sum += np.abs(a64).sum(axis=0)
        else:
            abs_acc = sq_acc = None
            for i in range(0, a.shape[0], step):
                c64 = np.asarray(a[i:i + step], dtype=np.float64)
                if self.gram is None:
                    sq = c64 * c64
                    if sq_acc is not None:
                        sq[0] += sq_acc
                    sq_acc = sq.sum(axis=0)
                c64 = np.abs(c64, out=c64) if c64.base is None else np.abs(c64)
                if abs_acc is not None:
                    c64[0] += abs_acc
                abs_acc = c64.sum(axis=0)
            if sq_acc is not None:
                self._sq += sq_acc
            if abs_acc is not None:
                self.abs_sum += abs_acc
        self.count += a.shape[0]

    def _add_product(self, c: np.ndarray) -> None:
        """``gram += c^T c`` in column blocks of :data:`GRAM_COLS`: each block's product is computed once for the
        upper triangle and its diagonal block, and mirrored below (``gram`` stays exactly symmetric), so the
        largest temporary is ``[in, GRAM_COLS]``, not a second ``[in, in]`` matrix (for a 768-wide layer 1.5 MiB
        instead of 4.5; for an 11008-wide one 22 MiB instead of 924)."""
        gram = self.gram
        n = self.in_features
        for j in range(0, n, GRAM_COLS):
            j1 = min(j + GRAM_COLS, n)
            p = c[:, :j1].T @ c[:, j:j1]
            gram[:j1, j:j1] += p
            if j:
                gram[j:j1, :j] += p[:j].T

    def gram_for_solver(self) -> np.ndarray | list[np.ndarray]:
        """What GPTQ / SparseGPT take as ``hessian``: ``gram``, or, once the driver has set ``consumable`` (no
        later layer reads this accumulator), ``[gram]``: the solver then damps and factors that very array
        instead of a copy (one ``in x in`` float64 matrix less at the peak of the widest layer) and the
        accumulator gives it up."""
        if self.consumable and self.gram is not None:
            box = [self.gram]
            self.gram = None
            return box
        return self.gram  # type: ignore[return-value]

    @property
    def sq_sum(self) -> np.ndarray:
        """``sum_t x_tj^2`` per input channel (``diag(H)`` in Gram mode)."""
        return np.diag(self.gram).copy() if self.gram is not None else self._sq.copy()

    def _need_rows(self) -> None:
        if self.count == 0:
            raise ValueError("no calibration rows were accumulated (empty calibration set?)")

    def mean(self) -> np.ndarray:
        """``H / count``: the mean of ``x^T x`` over the rows."""
        self._need_rows()
        if self.gram is None:
            raise ValueError("this accumulator was made with gram=False: it has no Gram matrix")
        return self.gram / self.count

    def channel_norms(self) -> np.ndarray:
        """Wanda's ``||X_j||_2 = sqrt(sum_t x_tj^2)`` per input channel."""
        return np.sqrt(self.sq_sum)

    def abs_mean(self) -> np.ndarray:
        """AWQ's activation statistic ``mean_t |x_tj|`` per input channel."""
        self._need_rows()
        return self.abs_sum / self.count


def damp_hessian(hessian: Any, damp: float = DEFAULT_DAMP) -> tuple[np.ndarray, np.ndarray]:
    """GPTQ's damping of the Gram matrix, as in the reference: ``(H', dead)`` (``hessian`` is not changed).

    Dead inputs (``H_jj == 0``: the channel was always 0 on the calibration data) get ``H_jj = 1``; then
    ``H' = H + damp * mean(diag(H)) * I`` (the mean taken after the dead fix, ``damp`` relative, 0.01 by
    default). The caller zeroes the weight columns ``dead`` (they never reach the output on these data).
    """
    h = np.array(hessian, dtype=np.float64, copy=True)
    if h.ndim != 2 or h.shape[0] != h.shape[1]:
        raise ValueError(f"hessian must be a square matrix, got shape {h.shape}")
    return h, _damp_inplace(h, damp)


def _damp_inplace(h: np.ndarray, damp: float) -> np.ndarray:
    """:func:`damp_hessian` on ``h`` in place (the caller's own copy); returns ``dead``."""
    if isinstance(damp, bool) or not isinstance(damp, (int, float, np.floating)) or not math.isfinite(damp) \
            or damp < 0:
        raise ValueError(f"damp must be a finite float >= 0 (a fraction of the mean diagonal), got {damp!r}")
    dead = np.diag(h) == 0
    idx = np.flatnonzero(dead)
    h[idx, idx] = 1.0
    h[np.diag_indices_from(h)] += float(damp) * float(np.mean(np.diag(h)))
    return dead


def hessian_factor(damped_hessian: np.ndarray, damp: float | None = None) -> np.ndarray:
    """``U``: the upper Cholesky factor of ``H^-1`` (``H^-1 = U^T U``) that GPTQ / SparseGPT sweep with.

    Computed without forming ``H^-1`` (the references factor three times: ``chol(H)``, its inverse,
    ``chol`` again): with ``P`` the reversal, ``P H P = L L^T`` gives ``H = R R^T``, ``R = P L P`` upper, so
    ``H^-1 = R^-T R^-1`` and ``U = R^-1`` (upper, positive diagonal: the unique factor). One Cholesky and
    one triangular inverse. Not positive definite: ValueError (raise ``damp``). Returns a view of a
    contiguous ``U^T``.
    """
    return _inverse_factor_t(damped_hessian, damp).T


def _inverse_factor_t(h: np.ndarray | list[np.ndarray], damp: float | None) -> np.ndarray:
    """``U^T`` (lower triangular, C-contiguous) of :func:`hessian_factor`, computed IN the damped Hessian's own
    array: a blocked Cholesky of the reversed matrix (:func:`_cholesky_lower_inplace`), one blocked transpose,
    a triangular inverse by halves (:func:`_inv_lower`), each in place with block-sized temporaries. ``h`` may be
    a one-element list holding the caller's only reference to its (scratch) damped Hessian: that array is
    taken and becomes the result; an array is copied first (the caller's is not changed). So the solver's
    peak holds ONE ``n x n`` matrix where LAPACK's factor through numpy held three (input, its work copy,
    output): on an LLM's down projection (``n`` = 11008) 0.9 GiB instead of 2.8."""
    a = h.pop() if isinstance(h, list) else np.array(h, dtype=np.float64, copy=True)
    del h
    n = a.shape[0]
    try:
        # P H P = L L^T with P the reversal: L (lower) is written over the lower triangle of the reversed view,
        # i.e. R = P L P (upper, H = R R^T) over the upper triangle of ``a``
        _cholesky_lower_inplace(a[::-1, ::-1])
    except np.linalg.LinAlgError:
        hint = f" (damp={damp})" if damp is not None else ""
        raise ValueError(f"the damped Hessian is not positive definite{hint}: increase damp or use more "
                         f"calibration samples") from None
    # R^T (lower) into the lower triangle, zeros above: block by block
    b = _FACTOR_BLOCK
    for i0 in range(0, n, b):
        i1 = min(i0 + b, n)
        a[i0:i1, i0:i1] = np.triu(a[i0:i1, i0:i1]).T
        for j0 in range(i1, n, b):
            j1 = min(j0 + b, n)
            a[j0:j1, i0:i1] = a[i0:i1, j0:j1].T
            a[i0:i1, j0:j1] = 0.0
    return _inv_lower(a)  # (R^T)^-1 = U^T


#: block width of the in-place factorization (:func:`_cholesky_lower_inplace`, the transpose): its temporaries
#: are ``n x`` this many columns
_FACTOR_BLOCK = 128


def _cholesky_lower_inplace(a: np.ndarray) -> None:
    """Cholesky ``A = L L^T`` of a symmetric positive definite ``a`` (any strides; its lower triangle is read),
    written over ``a``'s lower triangle (the upper one is left as scratch): right-looking, in blocks of
    :data:`_FACTOR_BLOCK` columns (LAPACK's factor on each diagonal block, the panel by the block's triangular
    inverse, the trailing lower triangle updated one block column at a time). Not positive definite:
    ``np.linalg.LinAlgError``."""
    n = a.shape[0]
    b = _FACTOR_BLOCK
    for k0 in range(0, n, b):
        k1 = min(k0 + b, n)
        d = np.tril(a[k0:k1, k0:k1])
        d += np.tril(d, -1).T  # the symmetric diagonal block from its lower triangle
        low = np.linalg.cholesky(d)
        a[k0:k1, k0:k1] = low
        if k1 == n:
            break
        panel = a[k1:, k0:k1] @ np.tril(np.linalg.inv(low)).T  # L21 = A21 L11^-T
        a[k1:, k0:k1] = panel
        for j0 in range(k1, n, b):  # A22 -= L21 L21^T, lower part, one block column at a time
            j1 = min(j0 + b, n)
            a[j0:, j0:j1] -= panel[j0 - k1:] @ panel[j0 - k1:j1 - k1].T


_INV_BASE = 64


def _inv_lower(low: np.ndarray) -> np.ndarray:
    """Inverse of a lower-triangular matrix by halves, ``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1,
    D^-1]]``: ``n^3 / 3`` flops, all in matrix products (numpy has no triangular inverse). Computed IN PLACE
    (``low`` is overwritten and returned); the off-diagonal block is updated a chunk of rows, then a chunk of
    columns at a time (each row of ``C A^-1`` needs only that row of ``C``, each column of ``D^-1 (C A^-1)`` only
    that column): no temporary larger than ``n x`` :data:`_FACTOR_BLOCK`."""
    n = low.shape[0]
    if n <= _INV_BASE:
        low[...] = np.tril(np.linalg.inv(low))
        return low
    k = n // 2
    _inv_lower(low[:k, :k])
    _inv_lower(low[k:, k:])
    c, a_inv, d_inv = low[k:, :k], low[:k, :k], low[k:, k:]
    step = _FACTOR_BLOCK
    for r0 in range(0, n - k, step):
        c[r0:r0 + step] = c[r0:r0 + step] @ a_inv
    for c0 in range(0, k, step):
        c[:, c0:c0 + step] = -(d_inv @ c[:, c0:c0 + step])
    return low


class _Sweep:
    """State of the blocked OBS column sweep (GPTQ Alg. 1's lazy batch updates), in transposed layout: row
    ``p`` of every ``[in, out]`` array is weight column ``p`` (in sweep order), so each step reads contiguous
    rows.

    ``w``: the columns with the corrections of every finished block applied; ``ut``: ``U^T`` (lower,
    contiguous), ``ud``: ``diag(U)``; ``keep``: keep-mask (masked entries read as 0 and so are never
    corrected, as llmcompressor's GPTQ on a sparse model); ``e``: the scaled errors ``(w_j - q_j) / U_jj`` of
    the fixed columns of the current block only (row ``p - i1``; ``[block, out]``, as the reference's ``Err1``:
    no second weight-sized array).
    """

    def __init__(self, w0t: np.ndarray, ut: np.ndarray, keep_t: np.ndarray | None, block: int):
        self.w = w0t
        self.ut = ut
        self.ud = np.diag(ut).copy()
        self.keep = keep_t
        self.e = np.zeros((min(block, w0t.shape[0]), w0t.shape[1]))
        self.i1 = 0
        self.error = 0.0

    def start_block(self, i1: int) -> None:
        """The sweep enters the block starting at column ``i1``."""
        self.i1 = i1

    def current(self, pos: Any, i1: int, p: int) -> np.ndarray:
        """Up-to-date values of the not yet fixed columns ``pos`` (all ``>= p``; ``p`` is the next column to
        fix, ``i1`` its block's start): the finished blocks' corrections plus ``-sum_{i1<=i<p} e_i U_i,pos``."""
        w = self.w[pos]
        if p > i1:
            w = w - self.ut[pos, i1:p] @ self.e[:p - i1]
        if self.keep is not None:
            w = np.where(self.keep[pos], w, 0.0)
        return w

    def fix(self, p: int, w: np.ndarray, q: np.ndarray) -> None:
        """Column ``p`` (current value ``w``) is fixed to ``q``."""
        d = w - q
        self.e[p - self.i1] = d / self.ud[p]
        self.error += 0.5 * float(np.dot(d, d)) / float(self.ud[p]) ** 2

    def end_block(self, i1: int, i2: int) -> None:
        """Apply the block ``[i1, i2)``'s corrections to the later columns (one GEMM)."""
        if i2 < self.w.shape[0]:
            self.w[i2:] -= self.ut[i2:, i1:i2] @ self.e[:i2 - i1]


def _prepare(weight: Any, hessian: Any, damp: float, mask: Any = None) -> tuple[np.ndarray, np.ndarray,
                                                                                np.ndarray, np.ndarray | None,
                                                                                np.ndarray]:
    """Copies of the weight (dead / masked columns zeroed) and the damped Hessian; ``dead``; the keep-mask;
    ``diag(H)`` before damping (dead entries 1), which ``act_order`` sorts by as the reference does."""
    w = _weight(weight)
    h = _hessian(hessian, w.shape[1])
    keep = _mask(mask, w.shape)
    diag0 = np.where(np.diag(h) == 0, 1.0, np.diag(h))
    dead = _damp_inplace(h, damp)
    w[:, dead] = 0.0
    if keep is not None:
        w[~keep] = 0.0
    return w, h, dead, keep, diag0


# ------------------------------------------------------------------------------------------------ Wanda
def wanda_scores(weight: Any, channel_norms: Any) -> np.ndarray:
    """Wanda (Sun et al. 2023, eq. 1): ``S_ij = |W_ij| * ||X_j||_2`` (``weight`` ``[out, in]``)."""
    w = _weight(weight)
    n = np.asarray(channel_norms, dtype=np.float64)
    if n.shape != (w.shape[1],):
        raise ValueError(f"channel_norms must have one entry per input column ({w.shape[1]}), got shape {n.shape}")
    if not np.all(np.isfinite(n)) or np.any(n < 0):
        raise ValueError("channel_norms must be finite and >= 0")
    return np.abs(w) * n[None, :]


def wanda_mask(weight: Any, channel_norms: Any, sparsity: float | None = None,
               sparse_pattern: str | None = None) -> np.ndarray:
    """Wanda's keep-mask: within each output row (the paper's per-output comparison group), prune the
    ``floor(in * sparsity)`` smallest :func:`wanda_scores`; or, with ``sparse_pattern='N:M'``, keep the N
    largest scores of every M consecutive input columns of each row. Ties: lower index pruned first.
    No weight update (the weights are ``weight * mask``).
    """
    s, nm = _sparsity_or_pattern(sparsity, sparse_pattern)
    scores = wanda_scores(weight, channel_norms)
    out, n_in = scores.shape
    if nm is not None:
        _check_nm_width(n_in, nm[1], sparse_pattern)  # type: ignore[arg-type]
        return np.asarray(_nm_keep(scores, *nm))
    k = prune_count(n_in, s)  # type: ignore[arg-type]
    keep = np.ones((out, n_in), dtype=bool)
    if k:
        order = np.argsort(scores, axis=1, kind="stable")  # ties: lower index first
        np.put_along_axis(keep, order[:, :k], False, axis=1)
    return keep


def _nm_keep(scores: np.ndarray, n: int, m: int) -> np.ndarray:
    """Keep-mask of ``scores`` ``[out, c]`` (``c`` a multiple of ``m``): the ``n`` largest of each group of
    ``m`` consecutive columns (ties: lower index pruned first, :func:`compressor.core.pruning.nm_group_rank`)."""
    out, c = scores.shape
    rank = nm_group_rank(_NP, scores.reshape(-1, m), m)
    return np.asarray(rank >= m - n).reshape(out, c)


# -------------------------------------------------------------------------------------------- SparseGPT
@dataclass(frozen=True)
class SparseGPTResult:
    """``weight``: the pruned and corrected weight ``[out, in]`` (pruned entries exactly 0); ``mask``: bool
    keep-mask; ``error``: the OBS proxy loss ``sum_j ||w_j - q_j||^2 / (2 U_jj^2)`` the sweep removed
    (the references' ``Losses``); ``dead``: inputs that were all-zero in the calibration data."""

    weight: np.ndarray
    mask: np.ndarray
    error: float
    dead: np.ndarray


MASK_SCOPES = ("block", "row")


def sparsegpt_prune(weight: Any, hessian: Any, sparsity: float | None = None, sparse_pattern: str | None = None,
                    *, damp: float = DEFAULT_DAMP, block_size: int = DEFAULT_BLOCK_SIZE,
                    mask_scope: str = "block") -> SparseGPTResult:
    """SparseGPT (Frantar & Alistarh 2023, Alg. 1): prune ``weight`` ``[out, in]`` with OBS weight updates.

    ``hessian`` is the layer's Gram matrix ``sum x^T x`` (:class:`GramAccumulator`), damped here
    (:func:`damp_hessian`). Columns are swept left to right in blocks of ``block_size``; a pruned weight is
    set to 0 and its error ``w / U_jj`` is spread over the row's later columns with ``U`` (the upper
    Cholesky factor of ``H^-1``), so the layer's output on the calibration data changes as little as
    possible.

    Adaptive mask selection, by the OBS saliency ``w_ij^2 / U_jj^2`` of the *current* (already corrected)
    weights (``U_jj^2`` is ``[H_F^-1]_jj`` for ``F`` the columns not yet fixed, the paper's eq. 3):

    * unstructured, ``mask_scope='block'`` (the reference implementation's rule): at the start of each block,
      ``floor(out * width * sparsity)`` of the block's weights with the lowest saliency, over all rows
      together (rows end with different sparsities; the layer's is exact up to the per-block floors; the
      reference's ``tmp <= sorted(tmp)[k]`` prunes one more per block, we keep the project's exact count);
      ``mask_scope='row'``: ``floor(width * sparsity)`` per row inside each block (every row equally sparse);
    * ``sparse_pattern='N:M'``: when the sweep reaches each group of M columns, each row keeps the N of
      highest saliency among them (``block_size`` must be a multiple of M).

    Ties prune the lower index first. With ``H = I`` there are no updates and the result is magnitude
    pruning (per layer for ``'block'`` with ``block_size >= in``, per row for ``'row'``, N:M).
    """
    s, nm = _sparsity_or_pattern(sparsity, sparse_pattern)
    bs = _block_size(block_size)
    if mask_scope not in MASK_SCOPES:
        raise ValueError(f"mask_scope must be one of {list(MASK_SCOPES)}, got {mask_scope!r}")
    w, hd, dead, _, _ = _prepare(weight, hessian, damp)
    out, n_in = w.shape
    if nm is not None:
        _check_nm_width(n_in, nm[1], sparse_pattern)  # type: ignore[arg-type]
        if bs % nm[1]:
            raise ValueError(f"block_size {bs} must be a multiple of M={nm[1]} of sparse_pattern {sparse_pattern!r}")
    box = [hd]
    del hd
    sweep = _Sweep(np.ascontiguousarray(w.T), _inverse_factor_t(box, damp), None, bs)
    del w
    result_t = sweep.w  # row p is final once fixed and never read again: the result is written over it
    keep_t = np.ones(sweep.w.shape, dtype=bool)
    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        sweep.start_block(i1)
        if nm is None and s:
            cur = sweep.current(slice(i1, i2), i1, i1)
            sal = (np.abs(cur) / sweep.ud[i1:i2, None]).T  # [out, width]: canonical order for ties
            width = i2 - i1
            if mask_scope == "block":
                blk = np.asarray(smallest_k_mask(_NP, sal, prune_count(out * width, s)))
            else:
                blk = np.ones((out, width), dtype=bool)
                k = prune_count(width, s)
                if k:
                    np.put_along_axis(blk, np.argsort(sal, axis=1, kind="stable")[:, :k], False, axis=1)
            keep_t[i1:i2] = blk.T
        for p in range(i1, i2):
            if nm is not None and (p - i1) % nm[1] == 0:
                cur = sweep.current(slice(p, p + nm[1]), i1, p)
                sal = (np.abs(cur) / sweep.ud[p:p + nm[1], None]).T
                keep_t[p:p + nm[1]] = _nm_keep(sal, *nm).T
            wc = sweep.current(p, i1, p)
            q = np.where(keep_t[p], wc, 0.0)
            sweep.fix(p, wc, q)
            result_t[p] = q  # after fix: wc may be a view of this very row
        sweep.end_block(i1, i2)
    return SparseGPTResult(weight=np.ascontiguousarray(result_t.T), mask=np.ascontiguousarray(keep_t.T),
                           error=sweep.error, dead=dead)


# ----------------------------------------------------------------------------------------- quantization
@dataclass(frozen=True)
class QuantSpec:
    """Weight-only integer grid: ``bits`` (2..8), ``symmetric`` (signed, zero point 0) or affine (unsigned,
    integer zero point), ``group_size`` (None or -1: one group per output row = per channel; else groups of
    that many consecutive input columns, the last one shorter when it does not divide ``in``), ``narrow``
    (symmetric only: ``[-(2^(b-1)-1), 2^(b-1)-1]``, the project's convention; False: ``[-2^(b-1),
    2^(b-1)-1]``, compressed-tensors' symmetric int4)."""

    bits: int
    symmetric: bool = True
    group_size: int | None = None
    narrow: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.bits, bool) or not isinstance(self.bits, (int, np.integer)) or not 2 <= self.bits <= 8:
            raise ValueError(f"bits must be an int in 2..8 (weight-only: 2, 3, 4 or 8 are the usual), got {self.bits!r}")
        g = self.group_size
        if g is not None and (isinstance(g, bool) or not isinstance(g, (int, np.integer)) or (g < 1 and g != -1)):
            raise ValueError(f"group_size must be None or -1 (per output channel) or a positive int, got {g!r}")

    @property
    def qrange(self) -> tuple[int, int]:
        """``(qmin, qmax)`` of the codes."""
        if self.symmetric:
            return _q.quant_range(self.bits, "int", narrow=self.narrow)
        return _q.quant_range(self.bits, "uint")

    @property
    def code_dtype(self) -> np.dtype:
        """The smallest integer dtype that holds every code: int8 (symmetric) / uint8 (affine); bits <= 8."""
        return np.dtype(np.int8 if self.symmetric else np.uint8)

    def group_width(self, n_in: int) -> int:
        """Columns per group for a weight with ``n_in`` input columns."""
        g = self.group_size
        return n_in if g is None or g == -1 or g >= n_in else int(g)

    def params(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Scale and zero point per row of ``values`` ``[rows, cols]`` from the row's min / max
        (:func:`compressor.core.quant.qparams`, range widened to contain 0)."""
        qmin, qmax = self.qrange
        return self.params_from_range(values.min(axis=1), values.max(axis=1), qmin, qmax)

    def params_from_range(self, rmin: np.ndarray, rmax: np.ndarray, qmin: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
        scale, zp = _q.qparams(_NP, rmin, rmax, qmin, qmax, symmetric=self.symmetric)
        scale = np.asarray(scale, dtype=np.float64)
        zp = np.asarray(zp, dtype=np.float64)
        if self.symmetric and not self.narrow:
            zp = np.zeros_like(scale)  # the full signed range is centred on 0, not on (qmin + qmax) // 2
        return scale, zp

    def quantize(self, w: np.ndarray, scale: np.ndarray, zp: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(codes, dequantized)`` of ``w`` on the grid (codes as float64 integers)."""
        qmin, qmax = self.qrange
        codes = np.asarray(_q.quantize(_NP, w, scale, zp, qmin, qmax))
        return codes, np.asarray(_q.dequantize(_NP, codes, scale, zp))


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight-only quantized ``[out, in]`` weight.

    ``codes``: ``[out, in]`` in ``spec.code_dtype`` (int8 symmetric / uint8 affine: 1 byte per weight); ``scale`` / ``zero_point``: float64 ``[out, n_groups]`` (zero points are
    integers; 0 for symmetric); group ``g`` is input columns ``[g * group_size, (g + 1) * group_size)``
    (original column order, also with ``act_order``: no ``g_idx`` needed); ``dequantized``: ``(codes -
    zp) * scale`` per group, float64, exactly the values the algorithm settled on (None where the caller
    asked not to keep them: :func:`awq_quantize`). ``error``: GPTQ's OBS
    proxy loss (0 for RTN). ``perm``: the sweep order (``act_order``) or None.
    """

    codes: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray
    group_size: int
    spec: QuantSpec
    dequantized: np.ndarray | None
    error: float = 0.0
    perm: np.ndarray | None = None
    dead: np.ndarray | None = field(default=None)

    def group_index(self) -> np.ndarray:
        """Group of each input column, ``j // group_size``."""
        return np.arange(self.codes.shape[1]) // self.group_size


#: codes of this many bits or fewer are kept two per byte by the quantizer wrappers (:func:`store_codes`)
NIBBLE_BITS = 4


def stored_code_width(n_in: int, bits: int) -> int:
    """Bytes per output row of the codes as the wrappers keep them: ``ceil(n_in / 2)`` for ``bits <=`` 4 (two codes
    per byte), ``n_in`` otherwise."""
    return (int(n_in) + 1) // 2 if bits <= NIBBLE_BITS else int(n_in)


def store_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """``[out, in]`` codes (int8 symmetric / uint8 affine) in the wrappers' form: for ``bits <=`` 4 two per byte,
    column ``2k`` in the low nibble and ``2k + 1`` in the high one (an odd last column pairs with 0), in the
    same dtype (a symmetric code's nibble is its two's complement, sign-extended back by
    :func:`stored_codes_to_full`); wider codes as they are. Half the bytes of int4 codes in memory: 17 MiB of a
    34 M-parameter Llama's quantizer state."""
    c = np.asarray(codes)
    if c.ndim != 2 or c.dtype not in (np.int8, np.uint8):
        raise ValueError(f"codes must be a 2-D int8 / uint8 array, got {c.dtype} of shape {c.shape}")
    if bits > NIBBLE_BITS:
        return c
    u = c.view(np.uint8)
    lo = u[:, 0::2]
    hi = np.zeros_like(lo)
    hi[:, :u.shape[1] // 2] = u[:, 1::2]
    return ((lo & 0x0F) | (hi << 4)).view(c.dtype)


def stored_codes_to_full(stored: np.ndarray, bits: int, n_in: int) -> np.ndarray:
    """Inverse of :func:`store_codes`: the ``[out, n_in]`` codes (int8 sign-extended / uint8)."""
    s = np.asarray(stored)
    if bits > NIBBLE_BITS:
        return s
    if s.ndim != 2 or s.shape[1] != stored_code_width(n_in, bits):
        raise ValueError(f"stored {bits}-bit codes for {n_in} input columns must be [out, {stored_code_width(n_in, bits)}], "
                         f"got shape {s.shape}")
    if s.dtype == np.int8:  # arithmetic shifts sign-extend each nibble
        lo, hi = (s << 4) >> 4, s >> 4
    else:
        lo, hi = s & 0x0F, s >> 4
    out = np.empty((s.shape[0], 2 * s.shape[1]), dtype=s.dtype)
    out[:, 0::2], out[:, 1::2] = lo, hi
    return out[:, :n_in]


def _group_starts(n_in: int, gs: int) -> np.ndarray:
    return np.arange(0, n_in, gs)


def _rows64(w: np.ndarray, rows: slice) -> np.ndarray:
    """Rows ``rows`` of ``w`` (float32 or float64) as float64 (a view where ``w`` is float64)."""
    return np.asarray(w[rows], dtype=np.float64)


def row_chunks(n_rows: int, n_cols: int) -> Iterator[slice]:
    """Slices of at most :data:`ROW_CHUNK_VALUES` values (whole rows, at least one) covering ``n_rows`` rows:
    the row-independent weight computations (round to nearest, AWQ's scaling and clipping) run per chunk, so
    their temporaries are a few chunks, not a few copies of the weight."""
    step = max(1, ROW_CHUNK_VALUES // max(int(n_cols), 1))
    for r0 in range(0, n_rows, step):
        yield slice(r0, min(r0 + step, n_rows))


def _rtn_rows(weight: np.ndarray, spec: QuantSpec, scaled_by: np.ndarray | None, clip: np.ndarray | None
              ) -> Iterator[tuple[slice, np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Round to nearest of ``clip(W * scaled_by, -clip, clip)`` (both optional) chunk of rows by chunk of rows
    (:func:`row_chunks`): ``(rows, codes, dequantized, scale, zero point)`` of each chunk."""
    n_out, n_in = weight.shape
    gs = spec.group_width(n_in)
    starts = _group_starts(n_in, gs)
    qmin, qmax = spec.qrange
    gidx = np.arange(n_in) // gs
    s = None if scaled_by is None else scaled_by[None, :]
    for rows in row_chunks(n_out, n_in):
        wc = _rows64(weight, rows) if s is None else _rows64(weight, rows) * s
        if clip is not None:
            lim = clip[rows][:, gidx]
            wc = np.clip(wc, -lim, lim, out=wc if wc.base is None else None)
            del lim
        sc, z = spec.params_from_range(np.minimum.reduceat(wc, starts, axis=1), np.maximum.reduceat(wc, starts, axis=1),
                                       qmin, qmax)
        c, d = spec.quantize(wc, sc[:, gidx], z[:, gidx])
        yield rows, c, d, sc, z


def rtn_quantize(weight: Any, spec: QuantSpec, *, scaled_by: Any = None, clip: Any = None) -> QuantizedWeight:
    """Round to nearest (the baseline of GPTQ and AWQ): per group of ``spec.group_size`` input columns of
    each row, scale / zero point from the group's min and max, then ``round`` (half to even) and clip.
    GPTQ with ``H = I`` gives exactly this. ``scaled_by`` (``[in]``) / ``clip`` (``[out, n_groups]``
    limits): quantize ``clip(W * scaled_by, -clip, clip)`` instead (AWQ, :func:`awq_quantize`); rows are
    handled in chunks (:func:`row_chunks`), each row on its own."""
    w = _weight(weight, copy=False)
    s = None if scaled_by is None else np.asarray(scaled_by, dtype=np.float64)
    lim = None if clip is None else np.asarray(clip, dtype=np.float64)
    return _rtn_fill(w, spec, s, lim)[0]


def _rtn_fill(w: np.ndarray, spec: QuantSpec, s: np.ndarray | None, lim: np.ndarray | None,
              keep_dequantized: bool = True, effective: bool = False) -> tuple[QuantizedWeight, np.ndarray | None]:
    """:func:`rtn_quantize`'s result filled chunk of rows by chunk of rows (:func:`_rtn_rows`), and with
    ``effective`` also ``dequantized / s`` (AWQ's effective weight); ``keep_dequantized=False`` leaves the
    result's ``dequantized`` None."""
    n_out, n_in = w.shape
    gs = spec.group_width(n_in)
    n_groups = len(_group_starts(n_in, gs))
    codes = np.empty((n_out, n_in), dtype=spec.code_dtype)
    scale = np.empty((n_out, n_groups))
    zp = np.empty((n_out, n_groups))
    deq = np.empty((n_out, n_in)) if keep_dequantized else None
    eff = np.empty((n_out, n_in)) if effective else None
    for rows, c, d, sc, z in _rtn_rows(w, spec, s, lim):
        codes[rows], scale[rows], zp[rows] = c, sc, z
        if deq is not None:
            deq[rows] = d
        if eff is not None:
            np.divide(d, s[None, :], out=eff[rows])
    return QuantizedWeight(codes=codes, scale=scale, zero_point=zp, group_size=gs, spec=spec, dequantized=deq), eff


def gptq_quantize(weight: Any, hessian: Any, spec: QuantSpec, *, damp: float = DEFAULT_DAMP,
                  block_size: int = DEFAULT_BLOCK_SIZE, act_order: bool = False, mask: Any = None) -> QuantizedWeight:
    """GPTQ (Frantar et al. 2022, Alg. 1): quantize ``weight`` ``[out, in]`` column by column, spreading each
    column's rounding error ``(w_j - q_j) / U_jj`` over the later columns with ``U`` (upper Cholesky factor
    of the damped ``H^-1``, ``hessian`` = the Gram matrix ``sum x^T x``), in lazy blocks of ``block_size``.

    * Groups (``spec.group_size``) are consecutive *original* input columns. A group's scale / zero point
      are computed when the sweep reaches the group's first column, from the group's up-to-date values
      (all corrections so far applied), as the reference does (its values are up to date when groups
      start at block starts, e.g. the default 128 / 128; when a group starts inside a block the reference
      reads stale values, we do not).
    * ``act_order``: columns are swept by decreasing ``diag(H)`` (ties: lower index first); the groups stay
      those of the original column order, each one's parameters computed when the sweep first reaches any
      of its columns, from all its columns' up-to-date values at that moment (none is fixed yet). So the
      result stores like the plain case (no ``g_idx``), and with a diagonal ``H`` it equals RTN exactly.
    * ``mask`` (bool keep-mask ``[out, in]``, e.g. from SparseGPT 2:4): masked weights are set to 0, are
      never corrected, and stay exactly 0 (code = zero point), as llmcompressor's GPTQ on a sparse model.
    * dead inputs (``H_jj == 0``) get weight 0 (reference behaviour); see :func:`damp_hessian`.

    With ``H = I`` (or any diagonal ``H``) nothing is corrected and the result is :func:`rtn_quantize`
    bit for bit.
    """
    bs = _block_size(block_size)
    w, hd, dead, keep, diag0 = _prepare(weight, hessian, damp, mask)
    out, n_in = w.shape
    gs = spec.group_width(n_in)
    n_groups = -(-n_in // gs)
    perm = np.argsort(-diag0, kind="stable") if act_order else np.arange(n_in)
    inv = np.empty(n_in, dtype=np.intp)
    inv[perm] = np.arange(n_in)
    gid = perm // gs  # group of the column at each sweep position
    box = [hd[np.ix_(perm, perm)] if act_order else hd]
    del hd
    ut = _inverse_factor_t(box, damp)
    if act_order:
        w = w[:, perm]
        keep = None if keep is None else keep[:, perm]
    sweep = _Sweep(np.ascontiguousarray(w.T), ut, None if keep is None else np.ascontiguousarray(keep.T), bs)
    del w, ut
    scale = np.zeros((n_groups, out))
    zp = np.zeros((n_groups, out))
    have = np.zeros(n_groups, dtype=bool)
    codes_t = np.zeros((n_in, out), dtype=spec.code_dtype)
    deq_t = sweep.w  # row p is final once fixed and never read again: the dequantized values go over it
    for i1 in range(0, n_in, bs):
        i2 = min(i1 + bs, n_in)
        sweep.start_block(i1)
        for p in range(i1, i2):
            g = gid[p]
            if not have[g]:
                pos = inv[g * gs:min((g + 1) * gs, n_in)]  # every one >= p: none fixed yet
                vals = sweep.current(pos, i1, p)  # [columns, out]
                sc, z = spec.params_from_range(vals.min(axis=0), vals.max(axis=0), *spec.qrange)
                scale[g], zp[g], have[g] = sc, z, True
            wc = sweep.current(p, i1, p)
            c, dq = spec.quantize(wc, scale[g], zp[g])
            if sweep.keep is not None:
                c = np.where(sweep.keep[p], c, zp[g])
                dq = np.where(sweep.keep[p], dq, 0.0)
            sweep.fix(p, wc, dq)
            codes_t[p], deq_t[p] = c, dq  # after fix: wc may be a view of this very row
        sweep.end_block(i1, i2)
    if act_order:
        codes_t, deq_t = codes_t[inv], deq_t[inv]
    return QuantizedWeight(codes=np.ascontiguousarray(codes_t.T), scale=np.ascontiguousarray(scale.T),
                           zero_point=np.ascontiguousarray(zp.T), group_size=gs, spec=spec,
                           dequantized=np.ascontiguousarray(deq_t.T), error=sweep.error,
                           perm=perm if act_order else None, dead=dead)


# ------------------------------------------------------------------------------------------------- AWQ
def awq_grid(n_grid: int = AWQ_N_GRID) -> np.ndarray:
    """``n_grid`` exponents spanning ``[0, 1]``: ``alpha = i / (n_grid - 1)`` (``[0.0]`` for one point)."""
    if isinstance(n_grid, bool) or not isinstance(n_grid, (int, np.integer)) or n_grid < 1:
        raise ValueError(f"n_grid must be a positive int, got {n_grid!r}")
    return np.arange(n_grid) / max(int(n_grid) - 1, 1)


#: ``duo_scaling`` values: True (default), False, or 'both'
AWQ_DUO_CHOICES = (True, False, "both")


def awq_candidates(n_grid: int = AWQ_N_GRID, duo_scaling: bool | str = True) -> list[tuple[float, bool]]:
    """The ``(alpha, duo)`` points AWQ's search scores, ``n_grid`` of them, the grid of llmcompressor 0.14 (the
    reference most users compare with): ``duo_scaling=True``: the identity (``alpha = 0`` without duo
    scaling: plain round to nearest, so the search never ends worse than RTN on its own loss) then
    ``n_grid - 1`` duo-scaled exponents spanning ``[0, 1]``; ``False``: ``n_grid`` exponents spanning
    ``[0, 1]``, activation statistics only; ``'both'``: ``n_grid // 2`` exponents spanning ``[0, 1]``, each
    without then with duo scaling. (AutoAWQ's original grid, ``i / n_grid`` for ``i < n_grid`` with duo
    scaling, stops short of 1 and has no identity point.)"""
    awq_grid(n_grid)  # validates
    if duo_scaling is True:
        return [(0.0, False)] + [(float(a), True) for a in awq_grid(max(int(n_grid) - 1, 1))]
    if duo_scaling is False:
        return [(float(a), False) for a in awq_grid(n_grid)]
    if duo_scaling == "both":
        return [(float(a), d) for a in awq_grid(max(int(n_grid) // 2, 1)) for d in (False, True)]
    raise ValueError(f"duo_scaling must be one of {list(AWQ_DUO_CHOICES)}, got {duo_scaling!r}")


def awq_weight_mean(weight: Any, group_size: int | None = None) -> np.ndarray:
    """AutoAWQ's weight statistic for ``duo`` scaling: ``|W|`` normalised by each group's max ``|W|`` (per
    row, groups of ``group_size`` input columns), then averaged over the output rows: ``[in]``. ``weight``
    may be a list of weights with the same inputs (q / k / v): the mean over all their rows, as of their
    concatenation (row chunks summed in row order: the same bits, without the concatenated copy)."""
    several = isinstance(weight, (list, tuple)) and bool(weight) and all(np.ndim(w) == 2 for w in weight)
    parts = [_weight(w, copy=False) for w in weight] if several else [_weight(weight, copy=False)]
    n_in = parts[0].shape[1]
    if any(p.shape[1] != n_in for p in parts):
        raise ValueError(f"weights must share their input dimension, got shapes {[p.shape for p in parts]}")
    gs = n_in if group_size is None or group_size == -1 or group_size >= n_in else int(group_size)
    starts = _group_starts(n_in, gs)
    gidx = np.arange(n_in) // gs
    total, n_rows = None, 0
    for w in parts:
        for rows in row_chunks(*w.shape):
            a = np.abs(_rows64(w, rows))
            gmax = np.maximum.reduceat(a, starts, axis=1)[:, gidx]
            a /= np.where(gmax > 0, gmax, 1.0)
            del gmax
            if total is not None:
                a[0] += total  # numpy sums axis 0 row after row: carrying the sum keeps the whole-array bits
            total = a.sum(axis=0)
            n_rows += a.shape[0]
    return total / n_rows


def awq_scales(x_abs_mean: Any, alpha: float, w_mean: Any = None) -> np.ndarray:
    """AWQ's per-input-channel scales for one ``alpha`` (Lin et al. 2023, eq. 5):
    ``s_j = max(mean|X_j|^alpha, 1e-4)``, or with ``w_mean`` (duo scaling, AutoAWQ / llmcompressor's
    default) ``s_j = max(mean|X_j|^alpha / (w_mean_j^(1 - alpha) + 1e-4), 1e-4)``; then normalised by
    ``sqrt(max(s) * min(s))`` so the scales straddle 1. ``alpha = 0`` without ``w_mean``: all ones (RTN)."""
    x = np.asarray(x_abs_mean, dtype=np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)) or np.any(x < 0):
        raise ValueError("x_abs_mean must be a 1-D array of finite values >= 0 (mean |x| per input channel)")
    s = x ** float(alpha)
    if w_mean is not None:
        wm = np.asarray(w_mean, dtype=np.float64)
        if wm.shape != x.shape:
            raise ValueError(f"w_mean must have the shape of x_abs_mean {x.shape}, got {wm.shape}")
        s = s / (wm ** (1.0 - float(alpha)) + AWQ_MIN_SCALE)
    s = np.maximum(s, AWQ_MIN_SCALE)
    return s / np.sqrt(s.max() * s.min())


@dataclass(frozen=True)
class AwqWeight:
    """``quantized``: the RTN quantization of ``W * s`` (``s`` broadcast over the input columns): what is
    stored, with ``1 / s`` folded into whatever produces the layer's input (the previous norm / linear) or
    applied to the input; ``scales``: ``s``; ``effective``: ``Q(W s) / s``, the weight the layer acts with."""

    quantized: QuantizedWeight
    scales: np.ndarray
    effective: np.ndarray


def _awq_scales_arg(scales: Any, n_in: int) -> np.ndarray:
    s = np.asarray(scales, dtype=np.float64)
    if s.shape != (n_in,) or not np.all(np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"scales must be {n_in} finite positive values (one per input column)")
    return s


def awq_quantize(weight: Any, scales: Any, spec: QuantSpec, clip: Any = None, *,
                 keep_dequantized: bool = True) -> AwqWeight:
    """AWQ's scaled round to nearest: ``Q(W * s) / s`` with ``Q`` = :func:`rtn_quantize` (salient input
    channels, large ``s``, lose less to rounding). ``clip``: ``[out, n_groups]`` limits (from
    :func:`awq_clip_search`): ``W * s`` is clamped to ``[-limit, limit]`` per group before rounding.
    ``keep_dequantized=False``: the result's ``quantized.dequantized`` (``Q(W s)``) is None, one weight-sized
    float64 array less for a caller that needs only the codes and ``effective`` (the one-shot driver)."""
    w = _weight(weight, copy=False)
    s = _awq_scales_arg(scales, w.shape[1])
    lim = None if clip is None else np.asarray(clip, dtype=np.float64)
    qw, eff = _rtn_fill(w, spec, s, lim, keep_dequantized, effective=True)
    return AwqWeight(quantized=qw, scales=s, effective=eff)


def awq_effective(weight: Any, scales: Any, spec: QuantSpec) -> np.ndarray:
    """``awq_quantize(weight, scales, spec).effective`` (``Q(W s) / s``) alone, row chunk by row chunk: what the
    AWQ search scores for each candidate, without the codes / dequantized copies of the weight."""
    w = _weight(weight, copy=False)
    s = _awq_scales_arg(scales, w.shape[1])
    eff = np.empty(w.shape)
    for rows, _, d, _, _ in _rtn_rows(w, spec, s, None):
        np.divide(d, s[None, :], out=eff[rows])
    return eff


def awq_clip_ratios(n_grid: int = AWQ_CLIP_GRID, max_shrink: float = AWQ_CLIP_MAX_SHRINK) -> np.ndarray:
    """The clipping search's ratios of a group's largest magnitude: ``1 - i / n_grid`` for ``i <
    max_shrink * n_grid`` (AutoAWQ's grid; 1.0 first: no clipping, plain round to nearest)."""
    return 1.0 - np.arange(max(1, int(max_shrink * n_grid))) / n_grid


def awq_clip_search(weight: Any, gram: Any, scales: Any, spec: QuantSpec, ratios: Any = None) -> np.ndarray:
    """AWQ's weight clipping (AutoAWQ's ``auto_clip``, after the scales are chosen): per output row and
    input group of ``W * s``, the limit ``ratio * max|group|`` (ratios: :func:`awq_clip_ratios`) whose round to
    nearest minimises that group's share of the output error, ``d_g H'_gg d_g^T`` with ``d_g`` the group's
    weights minus their clipped, quantized values and ``H' = diag(1/s) H diag(1/s)`` the Gram matrix of the
    scaled input ``X / s`` (the error over EVERY calibration token, exactly; AutoAWQ estimates it on 512 sampled
    tokens). Ties keep the larger limit. Returns the ``[out, n_groups]`` limits for :func:`awq_quantize`."""
    w = _weight(weight, copy=False)
    s = np.asarray(scales, dtype=np.float64)
    n_out, n_in = w.shape
    h = np.asarray(gram, dtype=np.float64)
    if h.shape != (n_in, n_in) or not np.all(np.isfinite(h)):
        raise ValueError(f"gram must be a finite [{n_in}, {n_in}] matrix, got shape {h.shape}")
    gs = spec.group_width(n_in)
    starts = _group_starts(n_in, gs)
    # the diagonal blocks of diag(1/s) H diag(1/s), one per group (the whole scaled matrix is never formed)
    blocks = [h[a:a + gs, a:a + gs] / s[a:a + gs, None] / s[None, a:a + gs] for a in starts]
    gidx = np.arange(n_in) // gs
    ratios = awq_clip_ratios() if ratios is None else np.asarray(ratios, dtype=np.float64)
    out = np.empty((n_out, len(starts)))
    # rows are independent (each row's groups have their own range): in chunks of rows (row_chunks)
    for rows in row_chunks(n_out, n_in):
        ws = _rows64(w, rows) * s[None, :]
        amax = np.maximum.reduceat(np.abs(ws), starts, axis=1)
        best_lim = amax.copy()
        best_err = np.full(amax.shape, np.inf)
        for r in ratios:
            lim = (amax * r)[:, gidx]
            d = ws - rtn_quantize(np.clip(ws, -lim, lim), spec).dequantized
            del lim
            err = np.empty_like(amax)
            for g, a in enumerate(starts):
                dg = d[:, a:a + gs]
                err[:, g] = np.einsum("ij,ij->i", dg @ blocks[g], dg)
            better = err < best_err
            best_err = np.where(better, err, best_err)
            best_lim = np.where(better, amax * r, best_lim)
        out[rows] = best_lim
    return out


@dataclass(frozen=True)
class AwqSearch:
    """The grid search's outcome: the chosen ``alpha``, whether it was duo-scaled (``duo``) and its ``scales``,
    and every ``(alpha, duo, loss)`` tried."""

    alpha: float
    scales: np.ndarray
    losses: list[tuple[float, bool, float]]
    duo: bool = False


def awq_search(x_abs_mean: Any, loss: Callable[[np.ndarray], float], n_grid: int = AWQ_N_GRID,
               w_mean: Any = None, duo_scaling: bool | str = True) -> AwqSearch:
    """AWQ's grid search: for each ``(alpha, duo)`` of :func:`awq_candidates` (``duo_scaling`` applies only
    with ``w_mean``; without it the grid is the activation-only one), ``loss(awq_scales(x_abs_mean, alpha,
    w_mean if duo))`` (the backend applies the scales with :func:`awq_quantize` to the block's layers that share
    this input, runs their parent module on the cached calibration inputs and returns the output error vs the
    unquantized module; :func:`awq_linear_loss` is the single-Linear form); the smallest loss wins, ties to the
    earlier candidate. A NaN / inf loss is a ValueError."""
    best: tuple[float, float, bool, np.ndarray] | None = None
    tried = []
    for a, duo in awq_candidates(n_grid, duo_scaling if w_mean is not None else False):
        s = awq_scales(x_abs_mean, a, w_mean if duo else None)
        val = float(loss(s))
        if not math.isfinite(val):
            raise ValueError(f"AWQ loss at alpha={a:g} is {val}: the block's output is not finite")
        tried.append((a, duo, val))
        if best is None or val < best[0]:
            best = (val, a, duo, s)
    assert best is not None
    return AwqSearch(alpha=best[1], scales=best[3], losses=tried, duo=best[2])


def layer_output_error(x: Any, weight: Any, new_weight: Any) -> float:
    """``||X W^T - X W'^T||_F^2`` for input rows ``x`` ``[..., in]``: the error every method here minimises."""
    xa = np.asarray(x, dtype=np.float64)
    xa = xa.reshape(-1, xa.shape[-1])
    d = np.asarray(weight, dtype=np.float64) - np.asarray(new_weight, dtype=np.float64)
    e = xa @ d.T
    return float(np.sum(e * e))


def awq_linear_loss(x: Any, weight: Any, scales: Any, spec: QuantSpec) -> float:
    """The reference AWQ loss of one Linear: ``||X W^T - X (Q(W s) / s)^T||_F^2``."""
    return layer_output_error(x, weight, awq_quantize(weight, scales, spec).effective)
