"""``compressor demo --quick`` on PyTorch: the table carries the measured numbers, the exported pruned
model is exactly 80 % sparse per layer (floor(n * 0.8) weights), accuracies are sane, errors are clean, and
the shipped columns come from int8 ONNX files that onnxruntime ran (re-running them reproduces the numbers)."""

from __future__ import annotations

import contextlib
import io
import math
import os
from collections import Counter

import numpy as np
import pytest
import torch  # noqa: F401  (marks the module: collected only where torch is installed)

from compressor.app import cli, demo
from compressor.app.data import load_dataset

# weights per layer of the demo CNN on 8x8 digits
LAYER_SIZES = {"conv1": 16 * 1 * 9, "conv2": 32 * 16 * 9, "fc1": 512 * 64, "fc2": 64 * 10}
# structured + speedup keeps 8 / 16 / 32 channels of conv1 / conv2 / fc1 (fc1 sees 16 * 4 * 4 inputs)
STRUCT_PARAMS = (8 * 9 + 8) + (16 * 8 * 9 + 16) + (256 * 32 + 32) + (32 * 10 + 10)
DENSE_MACS = 16 * 9 * 64 + 32 * 144 * 64 + 512 * 64 + 64 * 10
STRUCT_MACS = 8 * 9 * 64 + 16 * 72 * 64 + 256 * 32 + 32 * 10


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``compressor demo --backend torch --quick --out DIR --plot PNG`` through the CLI; the results are the
    ones run_demo (which main calls) returned, the text is what the command printed."""
    tmp = tmp_path_factory.mktemp("demo")
    plot, out_dir = tmp / "demo.png", tmp / "files"
    returned = []
    real = demo.run_demo

    def recording(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(demo, "run_demo", recording)
        rc = cli.main(["demo", "--backend", "torch", "--quick", "--no-progress", "--out", str(out_dir),
                       "--plot", str(plot)])
    assert rc == 0 and len(returned) == 1
    return returned[0], stdout.getvalue(), plot


@pytest.fixture(scope="module")
def digits_test():
    ds = load_dataset("digits", None, seed=0)
    return ds.x_test, ds.y_test


def test_sparsity_is_exactly_the_target(quick_run):
    (r,), _, _ = quick_run
    expected = {k: math.floor(n * demo.SPARSITY) / n for k, n in LAYER_SIZES.items()}
    assert r.layer_sparsity == pytest.approx(expected, abs=1e-12)
    total = sum(math.floor(n * demo.SPARSITY) for n in LAYER_SIZES.values()) / sum(LAYER_SIZES.values())
    assert r.sparsity == pytest.approx(total, abs=1e-12)
    assert abs(r.sparsity - 0.8) < 1e-3


def test_accuracies_and_sizes(quick_run):
    (r,), _, _ = quick_run
    assert r.backend == "torch" and r.data == "digits"
    assert r.acc_dense > 0.85 and r.acc_pruned > 0.80 and r.acc_quant > 0.85
    n_weights = sum(LAYER_SIZES.values())
    n_params = n_weights + 16 + 32 + 64 + 10
    assert r.dense_bytes == 4 * n_params
    assert r.mask_bytes == n_weights + (16 + 32 + 64 + 10)  # bool weight and bias masks, 1 byte each
    # int8: 1 byte per weight, 4 per bias, scale+zero point (8 bytes) per quantized tensor: 4 weights,
    # 4 outputs, 1 input (conv1)
    assert r.int8_bytes == n_weights + 4 * (16 + 32 + 64 + 10) + 8 * 9
    for t in (r.step_dense, r.step_pruned, r.step_quant):
        assert 0 < t < 5.0


def test_table_shows_the_numbers(quick_run):
    (r,), text, _ = quick_run
    for value in (r.acc_dense, r.acc_pruned, r.acc_quant, r.sparsity):
        assert demo._pct(value) in text
    assert f"{r.dense_bytes:,} fp32" in text and f"+{r.mask_bytes:,} bool masks" in text
    assert f"{r.int8_bytes:,} int8 export" in text
    assert f"({r.pruned_overhead:.2f}x)" in text and f"({r.quant_overhead:.2f}x)" in text
    assert "== torch: small CNN on digits 8x8" in text
    # the QAT model is a training-time simulation: labelled so, its inference not timed
    assert "QAT int8 (fake-quant simulation)" in text and "simulation, not timed" in text
    assert "quant" not in r.infer


def test_plot_is_written(quick_run):
    (r,), text, plot = quick_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"figure saved to {plot}" in text
    points = {key: (size, latency, acc) for key, _, size, latency, acc in demo.plot_points(r)}
    assert list(points) == ["dense", "pruned", "quant", "struct", "file:dense", "file:struct", "file:shipped"]
    assert points["quant"] == (r.file_bytes["quant"], None, r.acc_quant)  # simulation: no latency
    assert points["struct"] == (r.file_bytes["struct"], r.infer["struct"], r.acc_struct)
    a = r.artifacts["shipped"]
    assert points["file:shipped"] == (a.file_bytes, a.latency_all, a.accuracy)


def _fresh_session(path, optimized=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    if optimized:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def test_shipped_column_is_an_int8_onnx_file_run_in_onnxruntime(quick_run, digits_test, tmp_path):
    import onnx
    import onnxruntime as ort

    (r,), text, _ = quick_run
    x, y = digits_test
    a = r.artifacts["shipped"]
    # the numbers come from this file, loaded in this onnxruntime session
    assert os.path.isfile(a.path) and a.path.endswith(os.path.join("files", "torch", "shipped-int8.onnx"))
    assert isinstance(a.runner.session, ort.InferenceSession) and a.runner.path == a.path
    assert a.file_bytes == os.path.getsize(a.path)
    # int8: 8-bit integer weight initializers, and onnxruntime runs integer kernels only (no float Conv/Gemm)
    init = {i.name: (onnx.TensorProto.DataType.Name(i.data_type), list(i.dims))
            for i in onnx.load(a.path).graph.initializer if len(i.dims) >= 2}
    assert sorted(dims for _, dims in init.values()) == [[8, 1, 3, 3], [10, 32], [16, 8, 3, 3], [32, 256]]
    assert {t for t, _ in init.values()} <= {"INT8", "UINT8"}
    _fresh_session(a.path, tmp_path / "opt.onnx")
    ops = Counter(n.op_type for n in onnx.load(tmp_path / "opt.onnx").graph.node)
    assert ops["QLinearConv"] == 2 and ops["QGemm"] == 2
    assert not {"Conv", "Gemm", "MatMul", "FusedGemm", "FusedConv"} & set(ops)
    assert a.int8 == "QGemm x2, QLinearConv x2"
    # re-running the file in a fresh session reproduces the reported accuracy exactly
    sess = _fresh_session(a.path)
    logits = sess.run(None, {sess.get_inputs()[0].name: x[:, None].astype(np.float32)})[0]
    assert float((logits.argmax(1) == y).mean()) == a.accuracy
    assert demo.artifact_accuracy(demo.get_harness("torch").load_artifact(a.path), x, y) == a.accuracy
    assert a.accuracy > 0.80
    assert 0 < a.latency_1 < 1.0 and 0 < a.latency_all < 5.0
    assert a.runtime.startswith(f"onnxruntime {ort.__version__} (CPU, 1 thread)")


def test_dense_and_structured_float_files_and_the_final_line(quick_run, digits_test):
    (r,), text, _ = quick_run
    x, y = digits_test
    d, st, sh = (r.artifacts[k] for k in ("dense", "struct", "shipped"))
    for a, name in ((d, "dense.onnx"), (st, "structured.onnx")):
        assert os.path.basename(a.path) == name and a.file_bytes == os.path.getsize(a.path)
        assert a.int8 == "none (float kernels)"
        sess = _fresh_session(a.path)
        logits = sess.run(None, {sess.get_inputs()[0].name: x[:, None].astype(np.float32)})[0]
        assert float((logits.argmax(1) == y).mean()) == a.accuracy
    assert d.accuracy == r.acc_dense  # the float file computes what the model does
    # 38,282 float32 parameters vs 9,802 int8 (+ int32 biases, scales): more than 8x smaller, under 12x
    assert 8 < d.file_bytes / sh.file_bytes < 12 and st.file_bytes < 0.3 * d.file_bytes
    assert "-- measured on the files, in onnxruntime" in text
    for a in (d, st, sh):
        assert demo._pct(a.accuracy) in text and f"{a.file_bytes:,} B" in text
    line = demo.summary_line(r)
    assert line == text.rstrip().splitlines()[-3].strip()  # then 'files kept in', 'figure saved to'
    assert line.startswith(f"torch: the shipped int8 ONNX file is {d.file_bytes / sh.file_bytes:.1f}x smaller, ")
    assert f"{100 * (sh.accuracy - d.accuracy):+.1f} pp accuracy" in line


def _result(d1, s1, dall, sall, dacc, sacc):
    def art(label, size, l1, lall, acc):
        return demo.Artifact(label=label, path=label, runtime="onnxruntime 1.0 (CPU, 1 thread)", runner=None,
                             accuracy=acc, file_bytes=size, latency_1=l1, latency_all=lall, ranges={}, int8="")

    r = demo.BackendResult(backend="torch", data="digits", acc_dense=0, acc_pruned=0, acc_quant=0, sparsity=0,
                           layer_sparsity={}, dense_bytes=0, mask_bytes=0, int8_bytes=0, step_dense=1,
                           step_pruned=1, step_quant=1, n_infer=359, artifact_format="ONNX")
    r.artifacts = {"dense": art("d", 120_000, d1, dall, dacc), "shipped": art("s", 10_000, s1, sall, sacc)}
    return r


def test_summary_line_words():
    assert demo.summary_line(_result(3e-4, 1e-4, 0.010, 0.020, 0.9750, 0.9710)) == (
        "torch: the shipped int8 ONNX file is 12.0x smaller, 3.0x faster at batch 1 and 2.0x slower on 359 "
        "images (onnxruntime 1.0), -0.4 pp accuracy (97.10 % vs 97.50 %), compared with the dense float ONNX file")
    assert "as fast at batch 1 and as fast on" in demo.summary_line(_result(1e-4, 0.97e-4, 1.0, 1.04, 0.5, 0.5))
    r = _result(3e-4, 1e-4, 0.010, 0.008, 0.9750, 0.9710)
    r.artifacts["struct"] = demo.Artifact(label="st", path="st", runtime="", runner=None, accuracy=0.97,
                                          file_bytes=40_000, latency_1=1e-4, latency_all=0.004, ranges={}, int8="")
    assert demo.summary_line(r).endswith(
        "1.2x faster on 359 images (onnxruntime 1.0), -0.4 pp accuracy (97.10 % vs 97.50 %), compared with the "
        "dense float ONNX file; the structured float file runs 2.0x faster than the int8 one on 359 images: this "
        "model's layers are too narrow for the runtime's int8 kernels to pay off")
    r.artifacts["struct"].latency_all = 0.0075  # within 10 %: not said
    assert demo.summary_line(r).endswith("compared with the dense float ONNX file")


def test_interleaved_times_runs_every_callable_alike():
    calls = Counter()
    times = demo.interleaved_times({k: (lambda k=k: calls.update([k])) for k in "abc"}, rounds=4, calls=3,
                                   warmup=2)
    assert calls == {"a": 2 + 4 * 3, "b": 2 + 4 * 3, "c": 2 + 4 * 3}
    assert {k: len(v) for k, v in times.items()} == {"a": 4, "b": 4, "c": 4}
    assert all(t >= 0 for v in times.values() for t in v)


def test_int8_bytes_per_channel_and_tf_names():
    params = {"cnn/fc1/kernel": 100, "cnn/fc1/bias": 10, "cnn/fc2/kernel": 20, "cnn/fc2/bias": 2}
    calib = {"fc1": {"quant_types": ["weight"], "weight_bits": 4, "weight_scale": [0.1] * 10},
             "fc2": {"quant_types": ["output"], "output_bits": 8, "output_scale": 0.5}}
    # fc1 kernel packed at 4 bits (50 B) + 10 scales/zero points (80 B); the rest float32; fc2 output 8 B
    assert demo.int8_export_bytes(params, calib) == 50 + 80 + 8 + 4 * (10 + 20 + 2)


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert cli.main(["demo", "--data", "mnist"]) == 2
    assert "--data mnist needs --data-dir" in capsys.readouterr().err
    assert cli.main(["demo", "--backend", "torch", "--data", "mnist", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compressor demo: error: MNIST directory") and "lacks train-images-idx3-ubyte.gz" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--backend", "jax"])
    assert info.value.code == 2


def test_missing_onnxruntime_is_one_line_before_any_training(capsys, monkeypatch):
    real = demo.importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name, *a: None if name == "onnxruntime" else real(name, *a))
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("trained although onnxruntime is missing"))
    assert cli.main(["demo", "--backend", "torch", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err == ("compressor demo: error: the torch artifact is an ONNX file run in onnxruntime, which needs "
                   "onnxruntime (pip install 'compressor[onnx]'); or run another backend with --backend\n")


def test_structured_speedup_column_is_really_smaller(quick_run):
    (r,), text, _ = quick_run
    dense_params = sum(LAYER_SIZES.values()) + 16 + 32 + 64 + 10
    assert r.params == {"dense": dense_params, "pruned": dense_params, "quant": dense_params, "struct": STRUCT_PARAMS}
    assert r.macs == {"dense": DENSE_MACS, "pruned": DENSE_MACS, "quant": DENSE_MACS, "struct": STRUCT_MACS}
    assert r.struct_channels == {"conv1": (16, 8), "conv2": (32, 16), "fc1": (64, 32)}
    assert r.struct_bytes == 4 * STRUCT_PARAMS
    assert set(r.file_bytes) == {"dense", "pruned", "quant", "struct"}
    assert r.file_bytes["struct"] < 0.5 * r.file_bytes["dense"]
    assert r.acc_struct > 0.80
    assert set(r.infer) == {"dense", "pruned", "struct"} and all(0 < t < 5.0 for t in r.infer.values())
    assert 0 < r.step_struct < 5.0
    assert "structured (50% ch.) + speedup" in text
    assert f"{STRUCT_PARAMS:,} ({STRUCT_PARAMS / dense_params:.2f}x)" in text
    assert f"{STRUCT_MACS:,} ({STRUCT_MACS / DENSE_MACS:.2f}x)" in text
    assert demo._pct(r.acc_struct) in text and f"{r.file_bytes['struct']:,} B" in text
    assert "structured channels kept: conv1 16->8, conv2 32->16, fc1 64->32" in text
    assert "masks speed nothing up" not in text
