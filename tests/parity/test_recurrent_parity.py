"""Recurrent, embedding and attention weights on both backends: a torch text model's weights copied into
its Keras twin through core's canonical layouts (compressor.core.layouts) give the same outputs, the
same masks (exact floor(n * s) per weight matrix, ties broken by canonical flat index), and the same
quantization scales, matrix by matrix."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import torch
from torch import nn

import compressor.tf as ctf
import compressor.torch as ct
from compressor.core.layouts import gate_order_from_keras, keras_from_canonical, mha_layout_type
from compressor.core.ops import NumpyOps

V, E, T, HEADS = 20, 8, 5, 2
OPS = NumpyOps()
TYPES = ["Embedding", "LSTM", "GRU", "RNN", "MultiheadAttention"]  # one config serves both backends
#: torch slot name -> Keras slot name (the same matrix)
PAIRS = {
    "emb": "emb",
    "lstm.weight_ih_l0": "lstm/kernel", "lstm.weight_hh_l0": "lstm/recurrent_kernel",
    "gru.weight_ih_l0": "gru/kernel", "gru.weight_hh_l0": "gru/recurrent_kernel",
    "rnn.weight_ih_l0": "rnn/kernel", "rnn.weight_hh_l0": "rnn/recurrent_kernel",
    "mha.q_proj": "mha/query", "mha.k_proj": "mha/key", "mha.v_proj": "mha/value",
    "mha.out_proj": "mha/attention_output",
}


class TorchText(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.lstm = nn.LSTM(E, 6, batch_first=True)
        self.gru = nn.GRU(6, 5, batch_first=True)
        self.rnn = nn.RNN(5, E, batch_first=True)
        self.mha = nn.MultiheadAttention(E, HEADS, batch_first=True)
        self.fc = nn.Linear(E, 3)

    def forward(self, x):
        h = self.emb(x)
        h, _ = self.lstm(h)
        h, _ = self.gru(h)
        h, _ = self.rnn(h)
        h, _ = self.mha(h, h, h, need_weights=False)
        return self.fc(h[:, -1])


def keras_text():
    inp = keras.Input((T,), dtype="int32")
    h = keras.layers.Embedding(V, E, name="emb")(inp)
    h = keras.layers.LSTM(6, return_sequences=True, name="lstm")(h)
    h = keras.layers.GRU(5, return_sequences=True, name="gru")(h)  # reset_after=True: torch's GRU
    h = keras.layers.SimpleRNN(E, return_sequences=True, name="rnn")(h)
    h = keras.layers.MultiHeadAttention(HEADS, E // HEADS, name="mha")(h, h)
    return keras.Model(inp, keras.layers.Dense(3, name="fc")(h[:, -1]))


def gate_bias(kind, b):
    """A torch gate-packed bias vector in Keras' gate order."""
    order = gate_order_from_keras(kind)
    h = len(b) // len(order)
    out = np.empty_like(b)
    for i, j in enumerate(order):
        out[j * h:(j + 1) * h] = b[i * h:(i + 1) * h]
    return out


def copy_into_keras(tm, km):
    """Every torch weight into the Keras twin, through the canonical layouts."""
    p = {k: v.detach().numpy().astype(np.float32) for k, v in tm.state_dict().items()}
    km.get_layer("emb").embeddings.assign(p["emb.weight"])
    for name, kind in (("lstm", "LSTM"), ("gru", "GRU"), ("rnn", "SimpleRNN")):
        cell = km.get_layer(name).cell
        cell.kernel.assign(keras_from_canonical(OPS, kind, p[f"{name}.weight_ih_l0"], cell.kernel.shape))
        cell.recurrent_kernel.assign(keras_from_canonical(OPS, kind, p[f"{name}.weight_hh_l0"],
                                                          cell.recurrent_kernel.shape))
        b_ih, b_hh = p[f"{name}.bias_ih_l0"], p[f"{name}.bias_hh_l0"]
        if kind == "GRU":  # reset_after: input and recurrent biases apart, [2, 3 * units]
            cell.bias.assign(np.stack([gate_bias("GRU", b_ih), gate_bias("GRU", b_hh)]))
        else:
            cell.bias.assign(b_ih + b_hh)
    mha = km.get_layer("mha")
    w, b = p["mha.in_proj_weight"], p["mha.in_proj_bias"]
    for i, (role, dense) in enumerate((("query", mha._query_dense), ("key", mha._key_dense),
                                       ("value", mha._value_dense))):
        dense.kernel.assign(keras_from_canonical(OPS, mha_layout_type(role), w[i * E:(i + 1) * E], dense.kernel.shape))
        dense.bias.assign(b[i * E:(i + 1) * E].reshape(dense.bias.shape))
    out = mha._output_dense
    out.kernel.assign(keras_from_canonical(OPS, mha_layout_type("output"), p["mha.out_proj.weight"], out.kernel.shape))
    out.bias.assign(p["mha.out_proj.bias"])
    km.get_layer("fc").kernel.assign(p["fc.weight"].T)
    km.get_layer("fc").bias.assign(p["fc.bias"])


def twins(tied_values=False):
    torch.manual_seed(0)
    tm = TorchText().eval()
    if tied_values:  # few distinct magnitudes: the masks depend on the tie-break order
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for prm in tm.parameters():
                prm.copy_(torch.randint(-2, 3, prm.shape, generator=g).float() * 0.25)
    km = keras_text()
    copy_into_keras(tm, km)
    x = np.random.default_rng(0).integers(0, V, (4, T))
    return tm, km, x


def outputs(tm, km, x):
    with torch.no_grad():
        a = tm(torch.as_tensor(x)).numpy()
    return a, km.predict(x, verbose=0)


def test_the_canonical_layouts_map_the_same_model():
    tm, km, x = twins()
    a, b = outputs(tm, km, x)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("sparsity", [0.3, 0.55])
def test_same_masks_per_weight_matrix(sparsity):
    tm, km, x = twins(tied_values=True)
    config = [{"sparsity": sparsity, "op_types": TYPES}]
    tp = ct.LevelPruner(tm, config)
    tp.compress()
    kp = ctf.LevelPruner(km, config)
    kp.compress()
    tmasks = {w.name: w.weight_mask.numpy() for w in tp.get_modules_wrapper()}
    kmasks = {w.name: w.canonical_mask().numpy() for w in kp.get_modules_wrapper()}
    assert set(tmasks) == set(PAIRS) and set(kmasks) == set(PAIRS.values())
    for tname, kname in PAIRS.items():
        t, k = tmasks[tname], kmasks[kname]
        assert t.shape == k.shape, tname
        assert int((~t).sum()) == math.floor(t.size * sparsity), tname
        np.testing.assert_array_equal(t, k, err_msg=f"{tname} vs {kname}")
    a, b = outputs(tm, km, x)  # the same weights are zeroed: still the same model
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_same_qat_scales_and_outputs():
    tm, km, x = twins()
    config = [{"quant_types": ["weight"], "quant_bits": 8, "op_types": TYPES,
               "quant_dtype": "int", "quant_scheme": "per_tensor_symmetric"}]
    tq = ct.QAT_Quantizer(tm, config)
    tq.compress()
    kq = ctf.QAT_Quantizer(km, config)
    kq.compress()
    a, b = outputs(tm, km, x)  # forward passes record the weight scales
    tw = {w.name: w for w in tq.get_modules_wrapper()}
    kw = {w.name: w for w in kq.get_modules_wrapper()}
    for tname, kname in PAIRS.items():
        np.testing.assert_allclose(tw[tname].weight_scale.numpy(), kw[kname].weight_scale.numpy(), rtol=1e-6,
                                   err_msg=tname)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    torch.manual_seed(0)
    with torch.no_grad():
        float_out = TorchText().eval()(torch.as_tensor(x)).numpy()
    assert np.abs(a - float_out).max() > 1e-6  # the matrices really are quantized in the forward
