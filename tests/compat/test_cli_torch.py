"""``compressor report`` on files exported by the PyTorch backend, ``check`` with a torch algorithm's keys."""

import json

import torch
from torch import nn

from compressor.app.cli import main
from compressor.torch import DoReFaQuantizer, LevelPruner


def run(capsys, *argv):
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def pruned_model():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.copy_(torch.arange(1.0, 17.0).reshape(4, 4))
        model[2].weight.copy_(torch.arange(1.0, 9.0).reshape(2, 4))
    pruner = LevelPruner(model, [{"sparsity": 0.75, "op_types": ["default"]}, {"op_names": ["2"], "exclude": True}])
    pruner.compress()
    return model, pruner


def test_report_pruned_export_with_masks(capsys, tmp_path):
    _, pruner = pruned_model()
    pruner.export_model(str(tmp_path / "model.pt"), str(tmp_path / "masks.pt"))
    rc, out, err = run(capsys, "report", tmp_path / "model.pt", "--masks", tmp_path / "masks.pt", "--json")
    assert (rc, err) == (0, "")
    rows = {r["layer"]: r for r in json.loads(out)}
    assert rows["0"] == {"layer": "0", "shape": [4, 4], "params": 16, "zeros": 12, "sparsity": 0.75, "masked": 0.75,
                         "distinct": 4, "bits": 32, "bits_source": "dtype", "dtype": "float32"}
    assert (rows["2"]["zeros"], rows["2"]["masked"]) == (0, None)


def test_report_wrapped_state_dict_uses_its_masks(capsys, tmp_path):
    model, _ = pruned_model()
    torch.save(model.state_dict(), tmp_path / "wrapped.pth")  # keys 0.module.weight, 0.weight_mask
    rc, out, _ = run(capsys, "report", tmp_path / "wrapped.pth", "--json")
    rows = {r["layer"]: r for r in json.loads(out)}
    assert rc == 0 and set(rows) == {"0", "2"} and rows["0"]["masked"] == 0.75


def test_report_quantized_export_bits(capsys, tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16))
    q = DoReFaQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["default"]}])
    q.compress()
    q.export_model(str(tmp_path / "q.pt"), str(tmp_path / "calib.pt"))
    rc, out, _ = run(capsys, "report", tmp_path / "q.pt", "--json")
    row = json.loads(out)[0]
    assert rc == 0 and (row["bits"], row["bits_source"]) == (2, "distinct values") and row["distinct"] <= 4
    rc, out, _ = run(capsys, "report", tmp_path / "q.pt", "--calibration", tmp_path / "calib.pt", "--json")
    assert rc == 0 and (json.loads(out)[0]["bits"], json.loads(out)[0]["bits_source"]) == (2, "calibration")


def test_report_plot_and_table(capsys, tmp_path):
    _, pruner = pruned_model()
    pruner.export_model(str(tmp_path / "model.pt"), str(tmp_path / "masks.pt"))
    png = tmp_path / "s.png"
    rc, out, _ = run(capsys, "report", tmp_path / "model.pt", "--masks", tmp_path / "masks.pt", "--plot", png)
    assert rc == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert out.splitlines()[2].split() == ["0", "4x4", "16", "12", "75.00%", "75.00%", "32", "(float32)"]


def test_report_refuses_a_pickled_module(capsys, tmp_path):
    torch.save(nn.Linear(2, 2), tmp_path / "module.pt")
    rc, _, err = run(capsys, "report", tmp_path / "module.pt")
    assert rc == 2 and err.startswith(f"compressor: error: cannot read '{tmp_path / 'module.pt'}' as a torch state_dict")
    assert err.count("\n") == 1


def test_check_with_torch_algorithm_keys(capsys, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- {op_types: [Conv2d, Linear]}\n")
    rc, _, err = run(capsys, "check", cfg, "--algorithm", "LevelPruner", "--backend", "torch")
    assert rc == 2 and err.strip().endswith("LevelPruner needs key(s) ['sparsity'] in every non-excluded entry")
    cfg.write_text("- {sensitivity: 1.0, op_types: [default]}\n")
    assert run(capsys, "check", cfg, "--algorithm", "SensitivityPruner", "--backend", "torch")[0] == 0
    rc, _, err = run(capsys, "check", cfg, "--algorithm", "LevelPruner", "--backend", "torch")
    assert rc == 2 and "unknown key 'sensitivity'" in err
