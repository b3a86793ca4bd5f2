"""One-shot LM compression math in core (issue 25 step 1): Wanda, SparseGPT, GPTQ, RTN, AWQ on numpy float64.

Hand-worked exact values on tiny matrices, a textbook reference implementation (explicit ``H^-1``, its upper
Cholesky factor, immediate per-column updates: the papers' Algorithm 1) to compare the blocked sweep with, and
the properties the methods promise (less output error than the baselines on correlated inputs, N:M validity,
masks respected, determinism)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor.core import oneshot as O
from compressor.core import pruning as P
from compressor.core.ops import NumpyOps

ops = NumpyOps()


def correlated_inputs(n_rows, n_in, seed=0):
    """Calibration rows with correlated channels and a few large (salient) channels, as in LLM activations."""
    rng = np.random.default_rng(seed)
    mix = np.eye(n_in) + 0.4 * rng.standard_normal((n_in, n_in))
    x = rng.standard_normal((n_rows, n_in)) @ mix
    x[:, :: max(n_in // 4, 1)] *= 8.0
    return x


def gram(x):
    acc = O.GramAccumulator(x.shape[-1])
    acc.add(x)
    return acc.gram


# ------------------------------------------------------------------------------------------- references
def ref_grid(values, bits, symmetric):
    """The test's own grid (per row of ``values``): symmetric narrow ``max|w| / (2^(b-1)-1)``, zp 0; affine
    ``(max - min) / (2^b - 1)`` over a range containing 0, ``zp = round(-min / scale)``."""
    lo = np.minimum(values.min(axis=1), 0.0)
    hi = np.maximum(values.max(axis=1), 0.0)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        return np.maximum(np.maximum(-lo, hi) / qmax, O.codes._q.EPS), np.zeros_like(lo), -qmax, qmax
    qmax = 2**bits - 1
    scale = np.maximum((hi - lo) / qmax, O.codes._q.EPS)
    return scale, np.clip(np.round(-lo / scale), 0, qmax), 0, qmax


def ref_obs(w, h, damp, block_size, decide, order=None, mask=None):
    """Textbook OBS sweep: ``U = chol(H^-1)^T``; fix column j to ``decide(j, W_current, U)``; update every later
    column at once. ``decide`` may read the whole current ``W`` (block / group selection)."""
    w = np.array(w, dtype=np.float64)
    h = np.array(h, dtype=np.float64)
    dead = np.diag(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    if mask is not None:
        w[~mask] = 0.0
    diag0 = np.diag(h).copy()
    h = h + damp * np.mean(np.diag(h)) * np.eye(len(h))
    n = w.shape[1]
    perm = np.arange(n) if order is None else order(diag0)
    inv = np.argsort(perm)
    w, h = w[:, perm], h[np.ix_(perm, perm)]
    m = None if mask is None else mask[:, perm]
    u = np.linalg.cholesky(np.linalg.inv(h)).T
    out = np.zeros_like(w)
    for j in range(n):
        q = decide(j, w, u, perm)
        out[:, j] = q
        err = (w[:, j] - q) / u[j, j]
        upd = np.outer(err, u[j, j + 1:])
        if m is not None:
            upd *= m[:, j + 1:]
        w[:, j + 1:] -= upd
    return out[:, inv]


def ref_sparsegpt(w, h, sparsity=None, nm=None, damp=0.01, block_size=128, scope="block"):
    out_rows, n = np.shape(w)
    keep = np.ones((out_rows, n), dtype=bool)

    def decide(j, wc, u, perm):
        if nm is None and j % block_size == 0:
            j2 = min(j + block_size, n)
            sal = wc[:, j:j2] ** 2 / np.diag(u)[j:j2] ** 2
            width = j2 - j
            if scope == "block":
                k = int(np.floor(out_rows * width * sparsity + 1e-9))
                flat = np.argsort(sal.ravel(), kind="stable")[:k]
                blk = np.ones(sal.size, dtype=bool)
                blk[flat] = False
                keep[:, j:j2] = blk.reshape(sal.shape)
            else:
                k = int(np.floor(width * sparsity + 1e-9))
                for r in range(out_rows):
                    keep[r, j:j2] = True
                    keep[r, j + np.argsort(sal[r], kind="stable")[:k]] = False
        if nm is not None and j % nm[1] == 0:
            sal = wc[:, j:j + nm[1]] ** 2 / np.diag(u)[j:j + nm[1]] ** 2
            for r in range(out_rows):
                keep[r, j:j + nm[1]] = True
                keep[r, j + np.argsort(sal[r], kind="stable")[:nm[1] - nm[0]]] = False
        return np.where(keep[:, j], wc[:, j], 0.0)

    return ref_obs(w, h, damp, block_size, decide), keep


def ref_gptq(w, h, bits, symmetric=True, group_size=None, damp=0.01, act_order=False, mask=None):
    out_rows, n = np.shape(w)
    gs = n if group_size is None or group_size >= n else group_size
    params = {}

    def decide(j, wc, u, perm):
        g = perm[j] // gs
        if g not in params:
            cols = np.flatnonzero(perm // gs == g)
            params[g] = ref_grid(wc[:, cols], bits, symmetric)
        scale, zp, qmin, qmax = params[g]
        q = (np.clip(np.round(wc[:, j] / scale + zp), qmin, qmax) - zp) * scale
        if mask is not None:
            q = np.where(mask[:, perm[j]], q, 0.0)
        return q

    order = (lambda d: np.argsort(-d, kind="stable")) if act_order else None
    return ref_obs(w, h, damp, None, decide, order=order, mask=mask)


# ------------------------------------------------------------------------------------------- statistics
def test_gram_accumulator_exact_values_over_batches_and_leading_axes():
    acc = O.GramAccumulator(2)
    acc.add([[1.0, 2.0], [3.0, -1.0]])
    acc.add(np.array([[[0.0, 2.0]]], dtype=np.float32))  # [batch, seq, in]: one more row
    assert acc.count == 3
    # X^T X with X = [[1, 2], [3, -1], [0, 2]]
    assert acc.gram.tolist() == [[10.0, -1.0], [-1.0, 9.0]]
    assert acc.gram.dtype == np.float64
    assert acc.mean().tolist() == [[10 / 3, -1 / 3], [-1 / 3, 3.0]]
    assert acc.sq_sum.tolist() == [10.0, 9.0]
    assert acc.channel_norms().tolist() == [np.sqrt(10.0), 3.0]
    assert acc.abs_mean().tolist() == [4 / 3, 5 / 3]

    light = O.GramAccumulator(2, gram=False)  # Wanda / AWQ: O(in) memory
    light.add([[1.0, 2.0], [3.0, -1.0], [0.0, 2.0]])
    assert light.gram is None and light.sq_sum.tolist() == [10.0, 9.0] and light.count == 3
    with pytest.raises(ValueError, match="gram=False"):
        light.mean()


def test_gram_of_float32_rows_is_float32_products_summed_in_float64_whatever_dtype_the_backend_passes():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2 * O.statistics.GRAM_F32_ROWS + 6, 16)).astype(np.float32)
    as32, as64 = O.GramAccumulator(16), O.GramAccumulator(16)
    as32.add(x)
    as64.add(x.astype(np.float64).reshape(2, -1, 16))  # float32 values handed over as float64: the same Gram
    assert np.array_equal(as32.gram, as64.gram) and as32.gram.dtype == np.float64
    chunks = [x[i:i + O.statistics.GRAM_F32_ROWS] for i in range(0, len(x), O.statistics.GRAM_F32_ROWS)]
    expected = np.zeros((16, 16))
    for c in chunks:  # three float32 products (1024 + 1024 + 6 rows), summed in float64
        expected += c.T @ c
    assert np.array_equal(as32.gram, expected)
    x64 = x.astype(np.float64)
    assert np.abs(as32.gram - x64.T @ x64).max() <= 1e-5 * np.abs(x64.T @ x64).max()
    assert np.array_equal(as32.abs_sum, np.abs(x64).sum(axis=0))  # the channel sums stay float64 sums
    fine = x64[:7] + 1e-9  # not float32 values: a float64 product
    acc = O.GramAccumulator(16)
    acc.add(fine)
    assert np.array_equal(acc.gram, fine.T @ fine)


@pytest.mark.parametrize("gram", [True, False])
def test_channel_sums_over_row_chunks_equal_the_whole_batch_sums_bit_for_bit(gram):
    rng = np.random.default_rng(4)
    width = 96
    rows = 3 * (O.statistics.SUM_CHUNK_VALUES // width) + 5  # four chunks
    x = (rng.standard_normal((rows, width)) * rng.standard_normal(width) ** 3).astype(np.float32)
    x64 = x.astype(np.float64)
    acc = O.GramAccumulator(width, gram=gram)
    acc.add(x[:3])
    acc.add(x.reshape(1, rows, width))
    assert np.array_equal(acc.abs_sum, np.abs(x64[:3]).sum(axis=0) + np.abs(x64).sum(axis=0))
    if not gram:
        assert np.array_equal(acc.sq_sum, np.einsum("ti,ti->i", x64[:3], x64[:3]) + np.einsum("ti,ti->i", x64, x64))
    bad = x.copy()
    bad[-1, 0] = np.inf  # in the last chunk: nothing of the batch is added
    before = (acc.abs_sum.copy(), acc.sq_sum.copy(), acc.count)
    with pytest.raises(ValueError, match="NaN or inf"):
        acc.add(bad)
    assert np.array_equal(acc.abs_sum, before[0]) and np.array_equal(acc.sq_sum, before[1]) and acc.count == before[2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gram_in_column_blocks_is_exactly_symmetric_and_the_product_of_the_rows(monkeypatch, dtype):
    """The Gram products run in column blocks (GRAM_COLS: no second [in, in] temporary), the upper part and its
    mirror from one product: the result is exactly symmetric and the rows' product to rounding whatever the
    block width (both backends run this same code, so their Grams agree bit for bit either way)."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((40, 21)).astype(dtype)
    if dtype == np.float64:
        x = x + 1e-9  # not float32 values: the float64 product
    whole = O.GramAccumulator(21)
    whole.add(x)  # 21 < GRAM_COLS: one block
    monkeypatch.setattr(O.statistics, "GRAM_COLS", 4)  # six blocks, the last one 1 column wide
    blocks = O.GramAccumulator(21)
    blocks.add(x[:15])
    blocks.add(x[15:])
    x64 = x.astype(np.float64)
    expected = x64.T @ x64
    assert np.array_equal(blocks.gram, blocks.gram.T)
    tol = (1e-5 if dtype == np.float32 else 1e-12) * np.abs(expected).max()  # float32 products: float32 rounding
    np.testing.assert_allclose(blocks.gram, expected, rtol=0, atol=tol)
    np.testing.assert_allclose(whole.gram, expected, rtol=0, atol=tol)
    assert np.array_equal(whole.gram, whole.gram.T)


def test_row_chunked_round_to_nearest_awq_and_clip_search_equal_the_whole_weight_bit_for_bit(monkeypatch):
    """RTN, AWQ's scaled quantization, its weight mean and its clipping search handle rows in chunks of ROW_CHUNK_VALUES values
    (their temporaries: a few chunks, not a few weight copies); each row is its own, so chunking changes no bit."""
    rng = np.random.default_rng(6)
    w = rng.standard_normal((13, 40)) * rng.uniform(0.1, 3.0, (13, 1))
    x = rng.standard_normal((64, 40))
    gram, s = x.T @ x, rng.uniform(0.5, 2.0, 40)
    spec = O.QuantSpec(bits=4, group_size=16, symmetric=False)
    whole = (O.rtn_quantize(w, spec), O.awq_clip_search(w, gram, s, spec))
    whole_awq = O.awq_quantize(w, s, spec, whole[1])
    w2 = rng.standard_normal((5, 40))
    whole_mean = O.awq_weight_mean(np.concatenate([w, w2]), 16)
    w_before = w.copy()
    monkeypatch.setattr(O.arrays, "ROW_CHUNK_VALUES", 3 * 40 + 1)  # chunks of 3 rows, the last one 1 row
    assert [(c.start, c.stop) for c in O.row_chunks(13, 40)] == [(0, 3), (3, 6), (6, 9), (9, 12), (12, 13)]
    rtn, clip = O.rtn_quantize(w, spec), O.awq_clip_search(w, gram, s, spec)
    awq = O.awq_quantize(w, s, spec, clip)
    for f in ("codes", "scale", "zero_point", "dequantized"):
        np.testing.assert_array_equal(getattr(rtn, f), getattr(whole[0], f))
        np.testing.assert_array_equal(getattr(awq.quantized, f), getattr(whole_awq.quantized, f))
    assert rtn.codes.dtype == np.uint8  # affine: 1 byte per code
    np.testing.assert_array_equal(clip, whole[1])
    np.testing.assert_array_equal(awq.effective, whole_awq.effective)
    lean = O.awq_quantize(w, s, spec, clip, keep_dequantized=False)  # the one-shot driver's form: no Q(W s) copy
    assert lean.quantized.dequantized is None
    for f in ("codes", "scale", "zero_point"):
        np.testing.assert_array_equal(getattr(lean.quantized, f), getattr(whole_awq.quantized, f))
    np.testing.assert_array_equal(lean.effective, whole_awq.effective)
    np.testing.assert_array_equal(O.awq_effective(w, s, spec), O.awq_quantize(w, s, spec).effective)
    # the duo-scaling weight mean of two weights read as one (q / k / v): their concatenation's, no copy of it
    np.testing.assert_array_equal(O.awq_weight_mean([w, w2], 16), whole_mean)
    assert whole_mean.shape == (40,) and np.all((whole_mean > 0) & (whole_mean <= 1))
    np.testing.assert_array_equal(w, w_before)  # read in place (no copy), never written
    assert np.all(clip <= np.maximum.reduceat(np.abs(w * s), np.arange(0, 40, 16), axis=1))  # limits cut, not raise


def test_gram_accumulator_refuses_bad_batches_and_empty():
    acc = O.GramAccumulator(3)
    with pytest.raises(ValueError, match="input dimension 3"):
        acc.add(np.zeros((4, 2)))
    with pytest.raises(ValueError, match="NaN or inf"):
        acc.add([[1.0, np.nan, 0.0]])
    assert acc.count == 0 and not acc.gram.any()  # nothing half-added
    with pytest.raises(ValueError, match="empty calibration"):
        acc.mean()
    with pytest.raises(ValueError, match="positive int"):
        O.GramAccumulator(0)


def test_damp_hessian_dead_input_then_relative_damping_exact():
    h = np.array([[4.0, 0.0, 2.0], [0.0, 0.0, 0.0], [2.0, 0.0, 2.0]])
    hd, dead = O.damp_hessian(h, 0.03)
    assert dead.tolist() == [False, True, False]
    # dead diag -> 1, then + 0.03 * mean(4, 1, 2) = 0.07 on the diagonal
    assert np.allclose(hd, [[4.07, 0.0, 2.0], [0.0, 1.07, 0.0], [2.0, 0.0, 2.07]], rtol=0, atol=1e-15)
    assert h[1, 1] == 0.0  # the input is not changed
    with pytest.raises(ValueError, match="damp"):
        O.damp_hessian(h, -0.1)


def test_hessian_factor_is_the_cholesky_of_the_inverse():
    x = correlated_inputs(64, 12)
    hd, _ = O.damp_hessian(gram(x))
    u = O.hessian_factor(hd)
    assert np.array_equal(u, np.triu(u)) and (np.diag(u) > 0).all()  # upper, positive diagonal
    assert np.allclose(u.T @ u @ hd, np.eye(12), rtol=0, atol=1e-9)  # H^-1 = U^T U
    ref = np.linalg.cholesky(np.linalg.inv(hd)).T  # the references' Hinv
    assert np.allclose(u, ref, rtol=1e-9, atol=1e-12)
    big = O.damp_hessian(gram(correlated_inputs(400, 200, seed=1)))[0]  # past the recursion's base size
    ub = O.hessian_factor(big)
    assert np.array_equal(ub, np.triu(ub)) and np.allclose(ub.T @ ub @ big, np.eye(200), rtol=0, atol=1e-8)
    with pytest.raises(ValueError, match="not positive definite"):
        O.hessian_factor(np.array([[1.0, 2.0], [2.0, 1.0]]))


@pytest.mark.parametrize("n", [1, 2, 9, 64, 65, 130, 301])
def test_triangular_inverse_in_place_at_every_split(monkeypatch, n):
    """The in-place lower-triangular inverse, its products with a triangular factor split down to small pieces
    (bases of 3 and 5 columns: every uneven half): the inverse to float rounding, zeros above the diagonal,
    the same values as with the default bases."""
    rng = np.random.default_rng(n)
    low = np.tril(rng.standard_normal((n, n)) * 0.1) + np.diag(1.0 + rng.random(n))
    ref = np.linalg.inv(low)
    default = O.linalg._inv_lower(low.copy())
    monkeypatch.setattr(O.linalg, "_INV_BASE", 3)
    monkeypatch.setattr(O.linalg, "_TRMM_BASE", 5)
    monkeypatch.setattr(O.linalg, "_FACTOR_BLOCK", 4)
    a = low.copy()
    out = O.linalg._inv_lower(a)
    assert out is a and np.array_equal(out, np.tril(out))
    assert np.allclose(out, ref, rtol=0, atol=1e-12) and np.allclose(default, ref, rtol=0, atol=1e-12)
    assert np.allclose(out @ low, np.eye(n), rtol=0, atol=1e-12)


def test_hessian_factor_is_computed_in_the_handed_over_array(monkeypatch):
    """The solvers hand their damped Hessian over (a one-element list): U^T is computed in that very array, no
    second n x n matrix; blocks of any width (here 5 columns: uneven last blocks) give the same factor."""
    big = O.damp_hessian(gram(correlated_inputs(400, 200, seed=1)))[0]
    before = big.copy()
    ref = O.hessian_factor(big)
    np.testing.assert_array_equal(big, before)  # an array argument is copied, not changed
    box = [big.copy()]
    scratch = box[0]
    ut = O.linalg._inverse_factor_t(box, 0.01)
    assert box == [] and ut is scratch and ut.flags.c_contiguous
    np.testing.assert_array_equal(ut.T, ref)
    monkeypatch.setattr(O.linalg, "_FACTOR_BLOCK", 5)
    small = O.hessian_factor(big)
    assert np.array_equal(small, np.triu(small)) and np.allclose(small, ref, rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="not positive definite"):
        O.hessian_factor(np.diag([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -1.0]))  # fails in the second block


# ------------------------------------------------------------------------------------------------ Wanda
def test_wanda_hand_example_per_row_with_ties():
    w = [[1.0, -2.0, 3.0, -4.0], [4.0, 3.0, -2.0, 1.0]]
    norms = [4.0, 1.0, 1.0, 0.5]
    # scores: row 0 [4, 2, 3, 2] (tie 2 / 2: both pruned), row 1 [16, 3, 2, 0.5]
    assert O.wanda_scores(w, norms).tolist() == [[4.0, 2.0, 3.0, 2.0], [16.0, 3.0, 2.0, 0.5]]
    assert O.wanda_mask(w, norms, 0.5).tolist() == [[True, False, True, False], [True, True, False, False]]
    # one per row at 25 % (floor(4 * 0.25)); the tie in row 0 prunes the lower index first
    assert O.wanda_mask(w, norms, 0.25).tolist() == [[True, False, True, True], [True, True, True, False]]
    # magnitude alone would prune row 0's columns 0 and 1 instead
    assert P.level_mask(ops, np.array(w[:1]), 0.5).tolist() == [[False, False, True, True]]


def test_wanda_nm_and_row_counts():
    w = [[1.0, -2.0, 3.0, -4.0, 0.1, 0.2, 0.3, 0.4]]
    norms = [4.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0]
    # group 1 scores [4, 2, 3, 2] keep 4 and 3; group 2 [0.1, 0.2, 0.3, 0.4] keeps the last two
    assert O.wanda_mask(w, norms, sparse_pattern="2:4").tolist() == [[True, False, True, False,
                                                                       False, False, True, True]]
    rng = np.random.default_rng(3)
    big = rng.standard_normal((16, 40))
    norms = rng.random(40)
    keep = O.wanda_mask(big, norms, 0.3)
    assert (keep.sum(axis=1) == 40 - 12).all()  # every row loses floor(40 * 0.3) = 12
    s = O.wanda_scores(big, norms)
    assert (np.where(keep, s, np.inf).min(axis=1) >= np.where(keep, -np.inf, s).max(axis=1)).all()
    nm = O.wanda_mask(big, norms, sparse_pattern="1:4")
    assert bool(P.is_nm(ops, nm, 1, 4)) and nm.sum() == 16 * 10
    with pytest.raises(ValueError, match="exactly one"):
        O.wanda_mask(big, norms)
    with pytest.raises(ValueError, match="multiple of M=3"):
        O.wanda_mask(big, norms, sparse_pattern="1:3")
    with pytest.raises(ValueError, match="one entry per input column"):
        O.wanda_mask(big, norms[:5], 0.5)


# -------------------------------------------------------------------------------------------- SparseGPT
def test_sparsegpt_hand_example_obs_update():
    # H = [[2, 1], [1, 2]], no damping: saliency |w| * R_jj = [1 * sqrt(1.5), 3 * sqrt(2)] prunes w0 = 1;
    # the OBS update gives w1 += -w0 [H^-1]_10 / [H^-1]_00 = -1 * (-1/3) / (2/3) = 0.5
    res = O.sparsegpt_prune([[1.0, 3.0]], [[2.0, 1.0], [1.0, 2.0]], 0.5, damp=0.0)
    assert res.mask.tolist() == [[False, True]]
    assert res.weight[0, 0] == 0.0 and res.weight[0, 1] == pytest.approx(3.5, abs=1e-14)
    assert res.error == pytest.approx(0.5 * 1.0 * 1.5, abs=1e-14)  # w^2 / (2 U_00^2), U_00^2 = 2/3


def test_sparsegpt_identity_hessian_is_magnitude_pruning():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((8, 16))
    eye = np.eye(16)
    row = O.sparsegpt_prune(w, eye, 0.5, mask_scope="row")
    per_row = np.ones_like(row.mask)
    np.put_along_axis(per_row, np.argsort(np.abs(w), axis=1, kind="stable")[:, :8], False, axis=1)
    assert np.array_equal(row.mask, per_row)
    assert np.array_equal(row.weight, w * per_row)  # no update at all: bit for bit
    layer = O.sparsegpt_prune(w, eye, 0.5)
    assert np.array_equal(layer.mask, P.level_mask(ops, w, 0.5)) and np.array_equal(layer.weight, w * layer.mask)
    nm = O.sparsegpt_prune(w, eye, sparse_pattern="2:4")
    assert np.array_equal(nm.mask, P.nm_mask(ops, w, 2, 4)) and np.array_equal(nm.weight, w * nm.mask)


@pytest.mark.parametrize("kw", [dict(sparsity=0.5, block_size=5), dict(sparsity=0.6, block_size=16, scope="row"),
                                dict(nm=(2, 4), block_size=8)])
def test_sparsegpt_matches_textbook_reference(kw):
    x = correlated_inputs(96, 16, seed=2)
    w = np.random.default_rng(4).standard_normal((6, 16))
    h = gram(x)
    ref_w, ref_keep = ref_sparsegpt(w, h, **kw)
    args = dict(sparsity=kw.get("sparsity"), sparse_pattern=None if "nm" not in kw else "{}:{}".format(*kw["nm"]),
                block_size=kw["block_size"], mask_scope=kw.get("scope", "block"))
    res = O.sparsegpt_prune(w, h, **args)
    assert np.array_equal(res.mask, ref_keep)
    assert np.allclose(res.weight, ref_w, rtol=1e-9, atol=1e-9)
    assert (res.weight[~res.mask] == 0.0).all()


def test_sparsegpt_beats_magnitude_and_wanda_on_correlated_inputs():
    x = correlated_inputs(512, 64, seed=5)
    w = np.random.default_rng(6).standard_normal((32, 64))
    acc = O.GramAccumulator(64)
    acc.add(x)
    for kw in (dict(sparsity=0.5), dict(sparse_pattern="2:4"), dict(sparsity=0.7)):
        res = O.sparsegpt_prune(w, acc.gram, block_size=16, **kw)
        if "sparse_pattern" in kw:
            mag = P.nm_mask(ops, w, 2, 4)
            assert bool(P.is_nm(ops, res.mask, 2, 4)) and res.mask.sum() == 32 * 32
        else:
            mag = P.level_mask(ops, w, kw["sparsity"])
            # floor(32 * 16 * s) per 16-column block: 4 * 256 = 1024 at 50 %, 4 * 358 = 1432 at 70 %
            assert (~res.mask).sum() == {0.5: 1024, 0.7: 1432}[kw["sparsity"]]
        wanda = O.wanda_mask(w, acc.channel_norms(), **kw)
        e_sgpt = O.layer_output_error(x, w, res.weight)
        e_wanda = O.layer_output_error(x, w, w * wanda)
        e_mag = O.layer_output_error(x, w, w * mag)
        assert e_sgpt < e_wanda < e_mag, (kw, e_sgpt, e_wanda, e_mag)


def test_sparsegpt_dead_inputs_and_errors():
    w = np.arange(1.0, 9.0).reshape(2, 4)
    h = np.diag([1.0, 0.0, 2.0, 3.0])
    res = O.sparsegpt_prune(w, h, 0.25, block_size=4)
    assert res.dead.tolist() == [False, True, False, False]
    assert (res.weight[:, 1] == 0).all() and (~res.mask[:, 1]).all()  # dead column: zero, pruned first
    assert w[0, 1] == 2.0  # inputs untouched
    with pytest.raises(ValueError, match="multiple of M=4"):
        O.sparsegpt_prune(np.ones((2, 8)), np.eye(8), sparse_pattern="2:4", block_size=6)
    with pytest.raises(ValueError, match=r"\[in, in\] = \[4, 4\]"):
        O.sparsegpt_prune(w, np.eye(3), 0.5)
    with pytest.raises(ValueError, match="mask_scope"):
        O.sparsegpt_prune(w, np.eye(4), 0.5, mask_scope="column")
    with pytest.raises(ValueError, match="NaN"):
        O.sparsegpt_prune(w, np.full((4, 4), np.nan), 0.5)
    with pytest.raises(ValueError, match="not positive definite"):
        O.sparsegpt_prune(w, np.ones((4, 4)), 0.5, damp=0.0)  # rank 1, undamped


# ------------------------------------------------------------------------------------------ RTN / GPTQ
def test_rtn_hand_values_symmetric_affine_and_full_range():
    w = [[0.5, -1.0, 0.25, 2.0]]
    sym = O.rtn_quantize(w, O.QuantSpec(4))
    # scale = 2 / 7; w * 3.5 = [1.75, -3.5, 0.875, 7]: -3.5 rounds half to even -> -4
    assert sym.codes.tolist() == [[2, -4, 1, 7]] and sym.scale.tolist() == [[2 / 7]]
    assert sym.zero_point.tolist() == [[0.0]] and sym.codes.dtype == np.int8
    assert np.allclose(sym.dequantized, [[4 / 7, -8 / 7, 2 / 7, 2.0]], rtol=0, atol=1e-15)
    full = O.rtn_quantize(w, O.QuantSpec(4, narrow=False))
    # [-8, 7], scale = 2 / 7.5: w * 3.75 = [1.875, -3.75, 0.9375, 7.5] -> 7.5 rounds to 8, clipped to 7
    assert full.codes.tolist() == [[2, -4, 1, 7]] and full.scale[0, 0] == pytest.approx(2 / 7.5, abs=1e-16)
    aff = O.rtn_quantize(w, O.QuantSpec(2, symmetric=False, group_size=2))
    # group [0.5, -1]: scale 0.5, zp 2 -> codes [3, 0]; group [0.25, 2] (range widened to 0): scale 2/3, zp 0
    assert aff.codes.tolist() == [[3, 0, 0, 3]] and aff.zero_point.tolist() == [[2.0, 0.0]]
    assert np.allclose(aff.scale, [[0.5, 2 / 3]], rtol=0, atol=1e-15)
    assert np.allclose(aff.dequantized, [[0.5, -1.0, 0.0, 2.0]], rtol=0, atol=1e-15)
    assert aff.group_index().tolist() == [0, 0, 1, 1]
    ragged = O.rtn_quantize(np.ones((2, 5)), O.QuantSpec(3, group_size=2))
    assert ragged.scale.shape == (2, 3) and ragged.group_index().tolist() == [0, 0, 1, 1, 2]


def test_gptq_hand_example_beats_rtn():
    # 2-bit symmetric narrow ([-1, 1]), per channel: scale = max|w| = 1. H couples columns 0 and 1.
    w = [[0.4, 0.35, 1.0]]
    h = [[2.0, 1.0, 0.0], [1.0, 2.0, 0.0], [0.0, 0.0, 1.0]]
    spec = O.QuantSpec(2)
    g = O.gptq_quantize(w, h, spec, damp=0.0)
    # column 0: 0.4 -> 0; its error moves column 1 by 0.4 * 1/2 = 0.2: 0.55 -> 1 (RTN: 0.35 -> 0)
    assert g.codes.tolist() == [[0, 1, 1]] and g.dequantized.tolist() == [[0.0, 1.0, 1.0]]
    assert O.rtn_quantize(w, spec).codes.tolist() == [[0, 0, 1]]
    d_gptq, d_rtn = np.array([0.4, -0.65, 0.0]), np.array([0.4, 0.35, 0.0])
    assert d_gptq @ np.array(h) @ d_gptq == pytest.approx(0.645) and d_rtn @ np.array(h) @ d_rtn == pytest.approx(0.845)


@pytest.mark.parametrize("kw", [dict(bits=4), dict(bits=3, symmetric=False, group_size=8),
                                dict(bits=2, group_size=5, narrow=False), dict(bits=8, group_size=4)])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_with_identity_or_diagonal_hessian_is_rtn_bit_for_bit(kw, act_order):
    w = np.random.default_rng(7).standard_normal((6, 20))
    spec = O.QuantSpec(**kw)
    rtn = O.rtn_quantize(w, spec)
    for h in (np.eye(20), np.diag(np.arange(20.0, 0.0, -1.0)[np.random.default_rng(8).permutation(20)])):
        g = O.gptq_quantize(w, h, spec, act_order=act_order, block_size=7)
        assert np.array_equal(g.codes, rtn.codes) and np.array_equal(g.scale, rtn.scale)
        assert np.array_equal(g.zero_point, rtn.zero_point) and np.array_equal(g.dequantized, rtn.dequantized)


@pytest.mark.parametrize("kw", [dict(bits=4), dict(bits=3, group_size=8, symmetric=False),
                                dict(bits=4, group_size=6, act_order=True), dict(bits=2, group_size=4)])
def test_gptq_matches_textbook_reference(kw):
    x = correlated_inputs(128, 24, seed=9)
    w = np.random.default_rng(10).standard_normal((5, 24))
    h = gram(x)
    bits, sym, gs, act = kw["bits"], kw.get("symmetric", True), kw.get("group_size"), kw.get("act_order", False)
    ref = ref_gptq(w, h, bits, sym, gs, act_order=act)
    for bs in (5, 8, 128):  # blocks across, on and beyond the group boundaries: the same result
        g = O.gptq_quantize(w, h, O.QuantSpec(bits, sym, gs), block_size=bs, act_order=act)
        assert np.allclose(g.dequantized, ref, rtol=1e-9, atol=1e-9)
        deq = (g.codes - g.zero_point[:, g.group_index()]) * g.scale[:, g.group_index()]
        assert np.array_equal(deq, g.dequantized)  # the codes store exactly the weights used


def test_gptq_beats_rtn_on_correlated_inputs():
    x = correlated_inputs(512, 64, seed=11)
    w = np.random.default_rng(12).standard_normal((32, 64))
    h = gram(x)
    for spec in (O.QuantSpec(4, group_size=16), O.QuantSpec(3, symmetric=False), O.QuantSpec(2, group_size=32)):
        e_rtn = O.layer_output_error(x, w, O.rtn_quantize(w, spec).dequantized)
        for act in (False, True):
            e = O.layer_output_error(x, w, O.gptq_quantize(w, h, spec, act_order=act, block_size=16).dequantized)
            assert e < 0.8 * e_rtn, (spec, act, e, e_rtn)


def test_gptq_keep_mask_2_4_then_int4_keeps_the_zeros():
    x = correlated_inputs(256, 32, seed=13)
    w = np.random.default_rng(14).standard_normal((8, 32))
    h = gram(x)
    sp = O.sparsegpt_prune(w, h, sparse_pattern="2:4")
    spec = O.QuantSpec(4, symmetric=False, group_size=8)
    g = O.gptq_quantize(sp.weight, h, spec, mask=sp.mask)
    gi = g.group_index()
    assert (g.dequantized[~sp.mask] == 0.0).all()
    assert np.array_equal(g.codes[~sp.mask], g.zero_point[:, gi][~sp.mask].astype(np.uint8))
    assert g.codes.dtype == np.uint8  # affine codes: 0..15 here, 1 byte each
    assert bool(P.is_nm(ops, g.dequantized != 0, 2, 4))
    ref = ref_gptq(sp.weight, h, 4, False, 8, mask=sp.mask)
    assert np.allclose(g.dequantized, ref, rtol=1e-9, atol=1e-9)
    # without the mask GPTQ would move the pruned weights off zero
    assert (O.gptq_quantize(sp.weight, h, spec).dequantized[~sp.mask] != 0.0).any()


def test_gptq_deterministic_inputs_untouched_and_errors():
    x = correlated_inputs(64, 16, seed=15)
    w = np.random.default_rng(16).standard_normal((4, 16)).astype(np.float32)
    h = gram(x)
    w0, h0 = w.copy(), h.copy()
    spec = O.QuantSpec(4, group_size=8)
    a = O.gptq_quantize(w, h, spec, act_order=True)
    b = O.gptq_quantize(w, h, spec, act_order=True)
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.dequantized, b.dequantized)
    assert np.array_equal(w, w0) and np.array_equal(h, h0)
    assert a.perm.tolist() == np.argsort(-np.diag(h), kind="stable").tolist()
    for bad in (dict(bits=1), dict(bits=9), dict(bits=4, group_size=0), dict(bits=True)):
        with pytest.raises(ValueError, match="bits|group_size"):
            O.QuantSpec(**bad)
    with pytest.raises(ValueError, match="block_size"):
        O.gptq_quantize(w, h, spec, block_size=0)
    with pytest.raises(ValueError, match="mask must have the weight's shape"):
        O.gptq_quantize(w, h, spec, mask=np.ones((4, 8), bool))
    with pytest.raises(ValueError, match="2-D"):
        O.gptq_quantize(w[0], h, spec)


# ------------------------------------------------------------------------------------------------- AWQ
def test_awq_grid_and_scales_exact():
    assert O.awq_grid().tolist() == [i / 19 for i in range(20)]
    assert O.awq_grid(5).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0] and O.awq_grid(1).tolist() == [0.0]
    # llmcompressor 0.14's grid: the identity first, then n - 1 duo-scaled exponents over [0, 1]
    assert O.awq_candidates() == [(0.0, False)] + [(i / 18, True) for i in range(19)]
    assert O.awq_candidates(4) == [(0.0, False), (0.0, True), (0.5, True), (1.0, True)]
    assert O.awq_candidates(3, False) == [(0.0, False), (0.5, False), (1.0, False)]
    assert O.awq_candidates(5, "both") == [(0.0, False), (0.0, True), (1.0, False), (1.0, True)]
    with pytest.raises(ValueError, match="duo_scaling"):
        O.awq_candidates(4, "yes")
    assert O.awq_scales([1.0, 4.0], 0.0).tolist() == [1.0, 1.0]
    # [1, 4]^0.5 = [1, 2], normalised by sqrt(2 * 1)
    assert np.allclose(O.awq_scales([1.0, 4.0], 0.5), [2**-0.5, 2**0.5], rtol=0, atol=1e-15)
    # a dead channel is clamped to 1e-4 before normalising: [1e-4, 1] / sqrt(1e-4) = [0.01, 100]
    assert np.allclose(O.awq_scales([0.0, 1.0], 0.5), [0.01, 100.0], rtol=1e-12)
    # duo scaling: s = x^a / (w^(1-a) + 1e-4), here [1, 4]^0.5 / ([1, 0.25]^0.5 + 1e-4)
    s = np.array([1.0, 2.0]) / (np.array([1.0, 0.5]) + 1e-4)
    assert np.allclose(O.awq_scales([1.0, 4.0], 0.5, w_mean=[1.0, 0.25]), s / np.sqrt(s.max() * s.min()), rtol=1e-14)
    # AutoAWQ's weight statistic: |W| / its group's max |W|, averaged over rows
    assert O.awq_weight_mean([[1.0, -2.0, 3.0, 0.0], [2.0, 2.0, -1.0, 0.5]], 2).tolist() == [0.75, 1.0, 1.0, 0.25]


def test_awq_quantize_and_search_pick_the_smallest_loss():
    w = [[0.5, -1.0, 0.25, 2.0]]
    spec = O.QuantSpec(4)
    one = O.awq_quantize(w, np.ones(4), spec)
    assert np.array_equal(one.effective, O.rtn_quantize(w, spec).dequantized)
    s = np.array([2.0, 1.0, 1.0, 0.5])
    aw = O.awq_quantize(w, s, spec)
    # W * s = [1, -1, 0.25, 1]: scale 1/7, codes [7, -7, 2, 7]; effective = codes / 7 / s
    assert aw.quantized.codes.tolist() == [[7, -7, 2, 7]]
    assert np.allclose(aw.effective, [[0.5, -1.0, 2 / 7, 2.0]], rtol=0, atol=1e-15)
    seen = []

    def loss(scales):
        seen.append(scales)
        return [5.0, 3.0, 1.0, 1.0, 4.0][len(seen) - 1]

    res = O.awq_search([1.0, 4.0], loss, n_grid=5)  # no w_mean: the activation-only grid
    assert res.alpha == 0.5 and not res.duo and np.array_equal(res.scales, seen[2])  # the tie at 0.75: the earlier
    assert [a for a, _, _ in res.losses] == [0.0, 0.25, 0.5, 0.75, 1.0] and seen[0].tolist() == [1.0, 1.0]
    # with w_mean: the identity, then duo-scaled points; the identity can win
    seen.clear()
    res = O.awq_search([1.0, 4.0], lambda s: seen.append(s) or [1.0, 2.0, 3.0][len(seen) - 1], n_grid=3,
                       w_mean=[1.0, 0.25])
    assert (res.alpha, res.duo) == (0.0, False) and res.scales.tolist() == [1.0, 1.0]
    assert [(a, d) for a, d, _ in res.losses] == [(0.0, False), (0.0, True), (1.0, True)]
    with pytest.raises(ValueError, match="not finite"):
        O.awq_search([1.0, 4.0], lambda s: float("nan"))
    with pytest.raises(ValueError, match="positive"):
        O.awq_quantize(w, [1.0, 0.0, 1.0, 1.0], spec)


def test_awq_beats_rtn_on_salient_channels():
    rng = np.random.default_rng(17)
    x = rng.standard_normal((256, 32))
    x[:, [3, 17]] *= 30.0  # salient input channels
    w = rng.standard_normal((16, 32))
    spec = O.QuantSpec(3, group_size=16)
    acc = O.GramAccumulator(32, gram=False)
    acc.add(x)
    res = O.awq_search(acc.abs_mean(), lambda s: O.awq_linear_loss(x, w, s, spec))
    e_rtn = O.layer_output_error(x, w, O.rtn_quantize(w, spec).dequantized)
    assert res.losses[0][2] == e_rtn  # alpha = 0 is plain RTN
    assert res.alpha > 0 and min(v for *_, v in res.losses) < 0.9 * e_rtn


@pytest.mark.parametrize("sym", [True, False])
def test_awq_clip_search_picks_per_group_the_ratio_with_the_least_token_error(sym):
    assert np.allclose(O.awq_clip_ratios(), [1.0 - i / 20 for i in range(10)])
    assert O.awq_clip_ratios(10, 0.3).tolist() == [1.0, 0.9, 0.8]
    rng = np.random.default_rng(3)
    n_out, n_in, gs = 6, 16, 8
    x = correlated_inputs(200, n_in, seed=3)
    w = rng.standard_normal((n_out, n_in))
    w[np.arange(n_out), rng.integers(0, n_in, n_out)] *= 6.0  # one outlier per row: clipping pays somewhere
    s = np.exp(rng.uniform(-0.5, 0.5, n_in))
    spec = O.QuantSpec(3, sym, gs)
    lim = O.awq_clip_search(w, gram(x), s, spec)
    assert lim.shape == (n_out, 2)
    ws, xs = w * s, x / s  # the scaled weight and the input it sees
    amax = np.stack([np.abs(ws[:, :gs]).max(1), np.abs(ws[:, gs:]).max(1)], axis=1)
    for r in range(n_out):
        for g in range(2):
            cols = slice(g * gs, (g + 1) * gs)
            errs = []
            for ratio in O.awq_clip_ratios():  # brute force on the tokens themselves, this group alone
                m = amax[r, g] * ratio
                row = ws[r].copy()
                row[cols] = np.clip(row[cols], -m, m)
                q = O.rtn_quantize(row[None, :], spec).dequantized[0]
                errs.append(float(np.sum((xs[:, cols] @ (ws[r, cols] - q[cols])) ** 2)))
            best = int(np.argmin(errs))  # the first of equal errors: the larger limit
            assert lim[r, g] == pytest.approx(amax[r, g] * O.awq_clip_ratios()[best], rel=1e-12), (r, g, errs)
    assert np.any(lim < amax)  # some groups were clipped (the test can fail)
    clipped = O.awq_quantize(w, s, spec, clip=lim)
    plain = O.awq_quantize(w, s, spec)
    assert O.layer_output_error(x, w, clipped.effective) < O.layer_output_error(x, w, plain.effective)
    assert np.array_equal(O.awq_quantize(w, s, spec, clip=amax).effective, plain.effective)  # the full range: RTN


def test_awq_clipping_skips_query_and_key_projections_by_name():
    from compressor.core.oneshot import AwqMethod, LayerTask

    def clips(name, **cfg):
        return AwqMethod.clips(LayerTask(name=name, in_features=8, config={"quant_bits": 4, **cfg}))

    for name in ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "h.0.attn.c_attn",
                 "decoder/layer_0/self_attention/query", "transformer_layer_0/attention/key", "blk.0.attn.qkv_proj",
                 "h.0.self_attention.query_key_value"]:
        assert not clips(name), name
    for name in ["model.layers.0.self_attn.v_proj", "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.up_proj",
                 "h.0.mlp.c_fc", "decoder/layer_0/self_attention/value", "transformer_layer_0/ffn/kernel_q"]:
        assert clips(name), name
    assert not clips("model.layers.0.mlp.up_proj", apply_clip=False)


# ------------------------------------------------------------------------------------------- properties
@settings(max_examples=25, deadline=None)
@given(out=st.integers(1, 5), groups=st.integers(1, 4), bits=st.sampled_from([2, 3, 4, 8]), sym=st.booleans(),
       gs=st.sampled_from([None, 2, 3, 4]), act=st.booleans(), bs=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_property_gptq_codes_in_range_and_consistent(out, groups, bits, sym, gs, act, bs, seed):
    n_in = 4 * groups
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((out, n_in))
    x = correlated_inputs(3 * n_in, n_in, seed=seed)
    x[:, rng.integers(n_in)] = 0.0  # a dead input
    spec = O.QuantSpec(bits, sym, gs)
    g = O.gptq_quantize(w, gram(x), spec, act_order=act, block_size=bs)
    qmin, qmax = spec.qrange
    assert g.codes.min() >= qmin and g.codes.max() <= qmax
    gi = g.group_index()
    assert np.array_equal((g.codes - g.zero_point[:, gi]) * g.scale[:, gi], g.dequantized)
    assert (g.dequantized[:, g.dead] == 0).all()
    sp = O.sparsegpt_prune(w, gram(x), sparse_pattern="2:4", block_size=4 * max(bs // 4, 1))
    assert bool(P.is_nm(ops, sp.mask, 2, 4)) and (sp.mask.sum(axis=1) == n_in // 2).all()
    assert (sp.weight[~sp.mask] == 0).all()
    again = O.sparsegpt_prune(w, gram(x), sparse_pattern="2:4", block_size=4 * max(bs // 4, 1))
    assert np.array_equal(again.weight, sp.weight) and np.array_equal(again.mask, sp.mask)


def test_gram_matrices_get_pages_of_their_own():
    """A Gram matrix of at least OWN_PAGES_BYTES lives in an anonymous map of its own (back to the OS when
    dropped, never in the allocator's heap between short-lived buffers); it starts at zero, and a solver
    handed it factors it in place with the same result as on a copy."""
    import mmap

    def backing(a):
        while isinstance(a, np.ndarray):
            a = a.base
        return a.obj if isinstance(a, memoryview) else a

    big = O.memory.own_pages((512, 512))  # 2 MiB
    assert isinstance(backing(big), mmap.mmap)
    assert big.dtype == np.float64 and big.flags.c_contiguous and big.flags.writeable and not big.any()
    small = O.memory.own_pages((8, 8))
    assert backing(small) is None and not small.any()
    acc = O.GramAccumulator(512)
    assert isinstance(backing(acc.gram), mmap.mmap)
    x = correlated_inputs(600, 512)
    acc.add(x)
    plain = acc.gram.copy()
    acc.consumable = True
    handed = acc.gram_for_solver()
    assert isinstance(handed, list) and acc.gram is None
    w = np.random.default_rng(0).standard_normal((4, 512))
    np.testing.assert_array_equal(O.sparsegpt_prune(w, handed, 0.5).weight, O.sparsegpt_prune(w, plain, 0.5).weight)


def test_codes_of_4_bits_or_fewer_are_kept_two_per_byte():
    """store_codes: column 2k in the low nibble, 2k + 1 in the high one (two's complement nibbles for signed
    codes, an odd last column paired with 0); stored_codes_to_full gives the codes back; wider codes unchanged."""
    signed = np.array([[-7, 7, 0, -1, 3], [1, -8, 5, 2, -3]], dtype=np.int8)
    kept = O.store_codes(signed, 4)
    assert kept.dtype == np.int8 and kept.shape == (2, 3) and O.stored_code_width(5, 4) == 3
    assert kept.view(np.uint8).tolist() == [[0x79, 0xF0, 0x03], [0x81, 0x25, 0x0D]]
    np.testing.assert_array_equal(O.stored_codes_to_full(kept, 4, 5), signed)
    unsigned = np.array([[0, 15, 9, 4]], dtype=np.uint8)
    kept = O.store_codes(unsigned, 3)
    assert kept.dtype == np.uint8 and kept.tolist() == [[0xF0, 0x49]]
    np.testing.assert_array_equal(O.stored_codes_to_full(kept, 3, 4), unsigned)
    wide = np.array([[-128, 127, 3]], dtype=np.int8)
    assert O.store_codes(wide, 8) is wide and O.stored_code_width(3, 8) == 3
    np.testing.assert_array_equal(O.stored_codes_to_full(wide, 8, 3), wide)
    rng = np.random.default_rng(0)
    for n in (1, 2, 7, 128):
        c = rng.integers(-8, 8, (5, n)).astype(np.int8)
        np.testing.assert_array_equal(O.stored_codes_to_full(O.store_codes(c, 4), 4, n), c)
    with pytest.raises(ValueError, match=r"\[out, 3\]"):
        O.stored_codes_to_full(np.zeros((2, 5), np.int8), 4, 5)
    with pytest.raises(ValueError, match="int8 / uint8"):
        O.store_codes(np.zeros((2, 2), np.int32), 4)


@pytest.mark.parametrize("gram", [True, False])
@pytest.mark.parametrize("width", [1, 7, 300])
def test_row_source_adds_exactly_what_the_whole_float32_array_adds(gram, width):
    """A backend hands half-precision rows over as a RowSource, widened a slice at a time: the statistics equal
    those of the whole float32 array bit for bit, over several batches, and each slice read is small."""
    from compressor.core.oneshot.statistics import GRAM_F32_ROWS, SUM_CHUNK_VALUES

    rng = np.random.default_rng(3)
    whole = O.GramAccumulator(width, gram=gram)
    sliced = O.GramAccumulator(width, gram=gram)
    widest = []
    for rows in (2500, 1, 1030):
        a = (rng.standard_normal((rows, width)) * 3).astype(np.float32)
        whole.add(a)

        def get(i, j, a=a):
            widest.append(min(j, len(a)) - i)
            return np.ascontiguousarray(a[i:j])
        sliced.add(O.RowSource(rows, width, get))
    assert sliced.count == whole.count == 3531
    assert np.array_equal(sliced.abs_sum, whole.abs_sum)
    assert np.array_equal(sliced.sq_sum, whole.sq_sum)
    if gram:
        assert np.array_equal(sliced.gram, whole.gram)
    if width > 1:  # slices of at most one Gram product's rows or one chunk of the sums (65536 values)
        assert max(widest) * width <= max(GRAM_F32_ROWS * width, SUM_CHUNK_VALUES)


def test_row_source_with_a_nan_or_a_wrong_width_adds_nothing():
    acc = O.GramAccumulator(4)
    acc.add(np.ones((3, 4), np.float32))
    bad = np.ones((5, 4), np.float32)
    bad[4, 2] = np.nan
    with pytest.raises(ValueError, match="NaN or inf"):
        acc.add(O.RowSource(5, 4, lambda i, j: bad[i:j]))
    with pytest.raises(ValueError, match="input dimension 4, got width 3"):
        acc.add(O.RowSource(5, 3, lambda i, j: bad[i:j, :3]))
    assert acc.count == 3 and np.array_equal(acc.gram, np.full((4, 4), 3.0))


def test_gram_is_kept_as_its_upper_part_and_given_back_whole():
    """The accumulator keeps only the column blocks' upper parts (half the matrix's bytes plus half the diagonal
    blocks'), and gives the
    full matrix back, exactly symmetric, equal to the rows' float64 product for float32 rows of small integers
    (every product and sum exact); the solver's box is a matrix of its own, so the accumulator keeps its blocks
    until it is consumable."""
    from compressor.core.oneshot.statistics import GRAM_COLS

    n = 2 * GRAM_COLS + 37
    x = np.random.default_rng(2).integers(-3, 4, size=(50, n)).astype(np.float32)
    acc = O.GramAccumulator(n)
    acc.add(x[:20])
    acc.add(x[20:])
    blocks = acc.gram_blocks
    assert [b.shape for b in blocks] == [(GRAM_COLS, GRAM_COLS), (2 * GRAM_COLS, GRAM_COLS), (n, 37)]
    assert sum(b.nbytes for b in blocks) == 8 * (GRAM_COLS * GRAM_COLS + 2 * GRAM_COLS * GRAM_COLS + n * 37)  # 0.72 of n^2
    x64 = x.astype(np.float64)
    assert np.array_equal(acc.gram, x64.T @ x64)
    assert np.array_equal(acc.sq_sum, (x64 * x64).sum(0))
    box = acc.gram_for_solver()
    assert isinstance(box, list) and np.array_equal(box[0], x64.T @ x64) and acc.gram_blocks is blocks
    box[0][:] = 0  # the solver's own matrix: the accumulator is unchanged
    assert np.array_equal(acc.gram, x64.T @ x64)
    acc.consumable = True
    assert np.array_equal(acc.gram_for_solver()[0], x64.T @ x64) and acc.gram is None and acc.gram_blocks is None


def test_a_handed_weight_is_taken_out_of_its_box_and_gives_the_same_result():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((24, 40)).astype(np.float32)
    x = rng.standard_normal((60, 40)).astype(np.float32)
    acc = O.GramAccumulator(40)
    acc.add(x)
    spec = O.QuantSpec(bits=4, group_size=8)
    box = O.arrays.Handed(w.copy())
    got = O.gptq_quantize(box, acc.gram, spec)
    assert box.array is None
    ref = O.gptq_quantize(w.astype(np.float64), acc.gram, spec)
    assert np.array_equal(got.codes, ref.codes) and np.array_equal(got.dequantized, ref.dequantized)
    with pytest.raises(ValueError, match="taken already"):
        O.gptq_quantize(box, acc.gram, spec)
