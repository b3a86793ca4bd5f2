"""One-shot pruning math: Wanda's scores and masks (Sun et al. 2023) and SparseGPT's OBS pruning with weight
updates (Frantar & Alistarh 2023), unstructured or N:M."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..pruning import nm_group_rank
from ..selection import prune_count, smallest_k_mask
from .arrays import (
    _NP,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_DAMP,
    _block_size,
    _check_nm_width,
    _sparsity_or_pattern,
    _weight,
)
from .linalg import _inverse_factor_t, _prepare, _Sweep


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
    wt, hd, dead, _, _ = _prepare(weight, hessian, damp)
    n_in, out = wt.shape
    if nm is not None:
        _check_nm_width(n_in, nm[1], sparse_pattern)  # type: ignore[arg-type]
        if bs % nm[1]:
            raise ValueError(f"block_size {bs} must be a multiple of M={nm[1]} of sparse_pattern {sparse_pattern!r}")
    box = [hd]
    del hd
    sweep = _Sweep(wt, _inverse_factor_t(box, damp), None, bs)
    del wt
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
    return SparseGPTResult(weight=result_t.T, mask=np.ascontiguousarray(keep_t.T),
                           error=sweep.error, dead=dead)

