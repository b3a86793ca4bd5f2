"""``compressor report`` on files exported by the TF / Keras backend."""

import json

import keras
import numpy as np

from compressor.app.cli import main
from compressor.tf import LevelPruner


def test_report_keras_export_with_npz_masks(capsys, tmp_path):
    inner = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="d")], name="block")
    model = keras.Sequential([keras.Input((4,)), inner, keras.layers.Dense(2, name="out")])
    inner.get_layer("d").set_weights([np.arange(1.0, 17.0, dtype=np.float32).reshape(4, 4), np.zeros(4, np.float32)])
    pruner = LevelPruner(model, [{"sparsity": 0.75, "op_names": ["block/d"]}])
    pruner.compress()
    pruner.export_model(model_path=str(tmp_path / "m.keras"), mask_path=str(tmp_path / "masks.npz"))
    rc = main(["report", str(tmp_path / "m.keras"), "--masks", str(tmp_path / "masks.npz"), "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    rows = {r["layer"]: r for r in json.loads(out)}
    assert set(rows) == {"block/d", "out"}
    assert rows["block/d"] == {"layer": "block/d", "shape": [4, 4], "params": 16, "zeros": 12, "sparsity": 0.75,
                               "masked": 0.75, "distinct": 4, "bits": 32, "bits_source": "dtype", "dtype": "float32"}
    assert rows["out"]["masked"] is None and rows["out"]["params"] == 8
