"""MACs / params in the TF pruner report and in ``compressor report --flops`` on a ``.keras`` file: dense
vs. after a speedup built as a new model. The tiny model: Conv2D(4,3) -> BN -> ReLU -> Conv2D(2,1) on 8x8x3.

Dense: conv1 4*27 MACs at 6x6 = 3888, conv2 2*4 at 6x6 = 288 -> 4176 MACs; params 112 + 8 + 10 = 130
(BN moving statistics are not parameters). Half of conv1's filters pruned: 2088 MACs, 66 params.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import pytest

import compressor.app.report as file_report
from compressor.app.cli import main
from compressor.core.errors import ConfigError
from compressor.tf import L1FilterPruner
from compressor.tf.pruning.report import sparsity_report

EXPECTED = {"macs_dense": 4176, "params_dense": 130, "macs_after": 2088, "params_after": 66,
            "macs_ratio": 0.5, "params_ratio": 66 / 130}


def pruned():
    keras.utils.set_random_seed(0)
    L = keras.layers
    model = keras.Sequential([keras.Input((8, 8, 3)), L.Conv2D(4, 3, name="conv1"), L.BatchNormalization(name="bn"),
                              L.ReLU(name="relu"), L.Conv2D(2, 1, name="conv2")])
    pruner = L1FilterPruner(model, [{"sparsity": 0.5, "op_names": ["conv1"]}], dependency_aware=True)
    pruner.compress()
    return model, pruner


def test_report_with_flops_has_exact_macs_and_params():
    model, pruner = pruned()
    before = [np.array(w) for w in model.get_weights()]
    rep = pruner.report(flops=True)
    assert {k: rep.flops[k] for k in EXPECTED} == pytest.approx(EXPECTED)
    text = str(rep)
    assert "dense          params 130           MACs/sample 4,176" in text
    assert "after speedup  params  66 (50.77%)  MACs/sample 2,088 (50.00%)" in text
    # the user's model is untouched
    assert model.get_layer("conv2").kernel.shape == (1, 1, 4, 2)
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    assert sparsity_report(pruner).flops is None and "MACs" not in str(sparsity_report(pruner))
    rep2 = file_report.pruner_report(pruner)
    assert (rep2.flops["macs_after"], rep2.flops["params_after"]) == (2088, 66)
    with pytest.raises(ConfigError, match="no dummy_input"):
        file_report.pruner_report(pruner, np.zeros((1, 8, 8, 3)))


def test_cli_report_flops_on_keras_export(capsys, tmp_path):
    _, pruner = pruned()
    pruner.export_model(model_path=str(tmp_path / "m.keras"), mask_path=str(tmp_path / "masks.npz"))
    rc = main(["report", str(tmp_path / "m.keras"), "--masks", str(tmp_path / "masks.npz"), "--flops", "--json"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    data = json.loads(out)
    assert {k: data["flops"][k] for k in EXPECTED} == pytest.approx(EXPECTED)
    assert {r["layer"] for r in data["layers"]} == {"conv1", "bn", "conv2"}
    # without the masks: the exported weights of the pruned channels are zero, so they go as well
    rc = main(["report", str(tmp_path / "m.keras"), "--flops"])
    out, err = capsys.readouterr()
    assert (rc, err) == (0, "")
    assert "after speedup  params  66 (50.77%)  MACs/sample 2,088 (50.00%)" in out
