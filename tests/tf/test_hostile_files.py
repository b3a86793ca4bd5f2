"""Issue 29 (items 7, 9) on Keras / TFLite: ``compressor report`` on truncated / mutated / crafted .tflite files
raises ModelError (tf.lite.Interpreter segfaulted on most of them), reads what the interpreter reads on
real files, and names that are not UTF-8 are shown; garbage .keras files and bad mask files get clear
errors; ``load_compressed`` checks names and shapes before decoding. Fuzz: in a subprocess with a
memory cap (``COMPRESSOR_FUZZ_CASES`` for more)."""

from __future__ import annotations

import subprocess
import sys

import keras
import numpy as np
import pytest

from compressor.core.errors import CompressedFileError, ConfigError, ModelError
from compressor.report import read_weights
from tests.core.test_hostile_files import FUZZ_CASES, craft, fuzz_in_subprocess

pytestmark = pytest.mark.tf

_FILES: dict[str, bytes] = {}


def tiny_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((8, 8, 3))
    h = keras.layers.Conv2D(4, 3, name="conv")(inp)
    h = keras.layers.DepthwiseConv2D(3, name="dw")(h)
    h = keras.layers.Flatten()(h)
    return keras.Model(inp, keras.layers.Dense(5, name="fc")(h))


def tflite_files() -> dict[str, bytes]:
    """A float and a full-integer .tflite of the tiny model (converted once per process)."""
    if not _FILES:
        import tensorflow as tf

        model = tiny_model()
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        _FILES["float"] = conv.convert()
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        rng = np.random.default_rng(0)
        conv.representative_dataset = lambda: ([rng.normal(size=(1, 8, 8, 3)).astype(np.float32)] for _ in range(8))
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        conv.inference_input_type = conv.inference_output_type = tf.int8
        _FILES["int8"] = conv.convert()
    return _FILES


def interpreter_rows(path):
    """What the interpreter gives for the same operands (the reader before issue 29)."""
    import tensorflow as tf

    interp = tf.lite.Interpreter(model_path=str(path))
    interp.allocate_tensors()
    details = {d["index"]: d for d in interp.get_tensor_details()}
    rows = []
    for op in interp._get_ops_details():  # noqa: SLF001
        if op["op_name"] not in ("CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED") or len(op["inputs"]) < 2:
            continue
        idx = int(op["inputs"][1])
        arr = np.array(interp.get_tensor(idx))
        q = details[idx]["quantization_parameters"]
        zp = np.asarray(q["zero_points"])
        if arr.dtype.kind in "iu" and zp.size and np.any(zp != 0):
            shape = [1] * arr.ndim
            if zp.size > 1:
                shape[q["quantized_dimension"]] = -1
            arr = arr.astype(np.int32) - zp.astype(np.int32).reshape(shape)
        rows.append((details[idx]["name"], arr))
    return rows


@pytest.mark.parametrize("kind", ["float", "int8"])
def test_tflite_reader_matches_the_interpreter(tmp_path, kind):
    path = tmp_path / f"{kind}.tflite"
    path.write_bytes(tflite_files()[kind])
    ours, want = read_weights(path)[0], interpreter_rows(path)
    assert [n for n, _ in ours] == [n for n, _ in want] and len(ours) == 3
    for (_, a), (_, b) in zip(ours, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    assert {a.dtype for _, a in ours} == ({np.dtype(np.float32)} if kind == "float" else {np.dtype(np.int8)})


def test_truncated_tflite_is_a_model_error(tmp_path):
    data = tflite_files()["int8"]
    path = tmp_path / "t.tflite"
    for cut in (0, 3, 7, 8, 64, len(data) // 3, len(data) // 2, len(data) - 100, len(data) - 1):
        path.write_bytes(data[:cut])
        with pytest.raises(ModelError, match=r"t\.tflite.*(not a valid TFLite model|holds no layer weights)"):
            read_weights(path)
    path.write_bytes(b"\x00" * 4 + b"XXXX" + data[8:])
    with pytest.raises(ModelError, match="no 'TFL3' file identifier"):
        read_weights(path)


def test_tflite_name_that_is_not_utf8_is_shown_replaced(tmp_path):
    data = tflite_files()["float"]
    name = read_weights_bytes(tmp_path, data)[0][0]
    data = data.replace(name.encode(), b"\xff" + name.encode()[1:])  # an invalid UTF-8 start byte
    rows = read_weights_bytes(tmp_path, data)
    assert rows[0][0] == "\ufffd" + name[1:]


def read_weights_bytes(tmp_path, data: bytes):
    path = tmp_path / "x.tflite"
    path.write_bytes(data)
    return read_weights(path)[0]


def test_fuzz_tflite_report_never_crashes(tmp_path, monkeypatch):
    for k, data in tflite_files().items():
        (tmp_path / f"{k}.tflite").write_bytes(data)
        monkeypatch.setenv("H24_TFLITE_" + k.upper(), str(tmp_path / f"{k}.tflite"))
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_tflite", FUZZ_CASES, mem_mb=128)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ModelError", 0) > FUZZ_CASES // 3, res
    assert res["worst_s"] < 1.0, res


# ---------------------------------------------------------------------------------------------- .keras, masks
def test_garbage_keras_file_is_not_a_keras_archive(tmp_path):
    bad = tmp_path / "m.keras"
    bad.write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ModelError, match=r"m\.keras.*not a \.keras archive"):
        read_weights(bad)


def test_bad_mask_files_get_clear_errors(tmp_path):
    from compressor.tf.pruning.export import load_masks

    with pytest.raises(ConfigError, match=r"missing\.npz.*does not exist"):
        load_masks(str(tmp_path / "missing.npz"))
    (tmp_path / "garbage.npz").write_bytes(b"not a zip at all")
    with pytest.raises(ConfigError, match=r"garbage\.npz\' as a \.npz archive \(the mask file is not a zip file"):
        load_masks(str(tmp_path / "garbage.npz"))
    np.save(tmp_path / "pickled.npy", np.array([{"a": 1}], dtype=object))
    import zipfile

    with zipfile.ZipFile(tmp_path / "pickled.npz", "w") as z:
        z.write(tmp_path / "pickled.npy", "fc.npy")
    with pytest.raises(ConfigError, match=r"pickled\.npz.*'fc'.*object"):
        load_masks(str(tmp_path / "pickled.npz"))


# ---------------------------------------------------------------------------------------------- load_compressed
def test_load_compressed_checks_the_model_before_decoding(tmp_path):
    from compressor.tf.packing import load_compressed, model_arrays, save_compressed

    model = tiny_model()
    save_compressed(model, tmp_path / "m.cmpk")
    before = {k: v.copy() for k, v in model_arrays(model).items()}
    # a file whose 'fc/kernel' claims a huge shape (and whose streams are empty): the shape is refused first
    entries = [[n, "<f4", list(a.shape), "rp", [["n", 0, 0], ["n", 0, 0]]] for n, a in before.items()]
    entries[-2][2] = [1 << 20, 1 << 20]
    path = tmp_path / "big.cmpk"
    path.write_bytes(craft({"v": 1, "t": entries}))
    name = entries[-2][0]
    with pytest.raises(CompressedFileError, match=rf"{name!r} has shape \(1048576, 1048576\)"):
        load_compressed(model, path)
    assert all(np.array_equal(v, before[k]) for k, v in model_arrays(model).items())


def test_cli_report_on_a_hostile_tflite_is_one_line(tmp_path):
    data = tflite_files()["float"]
    path = tmp_path / "cut.tflite"
    path.write_bytes(data[: len(data) // 2])
    proc = subprocess.run([sys.executable, "-m", "compressor.cli", "report", str(path)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("compressor: error: ") and "cut.tflite" in proc.stderr
