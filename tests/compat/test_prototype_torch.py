"""The seed-004 prototype API on PyTorch (``compressor.torchCompressor``), exactly as seed 004 writes it."""

import textwrap
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import compressor
from compressor import torchCompressor
from compressor.core import quant as cq
from compressor.core.ops import NumpyOps

SEED_YAML = textwrap.dedent("""\
    tfAGPruner:
      config:
        -
            start_epoch: 0
            end_epoch: 16
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: default
        -
            prune: False
            start_epoch: 0
            end_epoch: 20
            frequency: 2
            initial_sparsity: 0.05
            final_sparsity: 0.60
            support_type: [Linear]
            support_op: [conv1, conv2]
""")


def signed_range(n: int, shape: tuple) -> torch.Tensor:
    """1, -2, 3, -4, ... : distinct magnitudes, so the pruned set is known exactly."""
    v = torch.arange(1, n + 1, dtype=torch.float32)
    return (v * torch.where(v % 2 == 0, -1.0, 1.0)).reshape(shape)


def two_layer() -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with torch.no_grad():
        model[0].weight.copy_(signed_range(16, (4, 4)))
        model[0].bias.fill_(0.5)
        model[2].weight.copy_(signed_range(8, (2, 4)))
        model[2].bias.zero_()
    return model


class Named(nn.Module):
    """Layer names of seed 004's YAML example (conv1, conv2) plus fc."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Linear(10, 10)
        self.conv2 = nn.Linear(10, 10)
        self.fc = nn.Linear(10, 10)

    def forward(self, x):
        return self.fc(torch.relu(self.conv2(torch.relu(self.conv1(x)))))


def weight_of(model: nn.Module, name: str) -> torch.Tensor:
    return compressor.torch.compressor.innermost_module(model.get_submodule(name)).weight


# ----------------------------------------------------------------------------------- built-in pruners
def test_level_pruner_as_seed_004_writes_it():
    model = two_layer()
    pruner = torchCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])
    assert pruner(model) is model
    # floor(16 * 0.8) = 12 and floor(8 * 0.8) = 6 smallest |w| pruned
    assert torch.equal(weight_of(model, "0") != 0, signed_range(16, (4, 4)).abs() > 12)
    assert torch.equal(weight_of(model, "2") != 0, signed_range(8, (2, 4)).abs() > 6)
    assert type(pruner.compressor) is compressor.torch.LevelPruner


def test_training_runs_unchanged_with_masks_applied():
    torch.manual_seed(0)
    model = two_layer()
    torchCompressor.LevelPruner([{'sparsity': 0.8, 'support_type': 'default'}])(model)
    keep0 = signed_range(16, (4, 4)).abs() > 12
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    for _ in range(3):  # a plain loop: no pruner call, no hook
        opt.zero_grad()
        F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2)).backward()
        opt.step()
    x = torch.randn(5, 4)
    out = model(x)
    w0, w2 = weight_of(model, "0"), weight_of(model, "2")
    assert torch.equal(w0 != 0, keep0)  # momentum and weight decay did not revive pruned weights
    want = F.linear(torch.relu(F.linear(x, w0 * keep0, model[0].module.bias)), w2, model[2].module.bias)
    assert torch.allclose(out, want)


def test_agpruner_with_seed_004_yaml_file(tmp_path):
    path = tmp_path / "agp.yaml"
    path.write_text(SEED_YAML)
    torch.manual_seed(0)
    model = Named()
    pruner = torchCompressor.AGPruner()
    configure = pruner.load_configure(str(path))
    assert configure[1]["prune"] is False  # the prototype's own keys are kept as written
    pruner(model)

    def pruned(name):
        return int((weight_of(model, name) == 0).sum())

    # entry 2 (prune: False) excludes the Linear layers named conv1/conv2; fc follows the AGP schedule:
    # span 14; s(0) = 0.05, s(2) = 0.6 - 0.55 * (12/14)^3 = 0.2536, s(14) = 0.6 -> 5, 25, 60 of 100 weights
    assert (pruned("conv1"), pruned("conv2"), pruned("fc")) == (0, 0, 5)
    pruner.update_epoch(1)  # not a schedule epoch (frequency 2)
    assert pruned("fc") == 5
    pruner.update_epoch(2)
    assert pruned("fc") == 25
    pruner.update_epoch(14)
    assert (pruned("conv1"), pruned("fc")) == (0, 60)


def test_load_configure_picks_this_backends_section(tmp_path):
    path = tmp_path / "both.yaml"
    path.write_text("tfAGPruner:\n  config: [{final_sparsity: 0.3, op_types: [default]}]\n"
                    "torchAGPruner:\n  config: [{final_sparsity: 0.5, op_types: [default]}]\n"
                    "LevelPruner:\n  config: [{sparsity: 0.25, op_types: [default]}]\n")
    assert torchCompressor.AGPruner().load_configure(path)[0]["final_sparsity"] == 0.5
    assert torchCompressor.LevelPruner(str(path)).configure_list[0]["sparsity"] == 0.25
    with pytest.raises(compressor.ConfigError, match=r"has no section for SensitivityPruner; sections: "
                                                     r"\['LevelPruner', 'tfAGPruner', 'torchAGPruner'\]"):
        torchCompressor.SensitivityPruner().load_configure(path)


def test_sensitivity_pruner_reads_the_prototypes_sparsity_as_the_quality_parameter():
    model = nn.Sequential(nn.Linear(4, 2))
    w = torch.tensor([[0.1, -0.2, 0.3, -0.4], [1.0, -2.0, 3.0, -4.0]])
    with torch.no_grad():
        model[0].weight.copy_(w)
    pruner = torchCompressor.SensitivityPruner([{'sparsity': 1.2, 'support_type': 'default'}])
    pruner(model)
    # Han et al.: prune |w| < 1.2 * std(w) = 1.2 * 1.9146 = 2.2975 -> only 3 and -4 stay
    assert torch.equal(weight_of(model, "0") != 0, w.abs() > 2.5)
    assert pruner.compressor.config_list[0]["sensitivity"] == 1.2


# -------------------------------------------------------------------------------- built-in quantizers
def test_dorefa_quantizer_with_prototype_keys():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    w = model[0].weight.detach().clone()
    quantizer = torchCompressor.DoReFaQuantizer([{'q_bits': 2, 'support_type': 'default'}])
    quantizer(model)
    assert quantizer.compressor.config_list[0]["quant_types"] == ["weight"]
    x = torch.randn(4, 6)
    wq = torch.from_numpy(cq.dorefa_weight(NumpyOps(), w.numpy().astype(np.float64), 2)).float()
    assert torch.allclose(model(x), F.linear(x, wq, model[0].module.bias), atol=1e-6)
    assert len(torch.unique(wq)) <= 4


def test_qat_quantizer_and_the_step_clock():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 3))
    quantizer = torchCompressor.QATquantizer([{'q_bits': 8, 'support_type': 'default', 'quant_start_step': 1}])
    quantizer(model)
    assert type(quantizer.compressor).__name__ == "QAT_Quantizer"
    x = torch.randn(4, 6)
    w = model[0].module.weight
    assert torch.allclose(model(x), F.linear(x, w, model[0].module.bias))  # before quant_start_step
    quantizer.step()
    assert quantizer.compressor.steps == 1
    wq, _ = quantizer.compressor.export_weight(model[0])
    assert len(torch.unique(wq)) <= 255 and not torch.equal(wq, w)
    assert torch.allclose(model(x), F.linear(x, wq, model[0].module.bias), atol=1e-6)


# ---------------------------------------------------------------------------------- designers' classes
class ThresholdPruner(torchCompressor.TorchPruner):
    """Seed 004's example shape: __init__ without super(), calc_mask(layer_info, weight), step()."""

    def __init__(self, threshold):
        self.threshold = threshold
        self.seen = []

    def calc_mask(self, layer_info, weight):
        self.seen.append((layer_info.name, layer_info.type, tuple(weight.shape), weight.requires_grad))
        return weight.abs() > self.threshold

    def step(self):
        self.threshold += 2


def test_custom_pruner_without_super_init():
    model = two_layer()
    pruner = ThresholdPruner(3)
    assert pruner(model) is model
    assert pruner.seen == [("0", "Linear", (4, 4), False), ("2", "Linear", (2, 4), False)]
    assert torch.equal(weight_of(model, "0") != 0, signed_range(16, (4, 4)).abs() > 3)
    pruner.step()  # the designer's step runs, then the masks are evaluated again
    assert pruner.threshold == 5 and len(pruner.seen) == 4
    assert torch.equal(weight_of(model, "0") != 0, signed_range(16, (4, 4)).abs() > 5)
    assert torch.equal(weight_of(model, "2") != 0, signed_range(8, (2, 4)).abs() > 5)
    pruner.update_epoch(1)  # no override: masks are still re-evaluated
    assert len(pruner.seen) == 6


def test_custom_pruner_with_configure_and_layer_module():
    class OnlyFirst(torchCompressor.TorchPruner):
        def calc_mask(self, layer_info, weight):
            assert isinstance(layer_info.extra["layer"], nn.Linear)
            return torch.zeros_like(weight)  # 0/1 numbers work as well as bools

    model = two_layer()
    OnlyFirst([{'support_op': ['0'], 'support_type': 'default'}])(model)
    assert int((weight_of(model, "0") != 0).sum()) == 0
    assert torch.equal(weight_of(model, "2"), signed_range(8, (2, 4)))


def test_clock_runs_once_when_a_subclass_chains_to_super():
    class Counting(torchCompressor.QATquantizer):
        def step(self):
            self.calls = getattr(self, "calls", 0) + 1
            super().step()

    q = Counting([{'q_bits': 8, 'support_type': 'default'}])
    q(nn.Sequential(nn.Linear(2, 2)))
    q.step()
    assert q.calls == 1 and q.compressor.steps == 1


class HalfStepQuantizer(torchCompressor.TorchQuantizer):
    def __init__(self, your_input):
        self.step_size = your_input

    def quantize_weight(self, layer_info, weight):
        return torch.round(weight / self.step_size) * self.step_size


def test_custom_quantizer_replaces_the_weight_and_passes_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3))
    HalfStepQuantizer(0.5)(model)
    layer = model[0].module
    x = torch.randn(2, 4)
    out = model(x)
    assert torch.allclose(out, F.linear(x, torch.round(layer.weight / 0.5) * 0.5, layer.bias))
    out.sum().backward()
    assert torch.allclose(layer.weight.grad, x.sum(0).expand(3, 4))  # straight through the rounding


def test_preprocess_model_runs_before_instrumentation():
    seen = []

    class Prep(torchCompressor.LevelPruner):
        def preprocess_model(self, model):
            seen.append(type(model[0]).__name__)

    Prep([{'sparsity': 0.5, 'support_type': 'default'}])(two_layer())
    assert seen == ["Linear"]


def test_prototype_keys_do_not_warn_and_modern_features_are_reachable(tmp_path):
    model = two_layer()
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        pruner = torchCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': 'default', 'support_op': ['0']}])
        pruner(model)
    pruner.export_model(str(tmp_path / "m.pt"))  # the modern compressor's methods, through the prototype
    state = torch.load(tmp_path / "m.pt", weights_only=True)
    assert int((state["0.weight"] == 0).sum()) == 8 and int((state["2.weight"] == 0).sum()) == 0


# --------------------------------------------------------------------------------------------- errors
def test_bad_configure_is_refused_at_construction():
    with pytest.raises(compressor.ConfigError, match=r"config_list\[0\]: 'sparsity' = 1.2 is invalid"):
        torchCompressor.LevelPruner([{'sparsity': 1.2, 'support_type': 'default'}])


def test_model_untouched_when_instrumentation_fails():
    model = two_layer()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    pruner = torchCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': ['Conv2d']}])
    with pytest.raises(compressor.ConfigError, match="selects no layer of the model"), \
            pytest.warns(compressor.ConfigWarning, match=r"op_types \['Conv2d'\] match no layer"):
        pruner(model)
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert pruner.compressor is None


def test_usage_errors():
    with pytest.raises(compressor.ConfigError, match=r"LevelPruner needs a configure list"):
        torchCompressor.LevelPruner()(two_layer())
    pruner = torchCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': 'default'}])
    pruner(two_layer())
    with pytest.raises(compressor.ConfigError, match="has already instrumented a model"):
        pruner(two_layer())

    class NoMask(torchCompressor.TorchPruner):
        pass

    with pytest.raises(NotImplementedError, match=r"NoMask must implement calc_mask\(self, layer_info, weight\)"):
        NoMask()(two_layer())
    with pytest.raises(compressor.ModelError, match="model must be a torch.nn.Module"):
        torchCompressor.LevelPruner([{'sparsity': 0.5, 'support_type': 'default'}])(object())
    with pytest.raises(AttributeError, match="has no attribute 'export_model'"):
        torchCompressor.LevelPruner().export_model  # noqa: B018 - nothing instrumented yet
