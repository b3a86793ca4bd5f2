"""Canonical layouts of recurrent / embedding / attention matrices (core.layouts) and the note on what
``op_types: ['default']`` leaves out (core.matching.default_skip_warning). Numpy only."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compressor.core.errors import ConfigError
from compressor.core.layouts import (
    canonical_from_keras,
    canonical_shape_from_keras,
    check_slot_config,
    gate_order_from_keras,
    keras_from_canonical,
    mha_layout_type,
    torch_recurrent_weights,
)
from compressor.core.matching import DefaultSkipWarning, LayerInfo, match_layers, type_names
from compressor.core.ops import NumpyOps

ops = NumpyOps()


def test_gate_orders():
    assert gate_order_from_keras("LSTM") == (0, 1, 2, 3)  # Keras i, f, c, o == torch i, f, g, o
    assert gate_order_from_keras("GRU") == (1, 0, 2)  # Keras z, r, h -> torch r, z, n
    assert gate_order_from_keras("RNN") == (0,)


def test_gru_kernel_blocks_are_reordered_into_torch_order():
    units, n_in = 2, 3
    # Keras kernel [in, 3 * units]: column block 0 = z, 1 = r, 2 = h; value = 10 * block + column in block
    k = np.array([[10 * (c // units) + c % units + 100 * i for c in range(3 * units)] for i in range(n_in)], float)
    canon = canonical_from_keras(ops, "GRU", k)
    assert canon.shape == (3 * units, n_in)
    # canonical rows: r (Keras block 1), z (block 0), n (block 2); row r of gate g = Keras column g*units + r
    assert canon[:, 0].tolist() == [10, 11, 0, 1, 20, 21]
    assert canon[:, 2].tolist() == [210, 211, 200, 201, 220, 221]
    np.testing.assert_array_equal(keras_from_canonical(ops, "GRU", canon, k.shape), k)


def test_lstm_and_simple_rnn_are_a_transpose_embedding_is_unchanged():
    k = np.arange(24.0).reshape(3, 8)
    for t in ("LSTM", "LSTMCell", "SimpleRNN", "SimpleRNNCell", "RNN"):
        np.testing.assert_array_equal(canonical_from_keras(ops, t, k), k.T)
    np.testing.assert_array_equal(canonical_from_keras(ops, "Embedding", k), k)
    assert canonical_from_keras(ops, "Dense", k) is None  # not core's business


def test_attention_projection_layouts():
    q = np.arange(2 * 3 * 4.0).reshape(2, 3, 4)  # [in=2, heads=3, head_dim=4]
    canon = canonical_from_keras(ops, mha_layout_type("query"), q)
    assert canon.shape == (12, 2) and canon[5, 1] == q[1, 1, 1]  # row h * head_dim + d
    o = np.arange(3 * 4 * 5.0).reshape(3, 4, 5)  # [heads, head_dim, out]
    canon = canonical_from_keras(ops, mha_layout_type("output"), o)
    assert canon.shape == (5, 12) and canon[4, 7] == o[1, 3, 4]
    assert canonical_shape_from_keras(mha_layout_type("output"), o.shape) == (5, 12)
    assert canonical_shape_from_keras(mha_layout_type("key"), q.shape) == (12, 2)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["LSTM", "GRU", "SimpleRNN", "GRUCell", "Embedding", mha_layout_type("value"),
                        mha_layout_type("output")]),
       st.integers(1, 3), st.integers(1, 3), st.integers(1, 3))
def test_round_trip_and_static_shape(layout_type, a, b, c):
    if layout_type.startswith("MultiHead"):
        shape = (a, b, c)
    elif layout_type == "Embedding":
        shape = (a, b)
    else:
        shape = (a, {"GRU": 3, "GRUCell": 3, "LSTM": 4}.get(layout_type, 1) * b)
    x = np.random.default_rng(a * 100 + b * 10 + c).normal(size=shape)
    canon = canonical_from_keras(ops, layout_type, x)
    assert canon.shape == canonical_shape_from_keras(layout_type, shape)
    np.testing.assert_array_equal(keras_from_canonical(ops, layout_type, canon, shape), x)


def test_torch_recurrent_weight_names():
    assert torch_recurrent_weights(1, False) == ["weight_ih_l0", "weight_hh_l0"]
    assert torch_recurrent_weights(2, True, proj_size=3) == [
        "weight_ih_l0", "weight_hh_l0", "weight_hr_l0", "weight_ih_l0_reverse", "weight_hh_l0_reverse",
        "weight_hr_l0_reverse", "weight_ih_l1", "weight_hh_l1", "weight_hr_l1", "weight_ih_l1_reverse",
        "weight_hh_l1_reverse", "weight_hr_l1_reverse"]


def test_type_aliases_of_recurrent_layers():
    assert type_names("RNN") == {"RNN", "SimpleRNN"}
    assert type_names("SimpleRNNCell") == {"RNNCell", "SimpleRNNCell"}
    assert type_names("MultiHeadAttention") == {"MultiheadAttention", "MultiHeadAttention"}


@pytest.mark.parametrize("layer_type, config, match", [
    ("LSTM", {"quant_types": ["weight", "output"]}, r"'lstm' \(LSTM\): quant_types \['weight', 'output'\]"),
    ("MultiheadAttention", {"quant_types": ["input"]}, "weight matrices only"),
    ("Embedding", {"quant_types": ["input"]}, "token indices"),
    ("GRU", {"quant_types": ["weight"], "quant_scheme": "per_channel_symmetric"}, "per_tensor"),
    ("Embedding", {"quant_types": ["weight"], "quant_scheme": {"weight": "per_channel_affine"}}, "per_tensor"),
])
def test_slot_config_refusals(layer_type, config, match):
    with pytest.raises(ConfigError, match=match):
        check_slot_config("Q", "lstm", layer_type, config)


def test_slot_config_accepts_weight_quantization_and_pruning():
    check_slot_config("Q", "l", "LSTM", {"quant_types": ["weight"], "quant_scheme": "per_tensor_symmetric"})
    check_slot_config("Q", "e", "Embedding", {"quant_types": ["weight", "output"]})
    check_slot_config("P", "l", "LSTM", {"sparsity": 0.5})
    check_slot_config("Q", "c", "Conv2d", {"quant_types": ["input"], "quant_scheme": "per_channel_affine"})


# ------------------------------------------------------------------------------------------ 'default'
def info(name, type_, params, weighted=True):
    return LayerInfo(name, type_, {"params": params, "weighted": weighted})


def text_model():
    return [info("", "Net", 0, False), info("emb", "Embedding", 600), info("lstm", "LSTM", 0, True),
            info("lstm/lstm_cell", "LSTMCell", 250), info("mha", "MultiHeadAttention", 0, True),
            info("mha/query", "EinsumDense", 40), info("mha/attention_output", "EinsumDense", 40),
            info("norm", "LayerNormalization", 20), info("fc", "Dense", 50), info("drop", "Dropout", 0, False)]


def test_default_names_what_it_leaves_out_and_its_share():
    with pytest.warns(DefaultSkipWarning) as rec:
        selected = match_layers(text_model(), [{"op_types": ["default"], "exclude": False}], ("Dense",), what="P")
    assert [i.name for i, _ in selected] == ["fc"]
    assert len(rec) == 1
    # total 1000 parameters: Embedding 600, LSTM (its cell) 250, attention (its projections) 80; the norm
    # and the selected Dense are not reported
    assert str(rec[0].message) == (
        "P: op_types ['default'] (Dense) leaves out weighted layers of type Embedding (1 layer, 60.0% of the "
        "parameters), LSTM (1 layer, 25.0% of the parameters), MultiHeadAttention (1 layer, 8.0% of the "
        "parameters); to compress them too, add ['Embedding', 'LSTM', 'MultiHeadAttention'] to op_types "
        "(Embedding, recurrent and attention layers are supported)")


def test_no_note_when_nothing_is_left_out_or_the_user_named_them():
    config = [{"op_types": ["default", "Embedding", "LSTM"], "exclude": False},
              {"op_names": ["mha"], "exclude": True}]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DefaultSkipWarning)
        match_layers(text_model(), config, ("Dense",))  # everything is selected or named
        match_layers(text_model(), [{"op_types": ["Dense"], "exclude": False}], ("Dense",))  # no 'default'
        match_layers([info("fc", "Dense", 50)], [{"op_types": ["default"], "exclude": False}], ("Dense",))


def test_family_norms_are_not_reported_and_a_compressor_gives_its_own_advice():
    from compressor.core.layouts import is_norm_type

    assert [is_norm_type(t) for t in ("LlamaRMSNorm", "ConvNextLayerNorm", "ConvNextV2GRN", "BatchNorm2d",
                                      "Dense", "Embedding", "Normalizer")] == [True, True, True, True, False,
                                                                                False, False]
    layers = [info("emb", "Embedding", 60), info("norm", "LlamaRMSNorm", 20), info("fc", "Dense", 20)]
    with pytest.warns(DefaultSkipWarning) as rec:
        match_layers(layers, [{"op_types": ["default"], "exclude": False}], ("Dense",), what="Q",
                     skip_hint="Linear-like layers only")
    assert str(rec[0].message) == ("Q: op_types ['default'] (Dense) leaves out weighted layers of type Embedding "
                                   "(1 layer, 60.0% of the parameters); Linear-like layers only")
