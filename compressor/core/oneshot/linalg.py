"""The damped inverse Hessian and the OBS column sweep SparseGPT and GPTQ share.

When column ``j`` is fixed to ``q_j`` (pruned to 0 or quantized), the not-yet-fixed columns ``k > j`` of the same
row are corrected by ``-(w_j - q_j) / U_jj * U_jk`` where ``U`` is the upper Cholesky factor of the damped ``H^-1``
(``H^-1 = U^T U``; Frantar et al., GPTQ 2022, Alg. 1; SparseGPT 2023, Alg. 1), lazily: inside a block of
``block_size`` columns per column (a mat-vec), to the later columns once per block (a GEMM), as the references
do. ``U`` comes from one Cholesky of ``H`` (reversed) and one triangular inverse (:func:`hessian_factor`), both
computed in place in the Gram matrix handed over. Every row is swept at once (no Python loop over rows)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .arrays import DEFAULT_DAMP, _hessian, _mask, _weight


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
#: below this width a triangular factor is multiplied as a full matrix (its zeros too): one GEMM beats more calls
_TRMM_BASE = 256


def _inv_lower(low: np.ndarray) -> np.ndarray:
    """Inverse of a lower-triangular matrix by halves, ``[[A, 0], [C, D]]^-1 = [[A^-1, 0], [-D^-1 C A^-1,
    D^-1]]``, computed IN PLACE (``low`` is overwritten and returned). The two products with a triangular factor
    skip its zero half (:func:`_right_lower`, :func:`_left_lower`), so the whole costs ``n^3 / 3`` flops in
    matrix products (numpy has no triangular inverse; multiplying by the full halves would cost twice that),
    with no temporary larger than ``n x`` :data:`_FACTOR_BLOCK`."""
    n = low.shape[0]
    if n <= _INV_BASE:
        low[...] = np.tril(np.linalg.inv(low))
        return low
    k = n // 2
    _inv_lower(low[:k, :k])
    _inv_lower(low[k:, k:])
    c = low[k:, :k]
    _right_lower(c, low[:k, :k])  # C A^-1
    _left_lower(low[k:, k:], c)  # D^-1 (C A^-1)
    np.negative(c, out=c)
    return low


def _right_lower(c: np.ndarray, t: np.ndarray) -> None:
    """``c <- c @ t`` in place, ``t`` lower triangular (its upper part is not read): with ``t = [[T1, 0], [T2,
    T3]]`` and ``c = [C1, C2]``, ``c t = [C1 T1 + C2 T2, C2 T3]``, the left half first (it reads the old right
    half). Each row of the product needs only that row of ``c``: temporaries of :data:`_FACTOR_BLOCK` rows."""
    m = t.shape[0]
    step = _FACTOR_BLOCK
    if m <= _TRMM_BASE:
        tl = np.tril(t)
        for r0 in range(0, c.shape[0], step):
            c[r0:r0 + step] = c[r0:r0 + step] @ tl
        return
    h = m // 2
    _right_lower(c[:, :h], t[:h, :h])
    for r0 in range(0, c.shape[0], step):
        c[r0:r0 + step, :h] += c[r0:r0 + step, h:] @ t[h:, :h]
    _right_lower(c[:, h:], t[h:, h:])


def _left_lower(t: np.ndarray, c: np.ndarray) -> None:
    """``c <- t @ c`` in place, ``t`` lower triangular (its upper part is not read): with ``t = [[T1, 0], [T2,
    T3]]`` and ``c = [[C1], [C2]]``, ``t c = [[T1 C1], [T2 C1 + T3 C2]]``, the lower half first (it reads the
    old upper half). Each column of the product needs only that column of ``c``: temporaries of
    :data:`_FACTOR_BLOCK` columns."""
    m = t.shape[0]
    step = _FACTOR_BLOCK
    if m <= _TRMM_BASE:
        tl = np.tril(t)
        for c0 in range(0, c.shape[1], step):
            c[:, c0:c0 + step] = tl @ c[:, c0:c0 + step]
        return
    h = m // 2
    _left_lower(t[h:, h:], c[h:])
    for c0 in range(0, c.shape[1], step):
        c[h:, c0:c0 + step] += t[h:, :h] @ c[:h, c0:c0 + step]
    _left_lower(t[:h, :h], c[:h])


#: later columns corrected per GEMM at the end of a sweep block (:meth:`_Sweep.end_block`)
SWEEP_ROWS = 512


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
        """Apply the block ``[i1, i2)``'s corrections to the later columns: one GEMM per :data:`SWEEP_ROWS` of
        them (each entry the same ``block``-long dot product as in one GEMM; the temporary is bounded, not a
        weight-sized ``[in - i2, out]`` float64 array)."""
        e = self.e[:i2 - i1]
        for r in range(i2, self.w.shape[0], SWEEP_ROWS):
            r1 = min(r + SWEEP_ROWS, self.w.shape[0])
            self.w[r:r1] -= self.ut[r:r1, i1:i2] @ e


def _prepare(weight: Any, hessian: Any, damp: float, mask: Any = None) -> tuple[np.ndarray, np.ndarray,
                                                                                np.ndarray, np.ndarray | None,
                                                                                np.ndarray]:
    """The sweep's float64 copy of the weight, TRANSPOSED (``[in, out]``, C-contiguous: the one weight-sized
    float64 array of a solve; dead / masked columns zeroed) and the damped Hessian; ``dead``; the keep-mask
    (``[out, in]``); ``diag(H)`` before damping (dead entries 1), which ``act_order`` sorts by as the reference
    does. ``weight`` is only read (float32 or float64 values: the copy is float64 either way)."""
    src = _weight(weight, copy=False)
    wt = np.empty(src.shape[::-1])
    wt[...] = src.T
    del src
    h = _hessian(hessian, wt.shape[0])
    keep = _mask(mask, wt.shape[::-1])
    diag0 = np.where(np.diag(h) == 0, 1.0, np.diag(h))
    dead = _damp_inplace(h, damp)
    wt[dead] = 0.0
    if keep is not None:
        wt[~keep.T] = 0.0
    return wt, h, dead, keep, diag0

