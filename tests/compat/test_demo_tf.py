"""``compressor demo --quick`` on TensorFlow / Keras 3: the same checks as on PyTorch (the demo CNN has
the same layers, so the same exact per-layer pruned counts and byte counts), and the shipped columns come
from a full-integer TFLite file that ``tf.lite.Interpreter`` ran (re-running it reproduces the numbers)."""

from __future__ import annotations

import contextlib
import io
import math
import os
import warnings

import numpy as np
import pytest
import tensorflow as tf  # noqa: F401  (marks the module: collected only where tensorflow is installed)

from compressor.app import cli, demo
from compressor.app.data import load_dataset

LAYER_SIZES = {"conv1": 16 * 1 * 9, "conv2": 32 * 16 * 9, "fc1": 512 * 64, "fc2": 64 * 10}
# structured + speedup keeps 8 / 16 / 32 channels of conv1 / conv2 / fc1 (fc1 sees 16 * 4 * 4 inputs)
STRUCT_PARAMS = (8 * 9 + 8) + (16 * 8 * 9 + 16) + (256 * 32 + 32) + (32 * 10 + 10)
DENSE_MACS = 16 * 9 * 64 + 32 * 144 * 64 + 512 * 64 + 64 * 10
STRUCT_MACS = 8 * 9 * 64 + 16 * 72 * 64 + 256 * 32 + 32 * 10
BIASES = 16 + 32 + 64 + 10


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """``compressor demo --backend tf --quick --out DIR`` through the CLI; the result is the one run_demo
    (which main calls) returned, the text is what the command printed."""
    out_dir = tmp_path_factory.mktemp("demo") / "files"
    returned = []
    real = demo.run_demo

    def recording(*args, **kwargs):
        returned.append(real(*args, **kwargs))
        return returned[-1]

    stdout = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(stdout):
        mp.setattr(demo, "run_demo", recording)
        rc = cli.main(["demo", "--backend", "tf", "--quick", "--no-progress", "--out", str(out_dir)])
    assert rc == 0 and len(returned) == 1
    return returned[0][0], stdout.getvalue()


def _run_fresh(path, x):
    """The .tflite at ``path`` in a new tf.lite.Interpreter, all of ``x`` in one invoke: (logits, interpreter)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        it = tf.lite.Interpreter(model_path=str(path), num_threads=1)
    d = it.get_input_details()[0]
    it.resize_tensor_input(d["index"], [len(x), *d["shape"][1:]])
    it.allocate_tensors()
    it.set_tensor(d["index"], x[..., None].astype(np.float32))
    it.invoke()
    return it.get_tensor(it.get_output_details()[0]["index"]), it


def test_shipped_column_is_a_full_integer_tflite_run_in_the_interpreter(quick_run):
    r, text = quick_run
    ds = load_dataset("digits", None, seed=0)
    a = r.artifacts["shipped"]
    assert os.path.isfile(a.path) and a.path.endswith(os.path.join("files", "tf", "shipped-int8.tflite"))
    assert a.runner.path == a.path and a.file_bytes == os.path.getsize(a.path)
    assert all(isinstance(it, tf.lite.Interpreter) for it in a.runner.interpreters.values())
    assert set(a.runner.interpreters) == {1, len(ds.x_test)}  # batch 1 and the test set
    # re-running the file in a fresh interpreter reproduces the reported accuracy exactly
    logits, it = _run_fresh(a.path, ds.x_test)
    assert float((logits.argmax(1) == ds.y_test).mean()) == a.accuracy > 0.80
    # full integer: every conv / dense op takes int8 activations and int8 weights of the pruned shapes
    tensors = it.get_tensor_details()
    dtype = {t["index"]: np.dtype(t["dtype"]) for t in tensors}
    shape = {t["index"]: tuple(int(v) for v in t["shape"]) for t in tensors}
    compute = [op for op in it._get_ops_details() if op["op_name"] in ("CONV_2D", "FULLY_CONNECTED")]
    assert [op["op_name"] for op in compute] == ["CONV_2D", "CONV_2D", "FULLY_CONNECTED", "FULLY_CONNECTED"]
    assert all(dtype[op["inputs"][0]] == np.int8 and dtype[op["inputs"][1]] == np.int8 for op in compute)
    assert [shape[op["inputs"][1]] for op in compute] == [(8, 3, 3, 1), (16, 3, 3, 8), (32, 256), (10, 32)]
    n8 = sum(v == np.int8 for v in dtype.values())
    assert a.int8 == f"{n8} of {len(tensors)} tensors int8"
    assert 0 < a.latency_1 < 1.0 and 0 < a.latency_all < 5.0
    assert a.runtime.startswith(f"TFLite interpreter, TF {tf.__version__} (1 thread)")


def test_dense_float_file_and_the_final_line(quick_run):
    r, text = quick_run
    ds = load_dataset("digits", None, seed=0)
    d, st, sh = (r.artifacts[k] for k in ("dense", "struct", "shipped"))
    for a, name in ((d, "dense.tflite"), (st, "structured.tflite")):
        assert os.path.basename(a.path) == name and a.file_bytes == os.path.getsize(a.path)
        logits, it = _run_fresh(a.path, ds.x_test)
        assert float((logits.argmax(1) == ds.y_test).mean()) == a.accuracy
        assert not any(np.dtype(t["dtype"]) == np.int8 for t in it.get_tensor_details())
        assert a.int8.startswith("none of ")
    assert d.accuracy == r.acc_dense
    assert 8 < d.file_bytes / sh.file_bytes < 12 and st.file_bytes < 0.3 * d.file_bytes
    assert "-- measured on the files, in TFLite interpreter" in text
    for a in (d, st, sh):
        assert demo._pct(a.accuracy) in text and f"{a.file_bytes:,} B" in text
    line = demo.summary_line(r)
    assert line == text.rstrip().splitlines()[-2].strip()  # then 'files kept in'
    assert line.startswith(f"tf: the shipped int8 TFLite file is {d.file_bytes / sh.file_bytes:.1f}x smaller, ")
    # the converter's and interpreter's native output is muted: the tables are what the command printed
    assert "Saved artifact at" not in text and "fully_quantize" not in text


def test_sparsity_is_exactly_the_target(quick_run):
    r, _ = quick_run
    expected = {k: math.floor(n * demo.SPARSITY) / n for k, n in LAYER_SIZES.items()}
    assert r.layer_sparsity == pytest.approx(expected, abs=1e-12)
    total = sum(math.floor(n * demo.SPARSITY) for n in LAYER_SIZES.values()) / sum(LAYER_SIZES.values())
    assert r.sparsity == pytest.approx(total, abs=1e-12)


def test_accuracies_sizes_and_table(quick_run):
    r, text = quick_run
    assert r.backend == "tf"
    assert r.acc_dense > 0.85 and r.acc_pruned > 0.80 and r.acc_quant > 0.85
    n_weights = sum(LAYER_SIZES.values())
    assert r.dense_bytes == 4 * (n_weights + BIASES)
    assert r.mask_bytes == n_weights + BIASES
    assert r.int8_bytes == n_weights + 4 * BIASES + 8 * 9
    for t in (r.step_dense, r.step_pruned, r.step_quant):
        assert 0 < t < 5.0
    for value in (r.acc_dense, r.acc_pruned, r.acc_quant, r.sparsity):
        assert demo._pct(value) in text
    assert f"{r.dense_bytes:,} fp32" in text and f"{r.int8_bytes:,} int8 export" in text
    assert f"({r.pruned_overhead:.2f}x)" in text
    assert "== tf: small CNN on digits 8x8" in text
    assert "QAT int8 (fake-quant simulation)" in text and "simulation, not timed" in text


def test_structured_speedup_column_is_really_smaller(quick_run):
    r, text = quick_run
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
