"""Issue 29 (items 7, 9) on Keras / TFLite: ``compressor report`` on truncated / mutated / crafted .tflite files
raises ModelError (tf.lite.Interpreter segfaulted on most of them), reads what the interpreter reads on
real files, and names that are not UTF-8 are shown; garbage .keras files and bad mask files get clear
errors; ``load_compressed`` checks names and shapes before decoding; ``.keras`` zip bombs, shape bombs (h5
datasets, variables built from config.json) and configs of too many objects are refused before Keras
allocates them. Fuzz: in a subprocess with a memory cap (``COMPRESSOR_FUZZ_CASES`` for more): the .keras checks
on every case, full Keras loads on 1 in 25 (at least 8)."""

from __future__ import annotations

import contextlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from compressor.core.errors import CompressedFileError, ConfigError, ModelError
from compressor.report import read_weights
from tests.core.test_hostile_files import FUZZ_CASES, bounded_work, craft, fuzz_in_subprocess

pytestmark = pytest.mark.tf

#: Python lines a reader may execute to refuse a .keras file from its zip directory and JSON, before Keras
#: builds anything (measured: 350 to 3,400)
LINES_TO_REFUSE = 20_000
#: ... and to load the tiny model's config until a variable's size is refused (measured: ~60 k; 5,000 layers
#: built from a config: ~40 M)
MODEL_LINES = 200_000

_FILES: dict[str, bytes] = {}
_WARM: list[bool] = []  # a .keras file was read in this process (see refused_keras)


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
    assert bounded_work(res), res


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
    from compressor.tf.cmpk import load_compressed, model_arrays, save_compressed

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
                          timeout=1800)  # (a hang's backstop: pytest-timeout's 900 s ends a stuck run first)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.startswith("compressor: error: ") and "cut.tflite" in proc.stderr


# ---------------------------------------------------------------------------------------------- .keras archives
def keras_file(tmp_path) -> bytes:
    path = tmp_path / "tiny.keras"
    tiny_model().save(path)
    return path.read_bytes()


def refused_keras(tmp_path, data: bytes, match: str) -> tuple[int, int]:
    """``read_weights`` of a crafted .keras: a ModelError naming the file and matching ``match``; (Python lines
    executed, peak bytes traced)."""
    import re

    from tests.core.test_hostile_files import measured

    if not _WARM:  # a valid file first: the counts are the crafted files' work, not the first load's imports
        tiny_model().save(tmp_path / "warm.keras")
        with contextlib.suppress(ModelError):  # (refused while a test has lowered a cap: warmed later)
            read_weights(tmp_path / "warm.keras")
            _WARM.append(True)
    path = tmp_path / "crafted.keras"
    path.write_bytes(data)
    err, lines, peak = measured(read_weights, path)
    assert isinstance(err, ModelError) and "crafted.keras" in str(err), repr(err)
    assert re.search(match, str(err)), str(err)
    return lines, peak


def test_keras_zip_bombs_are_refused_before_keras_reads_them(tmp_path, monkeypatch):
    from compressor.core import archives
    from tests.core.test_hostile_files import zip_entries, zip_of

    entries = dict(zip_entries(keras_file(tmp_path)))
    config = entries["config.json"]
    # config.json: valid JSON padded to 64 MiB, deflated to ~64 KB
    bomb = config[:-1] + b" " * (64 << 20) + b"}"
    data = zip_of([*{**entries, "config.json": bomb}.items()], deflated=("config.json",))
    assert len(data) < 200_000
    lines, peak = refused_keras(tmp_path, data, r"'config.json' inflates to 67,[0-9,]+ bytes from [0-9,]+, more than "
                                                r"100x \(a zip bomb\)")
    assert lines < LINES_TO_REFUSE and peak < 4 * len(data) + (1 << 20)  # (refused before Keras reads it: all traced)
    # model.weights.h5 claiming far more than the file holds (directory record edited)
    good = bytearray(zip_of([*entries.items()]))
    cd = good.find(b"model.weights.h5", good.find(b"PK\x01\x02")) - 46
    good[cd + 24:cd + 28] = ((1 << 32) - 1).to_bytes(4, "little")  # its uncompressed size
    refused_keras(tmp_path, bytes(good), r"stored entry 'model.weights.h5' claims 4,294,967,295 bytes but holds")
    # within the per-entry ratio (runs deflate ~20x), past what the file may inflate to (base lowered to 1 MiB)
    monkeypatch.setattr(archives, "KERAS_INFLATE_BASE", 1 << 20)
    runs = np.repeat(np.random.default_rng(0).integers(0, 4, 1 << 19, dtype=np.uint8), 16).tobytes()
    refused_keras(tmp_path, zip_of([*entries.items(), ("assets/blob", runs)], deflated=("assets/blob",)),
                  r"inflate to more than the [0-9,]+ bytes read from a file of")
    monkeypatch.setattr(archives, "KERAS_CONFIG_MAX_BYTES", 1000)
    refused_keras(tmp_path, zip_of([*entries.items()]), rf"'config.json' holds {len(config):,} bytes, more than the "
                                                       rf"1,000 allowed")
    monkeypatch.undo()
    cases = {
        r"config.json is not JSON": {**entries, "config.json": b"{not json"},
        r"config.json is not a JSON object": {**entries, "config.json": b"[1, 2]"},
        r"config.json is not JSON Keras reads \(nested too deeply\)": {**entries, "config.json": b"[" * 100_000},
        r"metadata.json is not JSON": {**entries, "metadata.json": b"\xff\xfe"},
        r"entry '../evil.py' is not a plain relative name": {**entries, "../evil.py": b"x"},
        r"unexpected entry 'evil.py'": {**entries, "evil.py": b"x"},
        r"no model.weights.h5 / model.weights.npz entry": {k: v for k, v in entries.items() if k != "model.weights.h5"},
    }
    for match, ents in cases.items():
        refused_keras(tmp_path, zip_of([*ents.items()]), match)
    refused_keras(tmp_path, zip_of([*entries.items(), ("config.json", b"{}")]), r"'config.json' appears twice")


def test_keras_shape_bombs_are_refused_before_allocating(tmp_path):
    import io
    import json
    import resource

    import h5py

    from tests.core.test_hostile_files import zip_entries, zip_of

    entries = dict(zip_entries(keras_file(tmp_path)))
    # an h5 dataset declaring 4 GiB with no chunk written (read back as its fill value)
    buf = io.BytesIO()
    with h5py.File(buf, "w") as h:
        h.create_dataset("layers/fc/vars/0", shape=(1 << 30,), dtype="f4", chunks=(1 << 16,))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    refused_keras(tmp_path, zip_of([*{**entries, "model.weights.h5": buf.getvalue()}.items()]),
                  r"model.weights.h5: its datasets declare more than [0-9,]+ bytes, 4x the [0-9,]+ bytes it holds")
    # config.json building a 115-GB Dense (Keras allocates variables from the config before reading weights)
    config = json.loads(entries["config.json"])
    for layer in config["config"]["layers"]:
        if layer["class_name"] == "Dense":
            layer["config"]["units"] = 200_000_000
    lines, _ = refused_keras(tmp_path, zip_of([*{**entries, "config.json": json.dumps(config).encode()}.items()]),
                             r"its config.json builds variables of more than [0-9,]+ bytes")
    assert lines < MODEL_LINES, lines  # Keras builds the layers before the Dense, and is stopped at its kernel
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 64 << 10  # KiB
    # 5,000 layers in config.json (Keras takes ~1 ms to build each; deflated, it is a zip bomb): their count
    config = json.loads(entries["config.json"])
    flatten = next(layer for layer in config["config"]["layers"] if layer["class_name"] == "Flatten")
    config["config"]["layers"] += [{**flatten, "name": f"f{i}"} for i in range(5000)]
    text = json.dumps(config).encode()
    data = zip_of([*{**entries, "config.json": text}.items()])
    lines, _ = refused_keras(tmp_path, data, r"its config.json describes [0-9,]+ Keras objects, more than the [0-9,]+ "
                                             r"read from a file of its size \(1,000 \+ 1 per 768 bytes\)")
    # counted, none built: a few lines per JSON node (~0.2 per byte of config.json; building them: millions)
    assert lines < LINES_TO_REFUSE + len(text) // 2, (lines, len(text))


def test_fuzz_keras_archive_check_bounded(tmp_path, monkeypatch):
    (tmp_path / "tiny.keras").write_bytes(keras_file(tmp_path))
    monkeypatch.setenv("H29_KERAS_FILE", str(tmp_path / "tiny.keras"))
    res = fuzz_in_subprocess("tests.core.test_hostile_files:fuzz_keras_archive", FUZZ_CASES, mem_mb=128)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ArchiveError", 0) > FUZZ_CASES // 3, res
    assert bounded_work(res), res


#: full Keras loads in the fuzz (each ~30-100 ms, plus TensorFlow's import in the subprocess)
KERAS_LOADS = max(8, FUZZ_CASES // 25)


def fuzz_keras_load(cases: int, limit) -> dict:
    """load_keras (the checks, then keras.saving.load_model) on .keras files whose config / metadata JSON or
    weights bytes are mutated (most pass the zip checks: Keras itself reads them)."""
    import os
    import random
    import tempfile

    from compressor.report import load_keras
    from tests.core.test_hostile_files import fuzz_loop, json_mutation, zip_entries, zip_of

    folder = tempfile.mkdtemp()
    tiny_model().save(os.path.join(folder, "tiny.keras"))
    with open(os.path.join(folder, "tiny.keras"), "rb") as f:
        legit = f.read()
    entries = zip_entries(legit)
    path = os.path.join(folder, "fuzz.keras")

    def make(rng: random.Random) -> bytes:
        out = list(entries)
        i = rng.randrange(len(out))
        name, body = out[i]
        if name.endswith(".json") and rng.random() < 0.8:
            out[i] = (name, json_mutation(body, rng))
        else:
            b = bytearray(body)
            for _ in range(rng.randrange(1, 6)):
                b[rng.randrange(len(b))] = rng.randrange(256)
            out[i] = (name, bytes(b))
        return zip_of(out)

    def read(data: bytes) -> None:
        with open(path, "wb") as f:
            f.write(data)
        load_keras(path)

    read(legit)  # warm: the first load builds Keras' and TensorFlow's caches
    limit()
    return fuzz_loop(read, make, cases, (ModelError,), [legit])


def test_fuzz_keras_load_bounded():
    res = fuzz_in_subprocess("tests.tf.test_hostile_files:fuzz_keras_load", KERAS_LOADS, mem_mb=1024)
    assert res["unexpected"] == [], res
    assert res["kinds"].get("ModelError", 0) > 0, res
    assert bounded_work(res), res
