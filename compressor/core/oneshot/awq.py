"""AWQ's math (Lin et al. 2023): per-input-channel scales ``s = mean|X|^alpha`` (duo scaling: divided by the
weights' normalised magnitude ``^(1 - alpha)``), the grid of candidates, round to nearest of ``W s``, and the
clipping search per group (AutoAWQ's ``auto_clip``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .arrays import _rows64, _weight, row_chunks
from .codes import QuantizedWeight, QuantSpec
from .quantize import _group_starts, _rtn_fill, _rtn_rows, rtn_quantize

AWQ_N_GRID = 20
#: AWQ's weight clipping search (AutoAWQ's ``auto_clip``): ratios ``1 - i / AWQ_CLIP_GRID`` for
#: ``i < AWQ_CLIP_MAX_SHRINK * AWQ_CLIP_GRID`` of each group's largest magnitude (1.0, 0.95, ..., 0.55)
AWQ_CLIP_GRID = 20
AWQ_CLIP_MAX_SHRINK = 0.5
AWQ_MIN_SCALE = 1e-4  # the AWQ reference's clamp of mean|x|^alpha


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

