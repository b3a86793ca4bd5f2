"""TorchQuantizer framework: calling styles (seeds 002/003), QuantGrad (seed 003's ClipGrad), wrapping,
optimizer hook and step counter, parameters, bad input leaves the model untouched."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from compressor import ConfigError
from compressor.torch import (
    BNNQuantizer,
    DoReFaQuantizer,
    LsqQuantizer,
    NaiveQuantizer,
    QAT_Quantizer,
    QuantGrad,
    Quantizer,
    QuantizerModuleWrapper,
    QuantType,
    TorchQuantizer,
)


def snapshot(model: nn.Module):
    return repr(model), [id(m) for m in model.modules()], {k: v.clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, snap) -> None:
    r, ids, state = snap
    assert repr(model) == r
    assert [id(m) for m in model.modules()] == ids
    now = model.state_dict()
    assert now.keys() == state.keys()
    for k, v in state.items():
        assert torch.equal(now[k], v), k


def identity_linear(n: int = 4) -> nn.Sequential:
    lin = nn.Linear(n, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(n))
    return nn.Sequential(lin)


# ---------------------------------------------------------------------------------- seed 003, as written
# (import path adapted from ``nni.compression.torch.compressor``)
class ClipGrad(QuantGrad):
    @staticmethod
    def quant_backward(tensor, grad_output, quant_type):
        """
        This method should be overrided by subclass to provide customized backward function,
        default implementation is Straight-Through Estimator
        """

        # for quant_output function, set grad to zero if the absolute value of tensor is larger than 1
        if quant_type == QuantType.QUANT_OUTPUT:
            grad_output[torch.abs(tensor) > 1] = 0
        return grad_output


class YourQuantizer(Quantizer):
    def __init__(self, model, config_list):
        super().__init__(model, config_list)
        # set your customized backward function to overwrite default backward function
        self.quant_grad = ClipGrad
        self.calls = []

    def quantize_weight(self, weight, config, **kwargs):
        self.calls.append(("weight", config, kwargs.get("op_name")))
        return weight

    def quantize_output(self, output, config, **kwargs):
        self.calls.append(("output", config, kwargs.get("op_name")))
        return torch.round(output)  # no gradient of its own: QuantGrad supplies it

    def quantize_input(self, *inputs, config, **kwargs):
        self.calls.append(("input", config, kwargs.get("op_name")))
        return inputs

    def update_epoch(self, epoch_num):
        pass

    def step(self):
        pass


def test_seed003_clipgrad_example_runs_and_clips_output_gradient():
    model = identity_linear()
    cfg = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Linear"]}]
    q = YourQuantizer(model, cfg)
    q.compress()
    x = torch.tensor([[0.4, -2.0, 1.0, 3.6]], requires_grad=True)
    y = model(x)
    assert torch.equal(y, torch.tensor([[0.0, -2.0, 1.0, 4.0]]))
    y.sum().backward()
    # output quantization clips where |output| > 1; input/weight gradients pass straight through
    assert torch.equal(x.grad, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    assert model[0].module.weight.grad is not None
    kinds = [c[0] for c in q.calls]
    assert kinds == ["input", "weight", "output"]
    assert all(c[1] is q.get_modules_to_compress()[0][1] and c[2] == "0" for c in q.calls)


def test_clipgrad_does_not_corrupt_shared_gradients():
    """ClipGrad edits grad_output in place; autograd may share that tensor with another branch."""
    model = identity_linear()
    q = YourQuantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Linear"]}])
    q.compress()
    x = torch.tensor([[0.4, -2.0, 1.0, 3.6]], requires_grad=True)
    b = torch.zeros(4, requires_grad=True)
    (model(x) + b).sum().backward()
    assert torch.equal(b.grad, torch.ones(4))
    assert torch.equal(x.grad, torch.tensor([[1.0, 0.0, 1.0, 0.0]]))


def test_swapping_quant_grad_back_and_forth_takes_effect_and_subclasses_are_seen():
    model = identity_linear()
    q = YourQuantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["Linear"]}])
    q.compress()

    def grad_of_x():
        x = torch.tensor([[0.4, -2.0, 1.0, 3.6]], requires_grad=True)
        model(x).sum().backward()
        return x.grad

    assert not q._default_grad and torch.equal(grad_of_x(), torch.tensor([[1.0, 0.0, 1.0, 0.0]]))
    q.quant_grad = QuantGrad  # back to the default: plain STE (this quantizer records no range)
    assert q._default_grad and torch.equal(grad_of_x(), torch.ones(1, 4))
    q.quant_grad = ClipGrad
    assert torch.equal(grad_of_x(), torch.tensor([[1.0, 0.0, 1.0, 0.0]]))

    class ClassLevel(YourQuantizer):
        quant_grad = ClipGrad

    assert ClassLevel._default_grad is False and QAT_Quantizer._default_grad is True and BNNQuantizer._default_grad is False


# ---------------------------------------------------------------------------------- seed 002 (canonical)
class WrapperStyle(TorchQuantizer):
    def __init__(self, model, config_list, optimizer=None):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("seen", torch.zeros(()))

    def quantize_weight(self, weight, wrapper, **kwargs):
        assert isinstance(wrapper, QuantizerModuleWrapper)
        wrapper.seen.add_(1)
        return torch.round(weight * 2) / 2

    def quantize_output(self, output, wrapper, **kwargs):
        return torch.round(output)


def test_seed002_wrapper_style_default_grad_is_plain_ste_without_recorded_range():
    model = nn.Sequential(nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[0.3, 0.8], [-0.6, 1.2]]))
    q = WrapperStyle(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_names": ["0"]}])
    x = torch.tensor([[1.0, 1.0]], requires_grad=True)
    y = model(x)
    # weight rounded to halves: [[0.5, 1.0], [-0.5, 1.0]] -> outputs [1.5, 0.5] -> rounded to even [2, 0]
    assert torch.equal(y, torch.tensor([[2.0, 0.0]]))
    y.sum().backward()
    assert torch.equal(x.grad, torch.tensor([[0.0, 2.0]]))  # STE through round(output), W_q^T @ 1
    assert torch.equal(model[0].module.weight.grad, torch.ones(2, 2))
    assert q.get_modules_wrapper()[0].seen.item() == 1


def test_missing_quantize_method_is_a_config_error_and_model_untouched():
    model = identity_linear()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="quantize_input"):
        WrapperStyle(model, [{"quant_types": ["input"], "quant_bits": 8, "op_types": ["Linear"]}])
    assert_untouched(model, snap)


# ---------------------------------------------------------------------------------- parameters / optimizer
def small_cnn() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5))


def test_float_weight_stays_the_trainable_parameter():
    model = small_cnn()
    params_before = list(model.parameters())
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]}])
    model = q.compress()
    after = list(model.parameters())
    assert len(after) == len(params_before) and all(a is b for a, b in zip(after, params_before))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # created after compress()
    w0 = params_before[0].detach().clone()
    model(torch.randn(2, 1, 8, 8)).sum().backward()
    opt.step()
    assert not torch.equal(params_before[0], w0)  # the float weight is what the optimizer moves


def test_optimizer_hook_counts_steps_and_is_idempotent():
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}], opt)
    q.hook_optimizer(opt)  # again: no second hook
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(2, 1, 8, 8)).sum().backward()
        opt.step()
    assert q.steps == 3
    q.unhook()
    opt.step()
    assert q.steps == 3
    assert q.state_dict() == {"steps": 3}


def test_quant_start_step_identity_before_but_ranges_tracked():
    model = nn.Sequential(nn.Linear(3, 3))
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: weights fixed, only the clock moves
    cfg = [{"quant_types": ["weight", "output"], "quant_bits": 2, "quant_start_step": 2, "op_types": ["Linear"]}]
    q = QAT_Quantizer(model, cfg, opt)
    w = q.get_modules_wrapper()[0]
    x = torch.randn(4, 3)
    for step in range(3):
        y = model(x)
        if step < 2:
            assert torch.equal(y, ref(x))
            assert bool(w.output_observed)
        else:
            assert not torch.allclose(y, ref(x))  # 2 bits: clearly quantized now
        opt.zero_grad()
        y.sum().backward()
        opt.step()


# ---------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("cls, cfg, match", [
    (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 0}, "quant_bits"),
    (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 33}, "quant_bits"),
    (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": {"weight": 40}}, "quant_bits"),
    (QAT_Quantizer, {"quant_types": ["bias"], "quant_bits": 8}, "quant_types"),
    (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 8, "quant_scheme": "per_row"}, "quant_scheme"),
    (QAT_Quantizer, {"quant_types": ["weight"], "quant_bits": 1, "quant_dtype": "int"}, "bits >= 2"),
    (QAT_Quantizer, {"quant_types": ["weight"]}, "quant_bits"),
    (NaiveQuantizer, {"quant_types": ["weight"], "quant_bits": 4}, "8-bit only"),
    (NaiveQuantizer, {"quant_types": ["output"], "quant_bits": 8}, "not supported"),
    (DoReFaQuantizer, {"quant_types": ["input"], "quant_bits": 8}, "not supported"),
    (BNNQuantizer, {"quant_types": ["weight"], "quant_bits": 2}, "use 1"),
    (LsqQuantizer, {"quant_types": ["weight"], "quant_bits": 8, "quant_scheme": "per_tensor_affine"}, "unknown key"),
])
def test_bad_config_raises_before_touching_model(cls, cfg, match):
    model = small_cnn()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    groups = len(opt.param_groups)
    snap = snapshot(model)
    with pytest.raises(ConfigError, match=match):
        cls(model, [{**cfg, "op_types": ["default"]}], opt)
    assert_untouched(model, snap)
    assert len(opt.param_groups) == groups


def test_per_channel_activation_needs_conv_or_linear():
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2))
    snap = snapshot(model)
    cfg = [{"quant_types": ["output"], "quant_bits": 8, "quant_scheme": "per_channel_affine",
            "op_types": ["BatchNorm2d"]}]
    with pytest.raises(ConfigError, match="per-channel"):
        QAT_Quantizer(model, cfg)
    assert_untouched(model, snap)


def test_layer_without_weight_cannot_quantize_weight():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="no weight"):
        QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["ReLU"]}])
    assert_untouched(model, snap)


def test_second_quantizer_on_same_layer_refused():
    model = small_cnn()
    cfg = [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}]
    QAT_Quantizer(model, cfg)
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="already wrapped"):
        NaiveQuantizer(model, cfg)
    assert_untouched(model, snap)


def test_state_dict_keys_and_inplace_buffers():
    model = small_cnn()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["Conv2d"]}])
    w = q.get_modules_wrapper()[0]
    ptrs = {n: b.data_ptr() for n, b in w.named_buffers(recurse=False)}
    model(torch.randn(2, 1, 8, 8))
    assert {n: b.data_ptr() for n, b in w.named_buffers(recurse=False)} == ptrs  # updated in place (DataParallel)
    keys = set(model.state_dict())
    assert {"0.module.weight", "0.weight_scale", "0.tracked_min_input", "0.output_zero_point"} <= keys


def test_wrapping_an_eval_model_keeps_eval_mode():
    model = small_cnn().eval()
    q = QAT_Quantizer(model, [{"quant_types": ["output"], "quant_bits": 8, "op_types": ["default"]}])
    assert all(not w.training for w in q.get_modules_wrapper())
    model(torch.randn(2, 1, 8, 8))
    assert not bool(q.get_modules_wrapper()[0].output_observed)  # eval: nothing tracked


def test_deepcopy_shares_quantizer_and_torch_save_drops_it(tmp_path):
    model = small_cnn()
    q = QAT_Quantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]}])
    x = torch.randn(2, 1, 8, 8)
    model(x)
    model.eval()
    twin = copy.deepcopy(model)
    assert twin[0].quantizer is q and twin[0].module is not model[0].module
    assert twin[0].layer is twin[0].module
    assert torch.equal(twin(x), model(x))
    torch.save(model, tmp_path / "whole.pt")
    loaded = torch.load(tmp_path / "whole.pt", weights_only=False)
    with pytest.raises(RuntimeError, match="without its quantizer"):
        loaded(x)


def test_quantizer_over_pruner_keeps_pruned_zeros():
    from compressor.torch import LevelPruner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], opt).compress()
    q = QAT_Quantizer(model, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"]}], opt)
    x = torch.randn(4, 8)
    for _ in range(3):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()
    w = q.get_modules_wrapper()[0]
    wq, _ = q.export_weight(w)
    assert (w.weight == 0).sum().item() == 32
    assert bool((wq[w.weight == 0] == 0).all())  # 0 is exact on every QAT grid


def test_quant_type_compares_and_hashes_as_config_strings():
    assert QuantType.QUANT_WEIGHT == "weight" and QuantType("output") is QuantType.QUANT_OUTPUT
    assert {"weight": 8}[QuantType.QUANT_WEIGHT] == 8
    assert QuantType.INPUT is QuantType.QUANT_INPUT and len(list(QuantType)) == 3
