"""One-shot codes in Keras 3's own int8 / int4 / GPTQ / AWQ layers (issue 26, item 2): ``to_keras_quantized``,
the variables it writes, outputs vs the fake-quant model, ``.keras`` files that reload in a process without
compressor, ``compressor report`` on them, and refusals before anything changes.

The model is a Functional one of stock layers (so the file loads with nothing but Keras): a nested
Sequential MLP block, a query-style EinsumDense ``abc,cde->abde`` ([16, 2, 8]) and an output-style one
``abcd,cde->abe`` ([2, 8, 16]), then a Dense head."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from compressor.app.cli import main as cli_main  # noqa: E402
from compressor.core.errors import ConfigError, ModelError  # noqa: E402
from compressor.tf import AwqQuantizer, GptqQuantizer, RtnQuantizer, oneshot_codes  # noqa: E402
from compressor.tf.compressor import wrappers_of  # noqa: E402
from compressor.tf.quantization.lowbit import (  # noqa: E402
    describe_keras_quantized,
    keras_quantized_variables,
    to_keras_quantized,
)

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore:.*leaves out weighted layers"),
              pytest.mark.filterwarnings("ignore:.*not a chain of blocks")]

D, SEQ = 16, 6
RNG = np.random.default_rng(0)
CALIB = RNG.normal(size=(8, SEQ, D)).astype("float32")
HELD = RNG.normal(size=(4, SEQ, D)).astype("float32")
NAMES = ["block/up", "block/down", "q", "o", "head"]


def model(seed: int = 0) -> keras.Model:
    keras.utils.set_random_seed(seed)
    x = keras.Input((SEQ, D))
    block = keras.Sequential([keras.layers.Dense(32, activation="relu", name="up"), keras.layers.Dense(D, name="down")],
                             name="block")
    h = x + block(x)
    e = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 8), bias_axes="de", name="q")(h)
    o = keras.layers.EinsumDense("abcd,cde->abe", output_shape=(None, D), name="o")(e)
    return keras.Model(x, keras.layers.Dense(8, name="head")(h + o))


def quantized(cls, cfg):
    m = model()
    q = cls(m, [{**cfg, "op_types": ["default"]}])
    q.calibrate() if cls is RtnQuantizer else q.calibrate(CALIB, progress=False)
    return m, q


#: case -> (quantizer, config, fast, Keras mode of every layer, dtype policy of block/up)
CASES = {
    "rtn-w4-g8": (RtnQuantizer, {"quant_bits": 4, "group_size": 8}, False, "int4", "int4/8_from_float32"),
    "rtn-w4-channel": (RtnQuantizer, {"quant_bits": 4}, False, "int4", "int4/-1_from_float32"),
    "rtn-w4-channel-fast": (RtnQuantizer, {"quant_bits": 4}, True, "int8", "int8_from_float32"),
    "rtn-w8-channel": (RtnQuantizer, {"quant_bits": 8}, False, "int8", "int8_from_float32"),
    "gptq-w4-g8-affine": (GptqQuantizer, {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine"}, False, "int4",
                          "int4/8_from_float32"),
    "gptq-w8-g8-actorder": (GptqQuantizer, {"quant_bits": 8, "group_size": 8, "act_order": True}, False, "gptq",
                            "gptq/8/8_from_float32"),
    "gptq-w3-g8": (GptqQuantizer, {"quant_bits": 3, "group_size": 8}, False, "int4", "int4/8_from_float32"),
    "rtn-w6-channel": (RtnQuantizer, {"quant_bits": 6}, False, "int8", "int8_from_float32"),
    "rtn-w5-g8": (RtnQuantizer, {"quant_bits": 5, "group_size": 8}, False, "gptq", "gptq/8/8_from_float32"),
    "awq-w4-g8": (AwqQuantizer, {"quant_bits": 4, "group_size": 8}, False, "awq", "awq/4/8_from_float32"),
}


#: the cases of the fast run: Keras int4 (grouped), GPTQ mode (8 bit, act_order), AWQ mode; the rest are slow
FAST = ("rtn-w4-g8", "gptq-w8-g8-actorder", "awq-w4-g8")
CASE_PARAMS = [pytest.param(c, marks=() if c in FAST else pytest.mark.slow) for c in CASES]


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """case -> (fake-quant outputs, Keras-quantized outputs, rows, .keras path, model), made on first use"""
    d = tmp_path_factory.mktemp("lowbit")

    class Cache(dict):
        def __missing__(self, case):
            cls, cfg, fast, _, _ = CASES[case]
            m, q = quantized(cls, cfg)
            ref = m(HELD).numpy()
            rows = to_keras_quantized(q, fast=fast)
            got = m(HELD).numpy()
            path = str(d / f"{case}.keras")
            m.save(path)
            self[case] = (ref, got, rows, path, m)
            return self[case]

    return Cache()


@pytest.mark.parametrize("case", CASE_PARAMS)
def test_keras_runs_our_codes_with_its_own_quantized_layers(converted, case):
    ref, got, rows, _, m = converted[case]
    mode, policy = CASES[case][3], CASES[case][4]
    assert [r["layer"] for r in rows] == NAMES
    assert {r["mode"] for r in rows} == {mode}
    up = m.get_layer("block").get_layer("up")
    assert up.dtype_policy.name == policy
    assert up.quantization_mode == mode
    for p, layer in [("q", m.get_layer("q")), ("o", m.get_layer("o"))]:
        assert layer.quantization_mode == mode, p
    assert not any(wrappers_of(layer) for layer in m._flatten_layers())
    # Keras dequantizes in float32 (one more rounding than our float64 -> float32 kernel): measured <= 6e-7
    # of the output scale on these cases
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    assert not np.array_equal(ref, model()(HELD).numpy())  # (the codes did change the model)


def test_oneshot_codes_refuses_a_wrapper_without_codes():
    m, q = quantized(RtnQuantizer, {"quant_bits": 4, "group_size": 8})
    w = q.get_modules_wrapper()[0]
    assert oneshot_codes(w).shape[1] == 2 * w.weight_codes.shape[1]
    fresh = GptqQuantizer(model(), [{"quant_bits": 4, "op_types": ["default"]}])  # not calibrated
    with pytest.raises(ModelError, match="holds no integer codes"):
        oneshot_codes(fresh.get_modules_wrapper()[0])


def test_int4_variables_hold_our_codes_scales_and_zero_points():
    m, q = quantized(RtnQuantizer, {"quant_bits": 4, "group_size": 8, "quant_scheme": "affine"})
    w = {x.name: x for x in q.get_modules_wrapper()}["block/up"]
    codes, scale, zp = oneshot_codes(w), w.weight_group_scale.numpy(), w.weight_group_zero_point.numpy()
    assert w.weight_codes.shape == (32, 8) and w.weight_codes.dtype == tf.uint8  # two 4-bit codes per byte
    assert codes.shape == (32, 16) and scale.shape == (32, 2) and codes.dtype == np.uint8
    to_keras_quantized(q)
    up = m.get_layer("block").get_layer("up")
    assert up._kernel.shape == (16, 16) and up._kernel.dtype == "int8"  # [in, out/2] packed nibbles
    unpacked = np.asarray(keras.quantizers.unpack_int4(up._kernel, 32, axis=-1))
    np.testing.assert_array_equal(unpacked, codes.T.astype(np.int32) - 8)  # unsigned [0, 15] -> [-8, 7]
    np.testing.assert_array_equal(up.kernel_zero.numpy(), zp.T - 8)
    np.testing.assert_array_equal(up.kernel_scale.numpy(), scale.T.astype(np.float32))
    np.testing.assert_array_equal(up.g_idx.numpy(), np.arange(16) // 8)


def test_einsum_int4_layout_matches_keras_own_quantize():
    """Our codes for the query EinsumDense sit where Keras's own ``quantize('int4')`` puts its codes: Keras's
    per-channel int4 of a kernel that already is ``q * s`` (max |q| = 7 per output) gives back q * 8/7 rounded
    -> compare the sign pattern and the dequantized kernels instead of the codes."""
    m, q = quantized(RtnQuantizer, {"quant_bits": 4})
    fake = m.get_layer("q").kernel.numpy()
    twin = keras.layers.EinsumDense("abc,cde->abde", output_shape=(None, 2, 8), bias_axes="de")
    twin.build((None, SEQ, D))
    twin.kernel.assign(fake)
    twin.quantize("int4", config=keras.quantizers.Int4QuantizationConfig(block_size=-1))
    to_keras_quantized(q)
    ours = m.get_layer("q")
    assert ours._kernel.shape == twin._kernel.shape == (16, 8)
    assert ours.kernel_scale.shape == twin.kernel_scale.shape == (16,)
    np.testing.assert_array_equal(np.sign(np.asarray(keras.quantizers.unpack_int4(ours._kernel, 16, axis=-1))),
                                  np.sign(np.asarray(keras.quantizers.unpack_int4(twin._kernel, 16, axis=-1))))
    deq = np.asarray(keras.quantizers.unpack_int4(ours._kernel, 16, axis=-1)) / ours.kernel_scale.numpy()
    np.testing.assert_allclose(deq.reshape(fake.shape), fake, rtol=1e-6, atol=1e-8)


def test_int8_matches_keras_own_int8_of_the_same_weights():
    """8-bit symmetric per-channel RTN = Keras's own AbsMax int8 of the float weights (same grid)."""
    m = model()
    floats = {n: (m.get_layer("block").get_layer(n.split("/")[1]) if "/" in n else m.get_layer(n)).kernel.numpy()
              for n in NAMES}
    q = RtnQuantizer(m, [{"quant_bits": 8, "op_types": ["default"]}])
    q.calibrate()
    to_keras_quantized(q)
    twin = keras.layers.Dense(32)
    twin.build((None, D))
    twin.kernel.assign(floats["block/up"])
    twin.quantize("int8")
    up = m.get_layer("block").get_layer("up")
    assert np.mean(up._kernel.numpy() == twin._kernel.numpy()) >= 0.99  # ties at .5 may round apart
    np.testing.assert_allclose(up.kernel_scale.numpy(), twin.kernel_scale.numpy(), rtol=1e-6)


CHILD = textwrap.dedent("""
    import importlib.util, json, os, sys
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not (f if isinstance(f, type) else type(f)).__module__.startswith("__editable__")]
    sys.path_hooks[:] = [h for h in sys.path_hooks if not getattr(h, "__module__", "").startswith("__editable__")]
    sys.path_importer_cache.clear()
    sys.path[:] = [p for p in sys.path if not os.path.isdir(os.path.join(p or ".", "compressor"))]
    assert importlib.util.find_spec("compressor") is None, "compressor is importable"
    import numpy as np
    import keras
    paths, x = json.loads(sys.argv[1]), np.load(sys.argv[2])
    out = {}
    for case, path in paths.items():
        m = keras.saving.load_model(path)
        up = m.get_layer("block").get_layer("up")
        out[case] = m(x).numpy()
        out[case + ":mode"] = np.array(up.quantization_mode)
    assert not any(k == "compressor" or k.startswith("compressor.") for k in sys.modules)
    np.savez(sys.argv[3], **out)
""")


def _reload_elsewhere(converted, cases, tmp_path):
    paths = {case: converted[case][3] for case in cases}
    np.save(tmp_path / "x.npy", HELD)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(TF_CPP_MIN_LOG_LEVEL="3", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-I", "-c", CHILD, json.dumps(paths), str(tmp_path / "x.npy"),
                        str(tmp_path / "out.npz")], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    got = np.load(tmp_path / "out.npz")
    for case in cases:
        live = converted[case][1]
        assert str(got[case + ":mode"]) == CASES[case][3]
        np.testing.assert_allclose(got[case], live, rtol=0, atol=1e-6 * np.abs(live).max())


def test_keras_files_reload_without_compressor_and_compute_the_same(converted, tmp_path):
    _reload_elsewhere(converted, FAST, tmp_path)


@pytest.mark.slow
def test_every_mode_reloads_without_compressor(converted, tmp_path):
    _reload_elsewhere(converted, [c for c in CASES if c not in FAST], tmp_path)


def test_report_reads_bits_group_size_and_bytes(converted, capsys):
    path = converted["rtn-w4-g8"][3]
    assert cli_main(["report", path, "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)}
    up = rows["block/up"]
    assert (up["bits"], up["group_size"], up["dtype"], up["bits_source"]) == (4, 8, "int4", "keras int4")
    # packed codes [16, 16] int8 + scales [2, 32] f32 + zero points [2, 32] int8 + g_idx [16] f32
    assert up["bytes"] == 256 + 256 + 64 + 64
    assert up["params"] == 16 * 32 and up["shape"] == [16, 32]
    assert rows["q"]["bytes"] == 16 * 8 + 2 * 16 * 4 + 2 * 16 + 16 * 4
    assert cli_main(["report", path]) == 0
    text = capsys.readouterr().out
    assert "4 (keras int4)" in text and "bytes as float32" in text
    gptq = converted["gptq-w8-g8-actorder"][3]
    assert cli_main(["report", gptq, "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)}
    assert (rows["block/up"]["bits"], rows["block/up"]["group_size"], rows["block/up"]["dtype"]) == (8, 8, "int8")
    # uint8 codes [32, 16] + scales [32, 2] f32 + zero points [32, 2] uint8 + g_idx [16] f32
    assert rows["block/up"]["bytes"] == 512 + 256 + 64 + 64


def test_report_counts_pruned_weights_as_zeros(tmp_path, capsys):
    from compressor.tf import SparseGPTPruner

    m = model()
    SparseGPTPruner(m, [{"sparsity": 0.5, "op_types": ["default"]}]).calibrate(CALIB, progress=False)
    q = GptqQuantizer(m, [{"quant_bits": 4, "group_size": 8, "quant_scheme": "affine", "op_types": ["default"]}])
    q.calibrate(CALIB, progress=False)
    ref = m(HELD).numpy()
    to_keras_quantized(q)
    np.testing.assert_allclose(m(HELD).numpy(), ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    m.save(tmp_path / "m.keras")
    assert cli_main(["report", str(tmp_path / "m.keras"), "--json"]) == 0
    rows = {r["layer"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["block/up"]["zeros"] == 256 and rows["block/up"]["sparsity"] == 0.5
    assert describe_keras_quantized(m.get_layer("block").get_layer("up"))["offsets"].shape == (16, 32)


def test_refusals_leave_the_model_untouched():
    m, q = quantized(AwqQuantizer, {"quant_bits": 8, "group_size": 8})
    ref = m(HELD).numpy()
    with pytest.raises(ConfigError, match=r"'block/up' \(Dense\): 8-bit AWQ codes have no stock Keras layout"):
        to_keras_quantized(q)
    assert all(wrappers_of(layer) for layer in [m.get_layer("q"), m.get_layer("head")])
    assert m.get_layer("q").quantization_mode is None
    np.testing.assert_array_equal(m(HELD).numpy(), ref)
    m2 = model()
    q2 = RtnQuantizer(m2, [{"quant_bits": 4, "op_types": ["default"]}])
    with pytest.raises(ConfigError, match="not calibrated"):
        to_keras_quantized(q2)
    with pytest.raises(ConfigError, match="has no calibrated"):
        to_keras_quantized(model())
    with pytest.raises(ConfigError, match="one-shot quantizer"):
        to_keras_quantized("model.keras")
    m3, q3 = quantized(RtnQuantizer, {"quant_bits": 4})
    to_keras_quantized(q3)
    with pytest.raises(ConfigError, match="'block/up' was converted already"):
        to_keras_quantized(q3)
    layer = keras.layers.Dense(4)
    layer.build((None, 8))
    with pytest.raises(ConfigError, match=r"do not fit its \[out, in\] = \[4, 8\]"):
        keras_quantized_variables("d", layer, np.zeros((8, 4)), np.ones((4, 1)), np.zeros((4, 1)), -1, 4, True)


@pytest.mark.slow
def test_keras_hub_llama_backbone_round_trip(tmp_path):
    """keras-hub's layers (EinsumDense attention projections, Dense FFN inside TransformerDecoder blocks)."""
    keras_hub = pytest.importorskip("keras_hub")
    bb = keras_hub.models.LlamaBackbone(vocabulary_size=64, num_layers=2, num_query_heads=2, hidden_dim=16,
                                        intermediate_dim=32, num_key_value_heads=2)
    ids = np.random.default_rng(0).integers(0, 64, (4, 8)).astype("int32")
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    q = GptqQuantizer(bb, [{"quant_bits": 4, "group_size": 8, "op_types": ["default"]}])
    q.calibrate([x], progress=False)
    ref = bb(x).numpy()
    rows = q.to_keras_quantized()
    assert len(rows) == 14 and {r["mode"] for r in rows} == {"int4"}
    assert rows[0]["layer"] == "transformer_layer_0/self_attention/query" and rows[0]["type"] == "EinsumDense"
    got = bb(x).numpy()
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6 * np.abs(ref).max())
    bb.save(tmp_path / "hub.keras")
    again = keras.saving.load_model(tmp_path / "hub.keras")
    np.testing.assert_array_equal(again(x).numpy(), got)
