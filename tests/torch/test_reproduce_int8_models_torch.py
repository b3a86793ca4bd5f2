"""examples/reproduce_int8_models.py end to end on a tiny residual CNN and a tiny Llama (torch / onnxruntime):
the accuracies and perplexities come from the written ONNX files run in onnxruntime."""

import math

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from compressor.app.data import load_digits  # noqa: E402
from examples import llm_common as lc  # noqa: E402
from examples import reproduce_int8_models as r  # noqa: E402


def test_cnn_accuracies_are_the_files_in_onnxruntime(tmp_path):
    ds = load_digits(seed=0).subset(300, 120)
    res = r.cnn_torch(ds, str(tmp_path), epochs=2, seed=0, width=4)
    x = np.ascontiguousarray(ds.x_test[:, None]).astype(np.float32)
    for v in ("float", "ours", "anchor"):
        again = float((r.onnx_outputs(res["paths"][v], x).argmax(1) == ds.y_test).mean())
        assert res[v] == again
        assert 0.0 <= res[v] <= 1.0
    # ours: every conv / the head / both residual adds / the global average pool are integer kernels
    assert res["ours_kernels"] == ("QGemm 1, QLinearAdd 2, QLinearConv 6, QLinearGlobalAveragePool 1")
    assert res["float_kernels"] == "-"
    row = r.cnn_row("residual CNN, digits", "torch", res)
    assert row[-1] == ("yes" if 1 - res["ours"] <= 1 - res["float"] + 0.003 + 1e-12 else "no")


def test_llm_perplexities_are_the_files_in_onnxruntime(tmp_path):
    model = lc.build_llama(0, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=16)
    rng = np.random.default_rng(0)
    held, calib = rng.integers(0, 256, (2, 17)), rng.integers(0, 256, (8, 16))
    res = r.llm_torch(model, calib, held, str(tmp_path))
    assert set(res["paths"]) == {"float", "ours-dynamic", "ours-static", "anchor-dynamic"}
    for v, path in res["paths"].items():
        assert math.isfinite(res[v])
        assert res[v] == r.onnx_perplexity(path, held)
    # the float file is the float model; ours quantizes the 7 decoder Linears, lm_head stays float
    assert res["float"] == pytest.approx(res["framework_float"], rel=1e-5)
    assert res["ours-dynamic"] != res["float"]
    assert res["ours-dynamic_kernels"] == "DynamicQuantizeMatMul 2, MatMulIntegerToFloat 5"
    assert res["ours-static_kernels"] == "QLinearMatMul 7"
    assert res["anchor-dynamic_kernels"] == "DynamicQuantizeMatMul 2, MatMulIntegerToFloat 5"
