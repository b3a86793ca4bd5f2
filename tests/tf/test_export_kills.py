"""Every Keras export kind killed before each of its file-system operations (hard: the process dies; soft: an
interrupt the export handles): each target is the whole old or the whole new version, all targets of one export
the same after the next call into the folder, nothing of the export left (core.atomic's journal).

Writing a SavedModel and converting to TFLite take about a second each; after one real export the kill runs get
the same SavedModel folder and flatbuffer from a cache (``model.export`` copies the folder, the converter
returns the bytes), so the runs test the export's transaction, every operation of it, in seconds."""

from __future__ import annotations

import shutil

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.tf import LevelPruner, PtqQuantizer, QAT_Quantizer
from compressor.tf.weight_sharing import WeightSharingQuantizer
from tests._fs_kills import check_every_kill, tree

pytestmark = [pytest.mark.tf, pytest.mark.filterwarnings("ignore::UserWarning")]

ALL = {"op_types": ["default"]}
X = np.random.default_rng(0).random((8, 8), dtype=np.float32)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, name="a"), keras.layers.Dense(4, name="b")])


def _reset(root, files=(), folders=()):
    shutil.rmtree(root, ignore_errors=True)
    (root / "sub").mkdir(parents=True)
    (root / "notes.txt").write_bytes(b"the user's own file")
    for f in files:
        (root / f).write_bytes(b"old " + f.encode())
    for d in folders:
        (root / d / "variables").mkdir(parents=True)
        (root / d / "saved_model.pb").write_bytes(b"old graph")
        (root / d / "variables" / "variables.index").write_bytes(b"old index")


@pytest.fixture
def cached_writers(tmp_path, monkeypatch):
    """Real SavedModel / TFLite output once, then copies of it for every later export."""
    ref = tmp_path / "ref"
    ref.mkdir()
    _model().export(str(ref / "saved"), format="tf_saved_model", verbose=False)
    blob = tf.lite.TFLiteConverter.from_keras_model(_model()).convert()

    def export(self, path, format="tf_saved_model", verbose=True, **kwargs):
        shutil.copytree(ref / "saved", path, dirs_exist_ok=True)

    class Converter:
        def convert(self):
            return blob

    monkeypatch.setattr(keras.Model, "export", export)
    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_keras_model", staticmethod(lambda *a, **k: Converter()))
    monkeypatch.setattr(tf.lite.TFLiteConverter, "from_saved_model", staticmethod(lambda *a, **k: Converter()))
    return blob


def _run_all(tmp_path, export, targets, files=(), folders=()):
    root = tmp_path / "out"
    out = check_every_kill(export, [str(root / t) for t in targets], [str(root), str(root / "sub")],
                           lambda: _reset(root, files, folders), exchange_variants=bool(folders))
    assert out["old"] > 0 and out["new"] > 0, out
    return root


def test_pruner_export_keras_masks_savedmodel_tflite(tmp_path, cached_writers):
    p = LevelPruner(_model(), [{"sparsity": 0.5, **ALL}])
    p.compress()
    root = tmp_path / "out"

    def export():
        p.export_model(model_path=str(root / "m.keras"), mask_path=str(root / "sub" / "masks.npz"),
                       saved_model_path=str(root / "saved"), tflite_path=str(root / "sub" / "m.tflite"))

    root = _run_all(tmp_path, export, ["m.keras", "sub/masks.npz", "saved", "sub/m.tflite"],
                    files=("m.keras", "sub/m.tflite"), folders=("saved",))
    assert (root / "sub" / "m.tflite").read_bytes() == cached_writers  # the last run landed
    assert sorted(tree(root / "saved")) == ["assets", "fingerprint.pb", "saved_model.pb", "variables"]


def test_qat_export_keras_calibration_tflite(tmp_path, cached_writers):
    model = _model()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, **ALL}])
    q.compress()
    model(X)
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "m.keras"), calibration_path=str(root / "sub" / "calib.json"),
                       tflite_path=str(root / "m.tflite"))

    _run_all(tmp_path, export, ["m.keras", "sub/calib.json", "m.tflite"], files=("m.keras", "m.tflite"))


def test_qat_export_savedmodel_as_model_path(tmp_path, cached_writers):
    model = _model()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, **ALL}])
    q.compress()
    model(X)
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "sm"), calibration_path=str(root / "calib.json"))

    _run_all(tmp_path, export, ["sm", "calib.json"], files=("calib.json",), folders=("sm",))


def test_ptq_export_keras_calibration(tmp_path):
    """PTQ's export writes through QAT's (a temporary of a temporary)."""
    q = PtqQuantizer(_model(), [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, **ALL}]).calibrate(X)
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "m.keras"), calibration_path=str(root / "sub" / "calib.json"))

    _run_all(tmp_path, export, ["m.keras", "sub/calib.json"], files=("sub/calib.json",))


def test_weight_sharing_export_weights_compressed(tmp_path):
    model = _model()
    q = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, **ALL}])
    q.compress()
    root = tmp_path / "out"

    def export():
        q.export_model(str(root / "w.weights.h5"), compressed_path=str(root / "sub" / "w.cmpk"))

    _run_all(tmp_path, export, ["w.weights.h5", "sub/w.cmpk"], files=("w.weights.h5",))
