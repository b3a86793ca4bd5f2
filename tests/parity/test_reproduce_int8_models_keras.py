"""examples/reproduce_int8_models.py end to end on a tiny residual CNN and a tiny Llama (Keras / TFLite): the
accuracies and perplexities come from the written .tflite files run in the TFLite interpreter."""

import math

import numpy as np
import pytest

from compressor.app.data import load_digits
from examples import llm_common as lc
from examples import reproduce_int8_models as r

# in tests/parity (both frameworks): the Llama's weights come from the HF model (examples/llm_common.py)


def test_cnn_accuracies_are_the_files_in_the_interpreter(tmp_path):
    ds = load_digits(seed=0).subset(300, 120)
    res = r.cnn_tf(ds, str(tmp_path), epochs=2, seed=0, width=4)
    x = np.ascontiguousarray(ds.x_test[..., None]).astype(np.float32)
    for v in ("float", "ours", "anchor"):
        assert res[v] == float((r.tflite_outputs(res["paths"][v], x).argmax(1) == ds.y_test).mean())
    # full integer: the 6 convs (BN folded), both residual adds, the global average pool (MEAN) and the head
    assert res["ours_kernels"] == "ADD int8 2, CONV_2D int8 6, FULLY_CONNECTED int8 1, MEAN int8 1"
    assert res["float_kernels"] == "ADD float 2, CONV_2D float 6, FULLY_CONNECTED float 1, MEAN float 1"


def test_llm_perplexities_are_the_files_in_the_interpreter(tmp_path):
    # width 32: every projection has >= 1024 weights, which the converter's dynamic-range mode needs to quantize
    model = lc.build_llama(0, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=16)
    held = np.random.default_rng(0).integers(0, 256, (2, 17))
    res = r.llm_tf(model, held, str(tmp_path))
    assert set(res["paths"]) == {"float", "ours-dynamic", "anchor-dynamic"}
    for v, path in res["paths"].items():
        assert math.isfinite(res[v])
        assert res[v] == r.tflite_perplexity(path, held)
    assert res["float"] == pytest.approx(res["framework_float"], rel=1e-5)
    assert res["ours-dynamic"] != res["float"]
    # every projection int8 in both, lm_head included in ours although excluded from the quantizer: the converter's
    # dynamic-range mode quantizes every weight of >= 1024 elements (see the script's docstring); RMSNorm (MEAN,
    # ADD), the score / context matmuls (BATCH_MATMUL) and the residual adds stay float
    assert res["ours-dynamic_kernels"] == "ADD float 9, BATCH_MATMUL float 2, FULLY_CONNECTED int8 8, MEAN float 3"
    assert res["anchor-dynamic_kernels"] == res["ours-dynamic_kernels"]
    assert res["float_kernels"] == "ADD float 9, BATCH_MATMUL float 2, FULLY_CONNECTED float 8, MEAN float 3"
