"""The paper-reproduction pipelines of examples/ on real MNIST, reduced (a few hundred steps on a subset,
loose accuracy bounds): iterative Level and Sensitivity pruning (Han et al. 2015), AGP, QAT / DoReFa /
BNN. Exact where the pipeline fixes the numbers (per-layer pruned counts of the exported model)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from compressor.app.data import load_mnist
from compressor.app.demo import get_harness
from examples import reproduce_agp, reproduce_han2015, reproduce_quant
from examples.common import Train, dense_baseline, export_weights, kept_fractions

pytestmark = pytest.mark.mnist

DENSE = Train(2, 2e-3, 64)


@pytest.fixture(scope="module")
def setup(mnist_dir):
    ds = load_mnist(mnist_dir).subset(4000, 1000)
    h = get_harness("torch")
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    dense = dense_baseline(h, "lenet300", ds, DENSE, seed=0, progress=False)
    yield h, ds, dense, h.evaluate(dense, ds.x_test, ds.y_test)
    torch.set_num_threads(old)


def test_dense_baseline_learns(setup):
    _, _, _, acc = setup
    assert acc > 0.85


def test_han_level_iterative_hits_paper_fractions_exactly(setup):
    h, ds, dense, dense_acc = setup
    recipe = reproduce_han2015.Recipe(DENSE, rounds=2, retrain=Train(1, 2e-4, 64))
    r = reproduce_han2015.run_level(h, "lenet300", dense, ds, recipe, seed=0, progress=False)
    sizes = {"fc1": 784 * 300, "fc2": 300 * 100, "fc3": 100 * 10}
    for layer, kept in reproduce_han2015.PAPER["lenet300"]["kept"].items():
        n = sizes[layer]
        sparsity = round(1.0 - kept, 6)  # last round: kept ** 1
        assert r["kept_per_layer"][layer] == (n - math.floor(n * sparsity)) / n
    assert r["kept"] == pytest.approx(0.0818, abs=5e-4)  # (0.08*235200 + 0.09*30000 + 0.26*1000) / 266200
    assert r["acc"] > dense_acc - 0.10
    assert abs(r["acc_exported"] - r["acc"]) <= 0.001  # the exported plain model predicts as the pruned one
    # the dense model is untouched by the pipeline
    assert all((m.weight != 0).all() for m in dense.modules() if isinstance(m, torch.nn.Linear))


def test_han_sensitivity_calibrated_rounds(setup):
    h, ds, dense, dense_acc = setup
    recipe = reproduce_han2015.Recipe(DENSE, rounds=2, retrain=Train(1, 2e-4, 64))
    r = reproduce_han2015.run_sensitivity(h, "lenet300", dense, ds, recipe, seed=0, progress=False)
    assert len(r["sensitivity"]) == 2  # one q per layer and round, calibrated on the current weights
    assert all(0.1 < q < 5.0 for qs in r["sensitivity"] for q in qs.values())
    for layer, kept in reproduce_han2015.PAPER["lenet300"]["kept"].items():
        # q is rounded to 4 decimals, so the q * std threshold lands within a few weights of the target
        assert r["kept_per_layer"][layer] == pytest.approx(kept, abs=0.003)
    assert r["acc"] > dense_acc - 0.15


def test_calibrate_sensitivity_on_gaussian():
    w = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)).numpy()
    q = reproduce_han2015.calibrate_sensitivity(w, 0.10, rounds=1)
    # one round on a standard normal keeps P(|w| >= q * std) = 0.10 -> q ~ 1.645
    assert q == pytest.approx(1.645, abs=0.01)


def test_agp_pipeline(setup):
    h, ds, dense, dense_acc = setup
    recipe = reproduce_agp.Recipe(DENSE, Train(3, 2e-4, 64), ramp=2)
    r = reproduce_agp.run_agp(h, dense, ds, recipe, 0.8, seed=0, progress=False)
    sizes = {"fc1": 784 * 300, "fc2": 300 * 100, "fc3": 100 * 10}
    for layer, n in sizes.items():
        assert r["kept_per_layer"][layer] == (n - math.floor(n * 0.8)) / n
    assert r["acc"] > dense_acc - 0.05
    assert abs(r["acc_exported"] - r["acc"]) <= 0.001


@pytest.mark.parametrize("method, floor", [("qat", 0.03), ("dorefa", 0.05), ("bnn", 0.2), ("bnn_act", 0.45)])
def test_quantization_pipelines(setup, method, floor):
    h, ds, dense, dense_acc = setup
    r = reproduce_quant.run_method(h, method, dense, ds, Train(1, 2e-4, 64), seed=0, progress=False)
    assert r["acc"] > dense_acc - floor


def test_script_end_to_end(mnist_dir, tmp_path, capsys, monkeypatch):
    """The script's own --quick run: exit 0, a markdown table, the JSON it promised."""
    import examples.common as common

    monkeypatch.setattr(common, "load_data", lambda args: load_mnist(args.data_dir).subset(2000, 500))
    out = tmp_path / "agp.json"
    rc = reproduce_agp.main(["--backend", "torch", "--quick", "--data-dir", str(mnist_dir), "--threads", "1",
                             "--no-progress", "--uniform", "--sparsity", "0.5", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| LeNet-300-100 | 50.0 % (uniform) |" in text and "ours-torch" in text
    data = json.loads(out.read_text())
    assert data["results"]["torch"]["agp"]["kept"] == pytest.approx(0.5, abs=1e-5)


def test_agp_per_layer_split_is_95_percent():
    assert reproduce_agp.overall_sparsity(reproduce_agp.PER_LAYER_95) == pytest.approx(0.95, abs=5e-4)
    cfg = reproduce_agp.agp_config(reproduce_agp.PER_LAYER_95, ramp=15)
    assert [c["op_names"] for c in cfg] == [["fc1"], ["fc2"], ["fc3"]] and cfg[2]["final_sparsity"] == 0.7


def test_export_weights_match_masks(setup):
    h, ds, dense, _ = setup
    model = h.copy(dense)
    pruner = h.backend.LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
    pruner.compress()
    w = export_weights(h, pruner, model)
    overall, per = kept_fractions(w, ["fc1", "fc2", "fc3"])
    assert per == {"fc1": 0.5, "fc2": 0.5, "fc3": 0.5} and overall == 0.5


def test_han_verdict_needs_error_and_sparsity():
    v = reproduce_han2015.verdict
    assert v(0.9809, 0.9806, 0.0818) == "yes"
    assert v(0.9809, 0.9787, 0.0818) == "no (+0.22 pp)"
    assert v(0.9809, 0.9819, 0.0943) == "no (9.4 % kept)"
