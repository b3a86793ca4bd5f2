"""keras-hub Gemma in Keras's own quantized layers (``to_keras_quantized``): its attention's query / key / value
kernels are ``[heads, d, head_dim]`` (``'btd,ndh->btnh'``: the contracted axis d is not first), which Keras's int4 /
GPTQ / AWQ layers view as a plain reshape to ``[d, heads * head_dim]``: rows and columns mix inputs and output
channels. Each set of rows that takes the same (output channel, group) in every column gets one Keras group
(``g_idx``), so the layers hold our codes exactly: codes read back from Keras's variables are ours, outputs are
the fake-quant model's, and the ``.keras`` file reloads with the same outputs."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

keras = pytest.importorskip("keras")
keras_hub = pytest.importorskip("keras_hub")

from compressor.tf import AwqQuantizer, GptqQuantizer, RtnQuantizer, oneshot_codes  # noqa: E402
from compressor.tf.kernel_layout import kernel_layout  # noqa: E402
from compressor.tf.quantization.lowbit import _keras_view, describe_keras_quantized, to_keras_quantized  # noqa: E402

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

VOCAB = 64
IDS = np.random.default_rng(0).integers(1, VOCAB, (4, 8)).astype("int32")
DATA = {"token_ids": IDS, "padding_mask": np.ones_like(IDS)}


def gemma():
    keras.utils.set_random_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return keras_hub.models.GemmaBackbone(vocabulary_size=VOCAB, num_layers=1, num_query_heads=4,
                                              num_key_value_heads=2, hidden_dim=32, intermediate_dim=64, head_dim=8)


@pytest.mark.parametrize("quantizer, cfg, mode", [
    (RtnQuantizer, {"quant_bits": 4}, "int4"),
    (GptqQuantizer, {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine"}, "int4"),
    (AwqQuantizer, {"quant_bits": 4, "group_size": 16}, "awq"),
    (GptqQuantizer, {"quant_bits": 8, "group_size": 16}, "gptq"),
    (RtnQuantizer, {"quant_bits": 4}, "int8"),  # fast=True: Keras's int8 layer, in the kernel's own layout
])
def test_gemma_attention_kernels_hold_our_codes(quantizer, cfg, mode, tmp_path):
    model = gemma()
    q = quantizer(model, [{**cfg, "op_types": ["default"]}])
    q.calibrate() if quantizer is RtnQuantizer else q.calibrate([DATA], progress=False)
    wrappers = {w.name: w for w in q.get_modules_wrapper()}
    assert len(wrappers) == 7
    query = "decoder_block_0/attention/query"
    assert wrappers[query].layer.equation == "btd,ndh->btnh" and tuple(wrappers[query].layer.kernel.shape) == (4, 32, 8)
    want = {}
    for name, w in wrappers.items():
        codes = oneshot_codes(w).astype(np.int64)
        gs = int(w.weight_group_size)
        gs = codes.shape[1] if gs <= 0 else gs
        g = np.arange(codes.shape[1]) // gs
        offsets = codes - np.asarray(w.weight_group_zero_point.numpy()).astype(np.int64)[:, g]
        plan = kernel_layout(name, w.layer)
        want[name] = (offsets, w.layer, plan, _keras_view(plan, mode))
    ref = np.asarray(model(DATA))
    if mode == "int8":
        with pytest.warns(UserWarning, match=r"to_keras_quantized: 7 layer\(s\) go into Keras's int8 layer weight-only "
                                             r"\(decoder_block_0/attention/query, .*Use fast=False"):
            rows = to_keras_quantized(q, fast=True)
    else:
        rows = to_keras_quantized(q)
    assert {r["mode"] for r in rows} == {mode}
    for name, (offsets, layer, plan, (in_of, out_of)) in want.items():
        got = describe_keras_quantized(layer)["offsets"]  # code - zero point in Keras's [rows, cols] view
        expected = plan.from_canonical(offsets) if mode == "int8" else offsets[out_of, in_of]  # int8: kernel-shaped
        assert np.array_equal(got, expected), name
    out = np.asarray(model(DATA))
    assert float(np.abs(out - ref).max() / np.abs(ref).max()) < 2e-6
    if mode == "int8":
        return  # reloads with int8 inputs too (Keras's default int8 config): said by the warning above
    model.save(tmp_path / "gemma.keras")
    again = keras.saving.load_model(tmp_path / "gemma.keras")
    np.testing.assert_array_equal(np.asarray(again(DATA)), out)


def test_the_query_view_mixes_heads_into_rows():
    """Why Gemma needs groups of rows: Keras's int4 view of a [4, 32, 8] query kernel is its reshape to [32, 32],
    whose row r holds head r // 8, input columns 4 (r % 8) .. 4 (r % 8) + 3."""
    model = gemma()
    model(DATA)
    layer = model.get_layer("decoder_block_0").attention.query_dense
    in_of, out_of = _keras_view(kernel_layout("query", layer), "int4")
    assert in_of.shape == (32, 32)
    assert np.array_equal(in_of[9], np.repeat(np.arange(4, 8), 8))
    assert np.array_equal(out_of[9] // 8, np.ones(32, dtype=np.int64))  # all of head 1
