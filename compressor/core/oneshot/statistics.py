"""A layer's input statistics over the calibration tokens (:class:`GramAccumulator`): the Gram matrix
``H = sum_t x_t^T x_t``, the per-channel sums of squares (Wanda's ``||X_j||``) and of magnitudes (AWQ's
``mean|X_j|``). They are sums, so partial sums from several processes add up to the single-process result."""

from __future__ import annotations

from typing import Any

import numpy as np

from .arrays import _float32_valued
from .memory import own_pages

#: rows per float32 Gram product (:meth:`GramAccumulator.add`): bounds the float32 rounding of one partial sum
GRAM_F32_ROWS = 1024
#: float64 values per row chunk of the per-channel sums of :meth:`GramAccumulator.add` (512 KiB)
SUM_CHUNK_VALUES = 1 << 16
#: columns per block of the Gram products of :meth:`GramAccumulator.add` (bounds their temporaries)
GRAM_COLS = 256


class RowSource:
    """A batch of ``rows`` input rows of ``width`` values that :meth:`GramAccumulator.add` reads a slice at a time,
    ``get(i, j)`` giving rows ``i:j`` as a C-contiguous float32 (or float64) array: a backend hands a half-precision
    activation over this way, each slice widened when it is read, instead of a float32 copy of the whole batch
    (88 MiB for a batch of 8 x 512 tokens into a 5632-wide down projection). The result is the same as ``add``
    of the whole float32 array, bit for bit: the slices read are those ``add`` takes of an array."""

    def __init__(self, rows: int, width: int, get: Any, dtype: Any = np.float32):
        self.rows, self.width, self.get, self.dtype = int(rows), int(width), get, np.dtype(dtype)


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

    The Gram matrix is kept as its upper part: column block ``b`` (columns ``j:j1`` of :data:`GRAM_COLS`) holds
    rows ``0:j1`` of them, each block in pages of its own (:attr:`gram_blocks`). That is every value the
    products add (the part below the diagonal blocks received the transposes of the same numbers, so it is
    their mirror, bit for bit), in 0.5-0.55 of the matrix's bytes: 127 MiB instead of 242 for a 5632-wide down
    projection, for the whole observing pass. :attr:`gram` and :meth:`gram_for_solver` give the full matrix.
    """

    def __init__(self, in_features: int, gram: bool = True):
        if isinstance(in_features, bool) or not isinstance(in_features, (int, np.integer)) or in_features < 1:
            raise ValueError(f"in_features must be a positive int, got {in_features!r}")
        self.in_features = int(in_features)
        self.count = 0
        self._cols = GRAM_COLS
        self._blocks: list[np.ndarray] | None = (
            [own_pages((min(j + self._cols, self.in_features), min(self._cols, self.in_features - j)))
             for j in range(0, self.in_features, self._cols)] if gram else None)
        self._sq = np.zeros(self.in_features)
        self.abs_sum = np.zeros(self.in_features)
        #: set by the driver when no later layer reads this accumulator (see :meth:`gram_for_solver`)
        self.consumable = False

    def add(self, x: Any) -> None:
        """Accumulate a batch of input rows ``x`` (``[..., in]``, or a :class:`RowSource`); NaN / inf or a wrong
        width is a ValueError, and then nothing is added.

        The Gram matrix of rows that are float32 values (float32 input, or float64 input whose every value is a
        float32: what a float32 model computes, whichever dtype the backend hands over) is computed as float32
        products of at most :data:`GRAM_F32_ROWS` rows each, summed into the float64 ``gram`` (half the time of
        a float64 product; the references accumulate in float32 throughout). Other rows are multiplied in
        float64. So the result depends on the values and their grouping into ``add`` calls only, not on the
        dtype a backend passes. ``sq_sum`` / ``abs_sum`` are float64 sums of the float64 values."""
        if isinstance(x, RowSource):
            if x.width != self.in_features:
                raise ValueError(f"layer input must end with the layer's input dimension {self.in_features}, "
                                 f"got width {x.width}")
            if x.dtype != np.float32:  # float64 rows: whether all are float32 values decides, on the whole batch
                x = x.get(0, x.rows)
        if isinstance(x, RowSource):
            n, take, low, chunked = x.rows, x.get, x.get, self.in_features >= 2
        else:
            a = np.asarray(x)
            if a.dtype != np.float32:
                a = np.asarray(a, dtype=np.float64)
            if a.ndim == 0 or a.shape[-1] != self.in_features:
                raise ValueError(f"layer input must end with the layer's input dimension {self.in_features}, "
                                 f"got shape {a.shape}")
            a = a.reshape(-1, self.in_features)
            n = a.shape[0]

            def take(i: int, j: int) -> np.ndarray:
                return a[i:j]
            low = None
            if self._blocks is not None:
                # float32-valued rows? (the first row decides for most float64 rows, without a float32 copy of all)
                la = a if a.dtype == np.float32 else None
                if la is None and _float32_valued(a[:1]):
                    la = a.astype(np.float32)
                    la = la if np.array_equal(la, a) else None
                if la is not None:
                    def low(i: int, j: int) -> np.ndarray:
                        return la[i:j]
            chunked = self.in_features >= 2 and a.flags.c_contiguous
        # the per-channel sums over row chunks (no float64 copy of the whole batch: two of them were the
        # largest transients of a calibration pass, 24 MiB for a 2048 x 768 float32 input), where that
        # reproduces the whole-array sums bit for bit: numpy sums a C-contiguous [rows, >= 2] array's axis 0
        # row after row, and each chunk's first row carries the sum so far
        step = max(1, SUM_CHUNK_VALUES // self.in_features) if chunked else max(n, 1)
        if not all(np.isfinite(take(i, i + step)).all() for i in range(0, n, step)):
            raise ValueError("calibration inputs contain NaN or inf")
        if self._blocks is not None:
            if low is not None:
                for i in range(0, n, GRAM_F32_ROWS):
                    self._add_product(low(i, i + GRAM_F32_ROWS))
            else:
                self._add_product(np.asarray(take(0, n), dtype=np.float64))
        if not chunked:
            a64 = np.asarray(take(0, n), dtype=np.float64)
            if self._blocks is None:
                self._sq += np.einsum("ti,ti->i", a64, a64)
            self.abs_sum += np.abs(a64).sum(axis=0)
        else:
            abs_acc = sq_acc = None
            for i in range(0, n, step):
                c64 = np.asarray(take(i, i + step), dtype=np.float64)
                if self._blocks is None:
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
        self.count += n

    def _add_product(self, c: np.ndarray) -> None:
        """``gram += c^T c`` in column blocks of :data:`GRAM_COLS`: each block's product is computed once, for the
        rows above it and its diagonal block, and added to that block of the upper part, so the largest
        temporary is ``[in, GRAM_COLS]``, not a second ``[in, in]`` matrix (for a 768-wide layer 1.5 MiB
        instead of 4.5; for an 11008-wide one 22 MiB instead of 924)."""
        n = self.in_features
        for b, j in enumerate(range(0, n, self._cols)):
            j1 = min(j + self._cols, n)
            self._blocks[b] += c[:, :j1].T @ c[:, j:j1]  # type: ignore[index]

    def _full(self, consume: bool) -> np.ndarray:
        """The full ``[in, in]`` Gram matrix from the upper part (the part below mirrored: exactly symmetric);
        ``consume``: each block is given up once copied (the matrix plus one block at the peak, not two)."""
        blocks = self._blocks
        assert blocks is not None
        n = self.in_features
        g = own_pages((n, n))
        for b, j in enumerate(range(0, n, self._cols)):
            u = blocks[b]
            j1 = j + u.shape[1]
            g[:j1, j:j1] = u
            if j:
                g[j:j1, :j] = u[:j].T
            if consume:
                blocks[b] = None  # type: ignore[call-overload]
                del u
        if consume:
            self._blocks = None
        return g

    @property
    def gram(self) -> np.ndarray | None:
        """``H = sum_t x_t^T x_t`` as a full ``[in, in]`` float64 matrix (a new array each time; None when made
        with ``gram=False`` or given up)."""
        return None if self._blocks is None else self._full(consume=False)

    @gram.setter
    def gram(self, value: Any) -> None:
        """None: give the Gram matrix up; a symmetric ``[in, in]`` array: keep its upper part."""
        if value is None:
            self._blocks = None
            return
        g = np.asarray(value, dtype=np.float64)
        n = self.in_features
        if g.shape != (n, n):
            raise ValueError(f"a Gram matrix of this accumulator is [{n}, {n}], got shape {g.shape}")
        self._blocks = [np.array(g[:min(j + self._cols, n), j:min(j + self._cols, n)])
                        for j in range(0, n, self._cols)]

    @property
    def gram_blocks(self) -> list[np.ndarray] | None:
        """The upper part's column blocks as kept (summed across processes and written to a spill file as they
        are): block ``b`` is ``gram[:j1, j:j1]`` for columns ``j:j1``."""
        return self._blocks

    @gram_blocks.setter
    def gram_blocks(self, blocks: list[np.ndarray] | None) -> None:
        self._blocks = blocks

    def gram_for_solver(self) -> list[np.ndarray] | None:
        """What GPTQ / SparseGPT take as ``hessian``: ``[H]``, a full matrix of the solver's own that it damps and
        factors in place (no copy of it). Once the driver has set ``consumable`` (no later layer reads this
        accumulator) the accumulator gives its upper part up while the matrix is built, so the widest layer's
        peak holds one ``in x in`` float64 matrix."""
        if self._blocks is None:
            return None
        return [self._full(consume=self.consumable)]

    @property
    def sq_sum(self) -> np.ndarray:
        """``sum_t x_tj^2`` per input channel (``diag(H)`` in Gram mode)."""
        if self._blocks is None:
            return self._sq.copy()
        n = self.in_features
        return np.concatenate([np.diag(u[j:j + u.shape[1]]) for u, j in zip(self._blocks, range(0, n, self._cols))])

    def _need_rows(self) -> None:
        if self.count == 0:
            raise ValueError("no calibration rows were accumulated (empty calibration set?)")

    def mean(self) -> np.ndarray:
        """``H / count``: the mean of ``x^T x`` over the rows."""
        self._need_rows()
        g = self.gram
        if g is None:
            raise ValueError("this accumulator was made with gram=False: it has no Gram matrix")
        return np.divide(g, self.count, out=g)

    def channel_norms(self) -> np.ndarray:
        """Wanda's ``||X_j||_2 = sqrt(sum_t x_tj^2)`` per input channel."""
        return np.sqrt(self.sq_sum)

    def abs_mean(self) -> np.ndarray:
        """AWQ's activation statistic ``mean_t |x_tj|`` per input channel."""
        self._need_rows()
        return self.abs_sum / self.count

