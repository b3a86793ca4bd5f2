"""N:M parity: the same weights (Keras kernels = torch weights transposed) and the same ``sparse_pattern``
give IDENTICAL masks on torch and tf, for Linear/Dense and Conv, with LevelPruner and at every AGP update,
and they equal core's mask on numpy. Weights are rounded to quarters so ties are common."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
import torch

import compressor.tf.pruning as tfp
import compressor.torch.pruning as thp
from compressor.core.ops import NumpyOps
from compressor.core.pruning import nm_mask

NP = NumpyOps()
RNG = np.random.default_rng(11)


def quarters(*shape):
    return (np.round(RNG.standard_normal(shape) * 4) / 4).astype(np.float32)


def twins():
    """(torch model, keras model, canonical weights): Conv2d 8->6 k3 and Linear 16->4 with equal weights."""
    conv_w, fc_w = quarters(6, 8, 3, 3), quarters(4, 16)
    tm = torch.nn.Sequential(torch.nn.Conv2d(8, 6, 3), torch.nn.Flatten(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        tm[0].weight.copy_(torch.from_numpy(conv_w))
        tm[2].weight.copy_(torch.from_numpy(fc_w))
    inp = keras.Input((5, 5, 8))
    conv, fc = keras.layers.Conv2D(6, 3, name="conv"), keras.layers.Dense(4, name="fc")
    km = keras.Model(inp, [conv(inp), fc(keras.layers.Flatten()(inp)[:, :16])])
    conv.kernel.assign(conv_w.transpose(2, 3, 1, 0))
    fc.kernel.assign(fc_w.T)
    return tm, km, [conv_w, fc_w]


def canonical_masks(pruner):
    out = []
    for w in pruner.get_modules_wrapper():
        m = w.weight_mask
        if isinstance(m, torch.Tensor):
            out.append(m.numpy())
        else:
            m = m.numpy()
            out.append(m.transpose(3, 2, 0, 1) if m.ndim == 4 else m.T)
    return out


@pytest.mark.parametrize("pattern", ["2:4", "1:4", "4:8"])
def test_level_nm_parity(pattern):
    tm, km, weights = twins()
    cfg = [{"sparse_pattern": pattern, "op_types": ["Conv2d", "Linear"]}]
    pt, pk = thp.LevelPruner(tm, cfg), tfp.LevelPruner(km, cfg)
    pt.compress()
    pk.compress()
    a, b = canonical_masks(pt), canonical_masks(pk)
    n, m = map(int, pattern.split(":"))
    for ma, mb, w in zip(a, b, weights):
        np.testing.assert_array_equal(ma, mb)
        np.testing.assert_array_equal(ma, nm_mask(NP, w, n, m))
        groups = np.moveaxis(ma, 1, -1).reshape(-1, m)
        assert (groups.sum(axis=1) == n).all()


def test_agp_nm_parity_every_update():
    tm, km, _ = twins()
    cfg = [{"sparse_pattern": "2:4", "op_types": ["Conv2d", "Linear"], "start_epoch": 0, "end_epoch": 4}]
    pt, pk = thp.AGPPruner(tm, cfg), tfp.AGPPruner(km, cfg)
    pt.compress()
    pk.compress()
    pruned = []
    for epoch in range(6):
        pt.update_epoch(epoch)
        pk.update_epoch(epoch)
        a, b = canonical_masks(pt), canonical_masks(pk)
        for ma, mb in zip(a, b):
            np.testing.assert_array_equal(ma, mb)
        pruned.append(sum(int((~m).sum()) for m in a))
    assert pruned == sorted(pruned) and pruned[0] < pruned[-1]
    for m in canonical_masks(pt):  # ends exactly at 2:4
        assert (np.moveaxis(m, 1, -1).reshape(-1, 4).sum(axis=1) == 2).all()


def test_tf_nm_mask_traces_in_graph():
    _, km, _ = twins()
    pk = tfp.LevelPruner(km, [{"sparse_pattern": "2:4", "op_names": ["fc"]}])
    w = pk.get_modules_wrapper()[0]
    masker = tfp.LevelPrunerMasker(km, pk)
    eager = masker.calc_mask(0.5, w)["weight_mask"].numpy()
    graph = tf.function(lambda: masker.calc_mask(0.5, w)["weight_mask"])().numpy()
    np.testing.assert_array_equal(eager, graph)


def test_weight_sharing_codebooks_and_assignments_identical():
    tm, km, _ = twins()
    cfg = [{"quant_types": ["weight"], "quant_bits": 3, "op_types": ["Conv2d", "Linear"]}]
    from compressor.tf import WeightSharingQuantizer as TfSharing
    from compressor.torch import WeightSharingQuantizer as TorchSharing

    st, sk = TorchSharing(tm, cfg), TfSharing(km, cfg)
    bt, bk = st.codebooks(), sk.codebooks()
    for (nt, ct), (nk, ck) in zip(bt.items(), bk.items()):
        assert ct.dtype == ck.dtype and ct.tobytes() == ck.tobytes(), (nt, nk)
    for wt, wk in zip(st.get_modules_wrapper(), sk.get_modules_wrapper()):
        a = wk.ws_assignment.numpy()
        np.testing.assert_array_equal(wt.ws_assignment.numpy(), a.transpose(3, 2, 0, 1) if a.ndim == 4 else a.T)
