"""Weight-only quantization solvers: round to nearest per group (RTN) and GPTQ (Frantar et al. 2022), OBS
error feedback column by column, optional act-order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from .arrays import DEFAULT_BLOCK_SIZE, DEFAULT_DAMP, _block_size, _rows64, _weight, row_chunks
from .codes import QuantizedWeight, QuantSpec
from .linalg import _inverse_factor_t, _prepare, _Sweep


def _group_starts(n_in: int, gs: int) -> np.ndarray:
    return np.arange(0, n_in, gs)


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
    wt, hd, dead, keep, diag0 = _prepare(weight, hessian, damp, mask)
    n_in, out = wt.shape
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
        wt = wt[perm]
        keep = None if keep is None else keep[:, perm]
    sweep = _Sweep(wt, ut, None if keep is None else np.ascontiguousarray(keep.T), bs)
    del wt, ut
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
                           dequantized=deq_t.T, error=sweep.error,
                           perm=perm if act_order else None, dead=dead)

