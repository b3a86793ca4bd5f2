"""Round trips: export -> original class, mask files, ONNX, and resuming from a wrapped checkpoint."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.torch.pruning import AGPPruner, LevelPruner, apply_compression_results


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


X = torch.randn(4, 1, 6, 6, generator=torch.Generator().manual_seed(0))
CFG = [{"sparsity": 0.6, "op_types": ["default"]}]


def trained_pruned(steps=3):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    pruner = LevelPruner(model, CFG, opt)
    pruner.compress()
    for _ in range(steps):
        opt.zero_grad()
        model(X).square().sum().backward()
        opt.step()
    return model.eval(), pruner


def test_export_loads_into_original_class_with_same_outputs(tmp_path):
    model, pruner = trained_pruned()
    pruner.export_model(tmp_path / "model.pt", tmp_path / "mask.pt")
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    assert set(state) == set(Net().state_dict())  # original keys, no masks
    fresh = Net().eval()
    fresh.load_state_dict(state)  # strict
    with torch.no_grad():
        assert torch.equal(fresh(X), model(X))
    assert int((state["conv.weight"] == 0).sum()) >= 21  # floor(0.6 * 36) zeroed
    masks = torch.load(tmp_path / "mask.pt", weights_only=True)
    assert set(masks) == {"conv", "fc"} and set(masks["conv"]) == {"weight", "bias"}
    assert masks["conv"]["weight"].dtype == torch.bool
    assert torch.equal(masks["fc"]["weight"], model.fc.weight_mask)
    # the live wrapped model is unchanged by exporting
    assert "conv.module.weight" in model.state_dict()


def test_apply_compression_results_to_plain_and_wrapped_models(tmp_path):
    model, pruner = trained_pruned()
    pruner.export_model(tmp_path / "model.pt", tmp_path / "mask.pt")
    dense = Net()
    with torch.no_grad():
        for p in dense.parameters():
            p.fill_(1.0)
    apply_compression_results(dense, tmp_path / "mask.pt")
    assert torch.equal(dense.conv.weight != 0, model.conv.weight_mask)
    torch.manual_seed(1)
    other = Net()
    other_pruner = LevelPruner(other, [{"sparsity": 0.1, "op_types": ["default"]}])
    other_pruner.compress()
    apply_compression_results(other, tmp_path / "mask.pt")
    assert torch.equal(other.fc.weight_mask, model.fc.weight_mask)
    assert (other.fc.module.weight[~other.fc.weight_mask] == 0).all()
    torch.save({"nope": {"weight": torch.ones(2, dtype=torch.bool)}}, tmp_path / "bad.pt")
    with pytest.raises(ConfigError, match="nope"):
        apply_compression_results(Net(), tmp_path / "bad.pt")


def test_onnx_export_matches_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    model, pruner = trained_pruned()
    with pytest.raises(ConfigError, match="input_shape"):
        pruner.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx")
    pruner.export_model(tmp_path / "m.pt", onnx_path=tmp_path / "m.onnx", input_shape=(4, 1, 6, 6))
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(None, {session.get_inputs()[0].name: X.numpy()})[0]
    with torch.no_grad():
        want = model(X).numpy()
    assert got.shape == want.shape and abs(got - want).max() < 1e-4


def test_load_model_state_dict_from_original_keys():
    model, pruner = trained_pruned()
    torch.manual_seed(5)
    donor = Net()
    pruner.load_model_state_dict(donor.state_dict())
    assert torch.equal(model.conv.module.weight, donor.conv.weight * model.conv.weight_mask)
    assert torch.equal(model.bn.running_mean, donor.bn.running_mean)
    with pytest.raises(ConfigError, match="missing"):
        pruner.load_model_state_dict({"conv.weight": donor.conv.weight})


def _agp(model, opt):
    config = [{"final_sparsity": 0.8, "end_epoch": 8, "frequency": 2, "op_types": ["default"]}]
    pruner = AGPPruner(model, config, opt)
    pruner.compress()
    return pruner


def _epochs(model, opt, pruner, epochs):
    for epoch in epochs:
        pruner.update_epoch(epoch)
        for _ in range(2):
            opt.zero_grad()
            model(X).square().sum().backward()
            opt.step()


def test_resume_from_wrapped_checkpoint(tmp_path):
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pruner = _agp(model, opt)
    _epochs(model, opt, pruner, range(3))
    torch.save({"model": model.state_dict(), "pruner": pruner.state_dict(), "opt": opt.state_dict()},
               tmp_path / "ckpt.pt")
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)

    torch.manual_seed(123)
    model2 = Net()
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.01)
    pruner2 = _agp(model2, opt2)
    model2.load_state_dict(ckpt["model"])
    pruner2.load_state_dict(ckpt["pruner"])
    opt2.load_state_dict(ckpt["opt"])
    assert pruner2.current_epoch == 2 and pruner2.state_dict() == pruner.state_dict()
    for a, b in zip(pruner.get_modules_wrapper(), pruner2.get_modules_wrapper()):
        assert torch.equal(a.weight_mask, b.weight_mask)
        assert torch.equal(a.weight, b.weight)
    _epochs(model, opt, pruner, range(3, 8))
    _epochs(model2, opt2, pruner2, range(3, 8))
    for a, b in zip(pruner.get_modules_wrapper(), pruner2.get_modules_wrapper()):
        assert torch.equal(a.weight_mask, b.weight_mask)
    assert [r["pruned"] for r in pruner2.report()] == [28, 153]  # floor(0.8 * 36), floor(0.8 * 192)
