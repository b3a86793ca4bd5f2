"""Argument checks and row chunking shared by the one-shot solvers (numpy, float64).

Every solver takes numpy arrays in the canonical ``[out, in]`` layout; these helpers check and copy them once
at the entry (no solver modifies its inputs) and cut the row-independent computations into chunks of rows, so
their temporaries stay a few chunks, not a few copies of the weight."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ..ops import NumpyOps
from ..sparse_pattern import parse_sparse_pattern

_NP = NumpyOps()
DEFAULT_DAMP = 0.01
DEFAULT_BLOCK_SIZE = 128
#: values per row chunk of the row-independent weight computations (:func:`row_chunks`: 512 KiB float64)
ROW_CHUNK_VALUES = 1 << 16


class Handed:
    """A weight handed to a solver with the caller's only reference (:func:`_weight` takes the array out): a
    solver that copies it (GPTQ, SparseGPT) lets it go once copied, not at its return."""

    __slots__ = ("array",)

    def __init__(self, array: np.ndarray):
        self.array: np.ndarray | None = array


def _weight(weight: Any, what: str = "weight", copy: bool = True) -> np.ndarray:
    """A :class:`Handed` weight is taken out of its box (the box is emptied).
    ``weight`` as a checked float64 ``[out, in]`` array: a copy, or with ``copy=False`` the array itself where it
    is float32 or float64 (for callers that only read it, a chunk of rows at a time, widened to float64 there:
    :func:`_rows64`)."""
    if isinstance(weight, Handed):
        box = weight
        weight, box.array = box.array, None
        if weight is None:
            raise ValueError(f"{what}: this Handed weight was taken already")
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


def _float32_valued(a: np.ndarray) -> bool:
    """True when every value of ``a`` is a float32 value (rounding to float32 and back changes nothing)."""
    return bool(np.array_equal(a.astype(np.float32), a))


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

