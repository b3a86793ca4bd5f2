"""examples/reproduce_structured.py --quick with Keras 3: dependency-aware filter / neuron pruning of
LeNet-5, fine-tuning, speedup. Exact where the pipeline fixes the numbers (the channels the sped-up model
keeps at 50 % channel sparsity, its MACs and parameters)."""

from __future__ import annotations

import json

import pytest

from compressor.app.data import load_mnist
from examples import reproduce_structured

pytestmark = pytest.mark.mnist

#: layer -> (inputs, outputs) of the sped-up LeNet-5 at 50 % of conv1 / conv2 filters and fc1 neurons
SMALL = {"conv1": [1, 10], "conv2": [10, 25], "fc1": [25 * 4 * 4, 250], "fc2": [250, 10]}
DENSE = {"conv1": [1, 20], "conv2": [20, 50], "fc1": [50 * 4 * 4, 500], "fc2": [500, 10]}


def test_expected_widths():
    assert reproduce_structured.expected_widths(0.5) == {"conv1": 10, "conv2": 25, "fc1": 250, "fc2": 10}
    assert reproduce_structured.expected_widths(0.3) == {"conv1": 14, "conv2": 35, "fc1": 350, "fc2": 10}


def test_quick_run_speeds_up(mnist_dir, tmp_path, capsys, monkeypatch):
    import examples.common as common

    monkeypatch.setattr(common, "load_data", lambda args: load_mnist(args.data_dir).subset(2000, 500))
    out = tmp_path / "structured.json"
    rc = reproduce_structured.main(["--backend", "tf", "--quick", "--data-dir", str(mnist_dir), "--threads", "1",
                                    "--no-progress", "--infer-rounds", "2", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "ours-tf" in text and "conv1 20 -> 10, conv2 50 -> 25, fc1 500 -> 250, fc2 10 -> 10" in text
    data = json.loads(out.read_text())
    assert "partial" not in data
    r = data["results"]["tf"]["seeds"]["0"]
    assert r["widths_dense"] == DENSE and r["widths"] == SMALL
    # conv1 10*24*24*25 + conv2 25*8*8*250 + fc1 400*250 + fc2 250*10 (dense: 2,293,000)
    assert (r["macs_dense"], r["macs"]) == (2_293_000, 646_500)
    # conv1 10*25+10, conv2 25*250+25, fc1 400*250+250, fc2 250*10+10 (dense: 431,080)
    assert (r["params_dense"], r["params"]) == (431_080, 109_295)
    assert r["macs_ratio"] >= 2.0 and r["params_ratio"] >= 3.0
    assert r["file_ratio"] > 3.0  # the .keras file shrinks with the parameters
    assert r["file_bytes"] < 4 * r["params"] + 64_000  # float32 weights plus format overhead, nothing else
    assert r["acc"] > 0.7
    assert abs(r["acc"] - r["acc_masked"]) <= 0.002  # the sped-up model predicts as the masked one
    assert r["acc_reloaded"] == r["acc"]  # and so does its saved .keras file read back
