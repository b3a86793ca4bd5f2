"""Framework behaviour of the torch pruning base: wrapping, masks, optimizer hook, collectors, errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError, ModelError
from compressor.torch.compressor import Compressor
from compressor.torch.hooks import hooked_compressors
from compressor.torch.pruning import LevelPruner, PrunerModuleWrapper, TorchPruner


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv1(x))).flatten(1))


def net() -> Net:
    torch.manual_seed(0)
    return Net()


X = torch.randn(2, 1, 6, 6, generator=torch.Generator().manual_seed(1))
CFG = [{"sparsity": 0.5, "op_types": ["default"]}]


def snapshot(model):
    return [(k, v.clone()) for k, v in model.state_dict().items()], repr(model)


def same(model, snap):
    sd, text = snap
    now = list(model.state_dict().items())
    return text == repr(model) and len(now) == len(sd) and all(
        k1 == k2 and torch.equal(a, b) for (k1, a), (k2, b) in zip(now, sd))


def train_step(model, opt):
    opt.zero_grad()
    model(X).pow(2).sum().backward()
    opt.step()


def test_wrapping_layout_and_masks():
    model = net()
    weight = model.conv1.weight
    pruner = LevelPruner(model, CFG)
    assert pruner.compress() is model
    assert [type(m) for m in (model.conv1, model.fc)] == [PrunerModuleWrapper] * 2
    assert isinstance(model.bn, nn.BatchNorm2d)
    assert model.conv1.module.weight is weight  # still the same Parameter
    keys = list(model.state_dict())
    assert {"conv1.module.weight", "conv1.weight_mask", "conv1.bias_mask", "fc.module.weight"} <= set(keys)
    assert model.conv1.weight_mask.dtype == torch.bool and model.conv1.bias_mask.dtype == torch.bool
    assert int(model.conv1.weight_mask.sum()) == 36 - 18
    assert [li.name for li, _ in pruner.get_modules_to_compress()] == ["conv1", "fc"]
    assert all(c["sparsity"] == 0.5 for _, c in pruner.get_modules_to_compress())
    assert pruner.get_modules_wrapper() == [model.conv1, model.fc]
    assert (weight[~model.conv1.weight_mask] == 0).all()


def test_optimizer_created_after_compress_and_masked_weights_stay_zero():
    model = net()
    pruner = LevelPruner(model, CFG)
    pruner.compress()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    assert len(opt.param_groups[0]["params"]) == len(list(net().parameters()))
    pruner.hook_optimizer(opt)
    for _ in range(3):
        train_step(model, opt)
        for w in pruner.get_modules_wrapper():
            assert (w.weight[~w.weight_mask] == 0).all()


def test_hook_idempotent_two_pruners_each_once_and_unhook():
    model_a, model_b = net(), nn.Sequential(nn.Linear(3, 3))
    opt = torch.optim.SGD(list(model_a.parameters()) + list(model_b.parameters()), lr=0.1)
    calls = []

    class Counting(LevelPruner):
        def step(self):
            calls.append(self)
            super().step()

    pa = Counting(model_a, CFG, opt)
    pb = Counting(model_b, CFG, opt)
    pa.compress()
    pb.compress()
    pa.hook_optimizer(opt)  # second install: no stacking
    assert hooked_compressors(opt) == [pa, pb]
    train_step(model_a, opt)
    assert calls == [pa, pb]
    pa.unhook()
    calls.clear()
    train_step(model_a, opt)
    assert calls == [pb]
    pb.unhook()
    assert hooked_compressors(opt) == []
    assert not opt._optimizer_step_post_hooks


def test_hook_survives_zero_grad_and_lr_scheduler():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = []

    class Counting(LevelPruner):
        def step(self):
            calls.append(1)
            super().step()

    pruner = Counting(model, CFG, opt)
    pruner.compress()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for _ in range(3):
        opt.zero_grad(set_to_none=True)
        model(X).sum().backward()
        opt.step()
        sched.step()
    assert len(calls) == 3
    assert opt.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    assert (model.conv1.weight[~model.conv1.weight_mask] == 0).all()


def test_step_post_hook_runs_after_the_step():
    model = nn.Sequential(nn.Linear(4, 1, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    seen = []

    class Spy(LevelPruner):
        def step(self):
            seen.append(self.bound_model[0].weight.detach().clone())
            super().step()

    Spy(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt).compress()
    opt.zero_grad()
    model(torch.ones(1, 4)).sum().backward()  # grad = ones
    opt.step()
    assert torch.equal(seen[0], torch.tensor([[-1.0, -1.0, 2.0, 3.0]]))  # step already applied
    assert torch.equal(model[0].weight, torch.tensor([[0.0, 0.0, 2.0, 3.0]]))  # then re-masked


def test_no_remask_when_nothing_changed_and_remask_when_changed():
    model = net()
    LevelPruner(model, CFG).compress()
    w = model.conv1.module.weight
    v = w._version
    model(X)
    model(X)
    assert w._version == v  # no in-place work on an unchanged model
    with torch.no_grad():
        w.add_(1.0)  # moves pruned weights too
    model(X)
    assert (w[~model.conv1.weight_mask] == 0).all()
    model.conv1.weight_mask[0, 0, 0, 0] = False  # mask edited in place
    with torch.no_grad():
        w[0, 0, 0, 0] = 5.0
    model(X)
    assert w[0, 0, 0, 0] == 0


def test_inference_mode_and_dtype_move():
    model = net()
    LevelPruner(model, CFG).compress()
    with torch.inference_mode():
        y = model(X)
    assert y.shape == (2, 3)
    model.double()
    assert model.conv1.weight_mask.dtype == torch.bool
    with torch.no_grad():
        model.conv1.module.weight.fill_(1.0)
    model(X.double())
    assert int((model.conv1.module.weight != 0).sum()) == 18


def test_float_masks_from_user_code_are_cast_to_bool():
    model = net()
    pruner = LevelPruner(model, CFG)
    wrapper = pruner.get_modules_wrapper()[0]
    wrapper.weight_mask = torch.zeros(4, 1, 3, 3)
    assert wrapper.weight_mask.dtype == torch.bool and not wrapper.weight_mask.any()
    wrapper.set_masks({"bias_mask": torch.tensor([1.0, 0.0, 1.0, 0.0])})
    assert wrapper.bias_mask.tolist() == [True, False, True, False]
    model(X)
    assert not wrapper.weight.any() and wrapper.bias[1] == 0
    with pytest.raises(ValueError, match="shape"):
        wrapper.weight_mask = torch.ones(3)


def test_set_wrappers_attribute_buffers_and_plain_values():
    model = net()
    pruner = LevelPruner(model, CFG)
    t = torch.zeros(2)
    pruner.set_wrappers_attribute("stat", t)
    pruner.set_wrappers_attribute("seen", [])
    w0, w1 = pruner.get_modules_wrapper()
    assert "conv1.stat" in model.state_dict()
    w0.stat.add_(1)
    assert w1.stat.sum() == 0 and t.sum() == 0  # cloned per wrapper
    w0.seen.append(1)
    assert w1.seen == []
    pruner.set_wrappers_attribute("flag", torch.tensor(False))
    w0.flag = True  # python value into a tensor attribute
    assert bool(w0.flag) and not bool(w1.flag)


def test_activation_collectors():
    model = net()
    pruner = LevelPruner(model, CFG)
    got = []
    cid = pruner.add_activation_collector(lambda w, inp, out: got.append((w.name, tuple(out.shape))))
    model(X)
    assert got == [("conv1", (2, 4, 4, 4)), ("fc", (2, 3))]
    pruner.remove_activation_collector(cid)
    model(X)
    assert len(got) == 2
    with pytest.raises(ValueError):
        pruner.remove_activation_collector(cid)


def test_last_matching_entry_wins_and_exclude():
    model = net()
    pruner = LevelPruner(model, [{"sparsity": 0.2, "op_types": ["default"]},
                                 {"sparsity": 0.5, "op_names": ["conv1"]},
                                 {"exclude": True, "op_names": ["fc"]}])
    pruner.compress()
    assert [li.name for li, _ in pruner.get_modules_to_compress()] == ["conv1"]
    assert int((~model.conv1.weight_mask).sum()) == 18
    assert isinstance(model.fc, nn.Linear)


def test_shared_module_replaced_everywhere():
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}]).compress()
    assert model[0] is model[2] and isinstance(model[0], PrunerModuleWrapper)


@pytest.mark.parametrize("bad_model", [object(), "model", None])
def test_non_module_model(bad_model):
    with pytest.raises(ModelError):
        LevelPruner(bad_model, CFG)


@pytest.mark.filterwarnings("ignore::compressor.core.errors.ConfigWarning")
@pytest.mark.parametrize("config, match", [
    ([{"sparsity": 1.5, "op_types": ["default"]}], "sparsity"),
    ([{"sparsity": "0.5", "op_types": ["default"]}], "sparsity"),
    ([{"sparsity": 0.5, "op_types": "Conv2d"}], "op_types"),
    ([{"sparsity": 0.5}], "names no layers"),
    ([{"sparsty": 0.5, "op_types": ["default"]}], "did you mean 'sparsity'"),
    ([{"op_types": ["default"]}], "sparsity"),
    ([{"sparsity": 0.5, "op_types": ["LSTM"]}], "selects no layer"),
    ({"sparsity": 0.5, "op_types": ["default"]}, "list"),
])
def test_bad_config_leaves_model_untouched(config, match):
    model = net()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match=match):
        LevelPruner(model, config)
    assert same(model, snap)


def test_bad_optimizer_and_unsupported_layer_leave_model_untouched():
    model = net()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="optimizer"):
        LevelPruner(model, CFG, optimizer="sgd")
    assert same(model, snap)
    seq = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    seq_snap = snapshot(seq)
    with pytest.raises(ConfigError, match="no weight"):
        LevelPruner(seq, [{"sparsity": 0.5, "op_types": ["Linear", "ReLU"]}])
    assert same(seq, seq_snap)


def test_wrapping_twice_is_refused_and_model_untouched():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = LevelPruner(model, CFG, opt)
    first.compress()
    snap = snapshot(model)
    with pytest.raises(ConfigError, match="already wrapped"):
        LevelPruner(model, CFG, opt)
    assert same(model, snap)
    assert hooked_compressors(opt) == [first]


def test_unwrap_restores_original_modules():
    model = net()
    conv = model.conv1
    pruner = LevelPruner(model, CFG)
    pruner.compress()
    pruner._unwrap_model()
    assert model.conv1 is conv
    pruner._wrap_model()
    assert isinstance(model.conv1, PrunerModuleWrapper)


def test_pickle_and_deepcopy_of_wrapped_model(tmp_path):
    model = net()
    LevelPruner(model, CFG).compress()
    clone = copy.deepcopy(model)
    assert torch.equal(clone(X), model(X))
    torch.save(model, tmp_path / "m.pt")
    loaded = torch.load(tmp_path / "m.pt", weights_only=False)
    assert torch.equal(loaded(X), model(X))


def test_base_compressor_needs_create_wrapper():
    with pytest.raises(NotImplementedError):
        Compressor(net(), CFG)
    with pytest.raises(NotImplementedError):
        TorchPruner(net(), CFG).compress()


def test_hook_optimizer_moves_the_hook_to_a_new_optimizer():
    model = net()
    opt1 = torch.optim.SGD(model.parameters(), lr=0.1)
    pruner = LevelPruner(model, CFG, opt1)
    pruner.compress()
    opt2 = torch.optim.Adam(model.parameters(), lr=0.1)
    pruner.hook_optimizer(opt2)
    assert hooked_compressors(opt1) == [] and hooked_compressors(opt2) == [pruner]
    train_step(model, opt2)
    assert (model.conv1.module.weight[~model.conv1.weight_mask] == 0).all()


def test_level_is_one_shot_masks_fixed_while_training():
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    pruner = LevelPruner(model, CFG, opt)
    pruner.compress()
    before = model.fc.weight_mask.clone()
    for _ in range(3):
        train_step(model, opt)
    pruner.compress()
    assert torch.equal(model.fc.weight_mask, before)
    assert pruner.state_dict() == {"epoch": 0, "calculated": [0, 1]}


@pytest.mark.parametrize("cache", [True, False])
def test_remask_after_step_with_and_without_the_multiplier_cache(cache, monkeypatch):
    assert PrunerModuleWrapper.multiplier_cache is None  # default: cache on CPU only
    monkeypatch.setattr(PrunerModuleWrapper, "multiplier_cache", cache)
    model = net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    pruner = LevelPruner(model, CFG, opt)
    pruner.compress()
    conv = model.conv1
    # a bias mask nobody wrote is all True: the bias is left alone (and trains)
    assert conv._bias_is_pristine()
    b0 = conv.module.bias.detach().clone()
    train_step(model, opt)
    assert not torch.equal(conv.module.bias, b0)
    assert int((conv.module.weight == 0).sum()) == 18
    # a bias mask written later is applied after the next step
    conv.bias_mask = torch.tensor([True, False, True, False])
    assert not conv._bias_is_pristine()
    for _ in range(2):
        train_step(model, opt)
        assert conv.module.bias[1] == 0 and conv.module.bias[3] == 0
        assert conv.module.bias[0] != 0
    # a changed weight mask replaces the cached multiplier
    conv.weight_mask = torch.zeros(4, 1, 3, 3, dtype=torch.bool)
    train_step(model, opt)
    assert not conv.module.weight.any()
    # dtype moves: the multiplier follows the weight's dtype
    model.double()
    mask = torch.arange(36).reshape(4, 1, 3, 3) % 2 == 0  # 18 kept
    conv.weight_mask = mask
    with torch.no_grad():
        conv.module.weight.fill_(1.0)
    opt2 = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.5)
    pruner.hook_optimizer(opt2)
    model(X.double()).sum().backward()
    opt2.step()
    w = conv.module.weight
    assert w.dtype == torch.float64
    assert torch.equal(w != 0, mask)
    if cache:
        assert conv._mul_cache[0][1].dtype == torch.float64

def test_bias_mask_loaded_from_a_checkpoint_is_applied():
    model = net()
    LevelPruner(model, CFG).compress()
    state = model.state_dict()
    state["conv1.bias_mask"] = torch.tensor([False, True, True, True])
    fresh = net()
    LevelPruner(fresh, CFG).compress()
    fresh.load_state_dict(state)
    assert not fresh.conv1._bias_is_pristine()
    fresh(X)
    assert fresh.conv1.module.bias[0] == 0 and fresh.conv1.module.bias[1] != 0
    # a pristine bias mask stays pristine across device/dtype moves
    model.float()
    assert model.conv1._bias_is_pristine()
