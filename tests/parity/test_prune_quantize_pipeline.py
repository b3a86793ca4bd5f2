"""End-to-end prune -> speedup -> PTQ -> integer export, on both backends.

A small residual CNN (conv1 and conv3 meet at an add, so they form one coupled channel group) is pruned
dependency-aware at 50 % of the filters of every conv, sped up (the channels are removed for real), then
calibrated with :class:`PtqQuantizer` and exported to an integer artifact: an int8 QDQ ONNX run by
onnxruntime (torch) and a full-integer TFLite model run by the interpreter (Keras). The artifact must
run, agree in argmax with the fake-quant sped-up model, be much smaller than the float export of the
dense model, and ``count_flops_params`` must show the MAC reduction.

Size bound: halving every conv's filters keeps 1/4 of each C x C conv kernel (input and output channels
both halved) and 1/2 of conv1 (3 input channels) and of the classifier; with C = 64 that is 28,970 of
113,226 parameters (3.9x fewer), and int8 instead of float32 is another 4x (biases stay 32-bit), so
~15x on the weights alone; per-channel scales / zero points, QDQ nodes and graph metadata take part of
that back. Measured (onnx 1.x / TF 2.x here): ONNX 454,555 -> 39,778 bytes (11.4x), TFLite 455,088 ->
35,848 bytes (12.7x). The tests assert >= 8x: above the 6x asked for, with room for exporter overhead
changes across versions. MACs per sample: 7,189,120 -> 1,825,088 (exact, both backends).
"""

from __future__ import annotations

import copy
import os
import warnings

import numpy as np
import pytest

pytestmark = [pytest.mark.torch, pytest.mark.tf]

C = 64          # channels of the residual trunk before pruning
HW = 8          # input spatial size
N_CLASSES = 10
N_EVAL = 128
# per sample: conv1 3->C, conv2..4 C->C (3x3 on HW x HW), fc C->10 ; after 50 % pruning C -> C / 2
DENSE_MACS = HW * HW * 9 * (3 * C + 3 * C * C) + C * N_CLASSES
PRUNED_MACS = HW * HW * 9 * (3 * (C // 2) + 3 * (C // 2) ** 2) + (C // 2) * N_CLASSES
MIN_SIZE_RATIO = 8.0
MIN_AGREEMENT = 0.95


def quarters(rng, *shape):
    return (np.round(rng.standard_normal(shape) * 4) / 4).astype(np.float32)


def make_data(seed, nchw):
    """Calibration batches and evaluation inputs from class prototypes plus noise (structured inputs, so
    the random network's logits have real margins)."""
    rng = np.random.default_rng(seed)
    proto = rng.standard_normal((N_CLASSES, HW, HW, 3)).astype(np.float32)

    def draw(n):
        y = rng.integers(0, N_CLASSES, n)
        x = (proto[y] + 0.5 * rng.standard_normal((n, HW, HW, 3))).astype(np.float32)
        return x.transpose(0, 3, 1, 2).copy() if nchw else x

    calib = [draw(32) for _ in range(4)]
    return calib, draw(N_EVAL)


def agreement(a, b):
    return float(np.mean(np.asarray(a).argmax(1) == np.asarray(b).argmax(1)))


def _check_report(model_file, artifact, weight_params, extra):
    """One report of the pipeline's result: the artifact read as its runtime stores it (int8 weights, the
    sped-up shapes), and the exported model with bits, MACs and both files' sizes in one JSON."""
    import json

    from compressor.app import cli, report

    rows = report.layer_stats(*report.read_weights(artifact))
    assert len(rows) == 5 and {(r.bits, r.dtype) for r in rows} == {(8, "int8")}, [(r.bits, r.dtype) for r in rows]
    assert sum(r.params for r in rows) == weight_params

    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = cli.main(["report", str(model_file), "--artifact", str(artifact), "--flops", "--json", *extra])
    assert rc == 0
    data = json.loads(buf.getvalue())
    assert {r["bits"] for r in data["layers"]} == {8}  # calibration (torch) / quantized grid (Keras)
    assert data["flops"]["macs_dense"] == PRUNED_MACS  # the exported model is the sped-up one
    files = data["files"]
    assert [f["bytes"] for f in files] == [os.path.getsize(model_file), os.path.getsize(artifact)]
    assert files[1]["ratio"] == files[1]["bytes"] / files[0]["bytes"]


# ------------------------------------------------------------------------------------------------ torch


def test_torch_prune_speedup_ptq_onnx(tmp_path):
    torch = pytest.importorskip("torch")
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from torch import nn

    import compressor.torch as cth
    from compressor.core.cpu import exact_onnx_weight_dtype

    from ._pipeline_models import Res

    W8 = exact_onnx_weight_dtype()  # int8 codes, or the same codes + 128 where u8s8 kernels saturate

    torch.manual_seed(0)
    model = Res().eval()
    calib, x_eval = make_data(0, nchw=True)
    dummy = torch.from_numpy(calib[0][:1])

    dense_path = tmp_path / "dense_float.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model), (dummy,), str(dense_path), dynamo=False, input_names=["input"],
                          dynamic_axes={"input": {0: "batch"}})
    dense_macs, dense_params, _ = cth.count_flops_params(model, dummy)
    assert dense_macs == DENSE_MACS

    pruner = cth.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True,
                                dummy_input=dummy)
    pruner.compress()
    small = cth.speedup_model(pruner, dummy).eval()
    assert [getattr(small, f"conv{i}").out_channels for i in (1, 2, 3, 4)] == [C // 2] * 4
    assert small.fc.in_features == C // 2
    macs, params, _ = cth.count_flops_params(small, dummy)
    # conv1 and fc halve, the C x C convs keep a quarter
    assert macs == PRUNED_MACS and dense_macs / macs > 3.9, (macs, dense_macs)
    assert params < 0.26 * dense_params, (params, dense_params)

    q = cth.PtqQuantizer(small, [{"op_types": ["Conv2d", "Linear"], "quant_types": ["input", "weight", "output"],
                                  "quant_bits": 8}], dummy_input=dummy)
    q.calibrate([torch.from_numpy(x) for x in calib])
    path = tmp_path / "pruned_int8.onnx"
    q.export_model(str(tmp_path / "m.pt"), str(tmp_path / "cal.pt"), onnx_path=str(path), input_shape=(1, 3, HW, HW))
    ratio = os.path.getsize(dense_path) / os.path.getsize(path)
    assert ratio >= MIN_SIZE_RATIO, (os.path.getsize(dense_path), os.path.getsize(path))
    weight_params = sum(m.weight.numel() for m in small.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
    _check_report(tmp_path / "m.pt", path, weight_params, ["--calibration", str(tmp_path / "cal.pt"),
                                                           "--model-fn", "tests.parity._pipeline_models:torch_small",
                                                           "--input-shape", f"1,3,{HW},{HW}"])

    # integer weights in the artifact: every conv / gemm weight initializer is 8-bit
    graph = onnx.load(str(path)).graph
    int8 = {i.name for i in graph.initializer if i.data_type == getattr(onnx.TensorProto, W8.upper())}
    weights = [n.input[1] for n in graph.node if n.op_type in ("Conv", "Gemm", "MatMul")]
    producers = {o: n for n in graph.node for o in n.output}
    for w in weights:  # Conv <- DequantizeLinear(int8 initializer)
        assert w in producers and producers[w].op_type == "DequantizeLinear" and producers[w].input[0] in int8, w
    assert len(weights) == 5

    with torch.no_grad():
        fake_quant = small(torch.from_numpy(x_eval)).numpy()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    got = sess.run(None, {sess.get_inputs()[0].name: x_eval})[0]
    assert got.shape == (N_EVAL, N_CLASSES) and np.isfinite(got).all()
    assert agreement(got, fake_quant) >= MIN_AGREEMENT, agreement(got, fake_quant)


# ------------------------------------------------------------------------------------------------ Keras


def test_keras_prune_speedup_ptq_tflite(tmp_path):
    keras = pytest.importorskip("keras")
    tf = pytest.importorskip("tensorflow")

    import compressor.tf as ctf

    keras.utils.set_random_seed(0)
    inp = keras.Input((HW, HW, 3))
    a = keras.layers.Conv2D(C, 3, padding="same", activation="relu", name="conv1")(inp)
    b = keras.layers.Conv2D(C, 3, padding="same", activation="relu", name="conv2")(a)
    b = keras.layers.Conv2D(C, 3, padding="same", name="conv3")(b)
    c = keras.layers.ReLU()(keras.layers.Add()([a, b]))
    c = keras.layers.Conv2D(C, 3, padding="same", activation="relu", name="conv4")(c)
    out = keras.layers.Dense(N_CLASSES, name="fc")(keras.layers.GlobalAveragePooling2D()(c))
    model = keras.Model(inp, out)
    calib, x_eval = make_data(0, nchw=False)

    dense_path = tmp_path / "dense_float.tflite"
    dense_path.write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
    dense_macs, dense_params, _ = ctf.count_flops_params(model)
    assert dense_macs == DENSE_MACS

    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], dependency_aware=True)
    pruner.compress()
    small = ctf.speedup_model(pruner)
    assert [small.get_layer(f"conv{i}").filters for i in (1, 2, 3, 4)] == [C // 2] * 4
    assert small.get_layer("fc").get_weights()[0].shape == (C // 2, N_CLASSES)
    macs, params, _ = ctf.count_flops_params(small)
    assert macs == PRUNED_MACS and dense_macs / macs > 3.9, (macs, dense_macs)
    assert params < 0.26 * dense_params, (params, dense_params)

    q = ctf.PtqQuantizer(small, [{"op_types": ["Conv2D", "Dense"], "quant_types": ["input", "weight", "output"],
                                  "quant_bits": 8}])
    q.calibrate(calib)
    path = tmp_path / "pruned_int8.tflite"
    q.export_model(tmp_path / "m.keras", tmp_path / "cal.json", tflite_path=path, inference_input_type=tf.int8,
                   inference_output_type=tf.int8)
    ratio = os.path.getsize(dense_path) / os.path.getsize(path)
    assert ratio >= MIN_SIZE_RATIO, (os.path.getsize(dense_path), os.path.getsize(path))
    weight_params = sum(int(np.prod(layer.get_weights()[0].shape)) for layer in small.layers
                        if isinstance(layer, (keras.layers.Conv2D, keras.layers.Dense)))
    _check_report(tmp_path / "m.keras", path, weight_params, ["--calibration", str(tmp_path / "cal.json")])

    fake_quant = np.asarray(small(x_eval, training=False))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interp = tf.lite.Interpreter(model_path=str(path), num_threads=1)
    interp.allocate_tensors()
    inp_d, out_d = interp.get_input_details()[0], interp.get_output_details()[0]
    assert inp_d["dtype"] == np.int8 and out_d["dtype"] == np.int8
    assert not [d for d in interp.get_tensor_details() if d["dtype"] == np.float32]  # full integer
    s_in, z_in = inp_d["quantization"]
    s_out, z_out = out_d["quantization"]
    got = []
    for i in range(N_EVAL):
        interp.set_tensor(inp_d["index"], np.clip(np.round(x_eval[i:i + 1] / s_in + z_in), -128, 127).astype(np.int8))
        interp.invoke()
        got.append((interp.get_tensor(out_d["index"])[0].astype(np.float32) - z_out) * s_out)
    got = np.stack(got)
    assert got.shape == (N_EVAL, N_CLASSES) and np.isfinite(got).all()
    assert agreement(got, fake_quant) >= MIN_AGREEMENT, agreement(got, fake_quant)
