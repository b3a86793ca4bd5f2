"""Dependency-aware filter pruning on torch: coupled layers share one decision, norms are masked with
their convs, data criteria wait for their statistics, bad arguments are refused before any change."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import compressor.torch as cth
from compressor.core.errors import ConfigError, ConfigWarning

pytestmark = pytest.mark.torch


class Block(nn.Module):
    """conv1 -> bn1 -> relu -> conv2 -> bn2, added to the block input produced by stem; head conv3."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 6, 3, padding=1)
        self.conv1 = nn.Conv2d(6, 4, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(4)
        self.conv2 = nn.Conv2d(4, 6, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(6)
        self.head = nn.Conv2d(6, 5, 1)
        self.fc = nn.Linear(5, 2)

    def forward(self, x):
        s = torch.relu(self.stem(x))
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(s)))))
        return self.fc(torch.relu(self.head(torch.relu(s + y))).mean((2, 3)))


def make(seed=0):
    torch.manual_seed(seed)
    m = Block().eval()
    with torch.no_grad():
        for bn in (m.bn1, m.bn2):
            bn.weight.uniform_(0.5, 1.5)
            bn.bias.uniform_(-1, 1)
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
    return m


X = torch.randn(2, 3, 8, 8)


def kept(pruner, layer):
    w = {w.name: w for w in pruner.get_modules_wrapper()}[layer]
    return w.weight_mask.reshape(w.weight_mask.shape[0], -1).any(1)


def test_groups_share_channels_and_norms_follow():
    m = make()
    p = cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True, dummy_input=X)
    p.compress()
    assert [w.name for w in p.get_modules_wrapper()] == ["stem", "conv1", "conv2", "head", "bn2", "bn1"]
    # stem and conv2 meet at the add: one decision over the sum of their L1 norms, 3 of 6 pruned
    scores = (p.get_modules_wrapper()[0].module.weight.detach().abs().sum((1, 2, 3))
              + p.get_modules_wrapper()[2].module.weight.detach().abs().sum((1, 2, 3)))
    expected = torch.ones(6, dtype=torch.bool)
    expected[torch.argsort(scores, stable=True)[:3]] = False
    for layer in ("stem", "conv2", "bn2"):
        assert torch.equal(kept(p, layer), expected), layer
    # conv1 + bn1 are their own group: 2 of 4
    assert torch.equal(kept(p, "conv1"), kept(p, "bn1")) and int(kept(p, "conv1").sum()) == 2
    # biases and BN beta follow the channel
    bn2 = {w.name: w for w in p.get_modules_wrapper()}["bn2"]
    assert torch.equal(bn2.bias_mask, expected)
    small = cth.speedup_model(p, X)
    assert (small.stem.out_channels, small.conv1.out_channels, small.conv2.out_channels) == (3, 2, 3)
    assert small.head.in_channels == 3 and small.bn2.num_features == 3


def test_masked_model_equals_speedup_for_data_criteria():
    m = make(1)
    opt = torch.optim.SGD(m.parameters(), lr=0.0)
    p = cth.ActivationMeanRankFilterPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], opt,
                                           statistics_batch_num=2, dependency_aware=True, dummy_input=X)
    p.compress()
    assert all(bool(w.weight_mask.all()) for w in p.get_modules_wrapper())  # waits for statistics
    for _ in range(2):
        opt.zero_grad()
        m(torch.randn(4, 3, 8, 8)).sum().backward()
        opt.step()
    assert torch.equal(kept(p, "stem"), kept(p, "conv2")) and torch.equal(kept(p, "conv2"), kept(p, "bn2"))
    assert int(kept(p, "stem").sum()) == 3
    with torch.no_grad():
        ref = m(X)
    small = cth.speedup_model(p, X)
    with torch.no_grad():
        out = small(X)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_unselected_coupled_layer_is_named_in_a_warning():
    m = make()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_names": ["conv2"]}], dependency_aware=True, dummy_input=X)
    msgs = [str(w.message) for w in rec if issubclass(w.category, ConfigWarning)]
    assert any("'stem'" in msg and "not selected" in msg for msg in msgs)


@pytest.mark.parametrize("kwargs,match", [
    ({"dependency_aware": True}, "needs dummy_input"),
    ({"dependency_aware": "yes", "dummy_input": X}, "must be True or False"),
])
def test_bad_dependency_arguments_leave_the_model_untouched(kwargs, match):
    m = make()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(ConfigError, match=match):
        cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], **kwargs)
    assert list(m.state_dict()) == list(before)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    assert type(m.stem) is nn.Conv2d


def test_criteria_without_filter_scores_refuse_dependency_aware():
    class LevelGroups(cth.OneShotPruner):
        masker_class = cth.LevelPrunerMasker

    with pytest.raises(ConfigError, match="filter criterion"):
        LevelGroups(make(), [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True, dummy_input=X)


def test_a_dummy_input_the_model_rejects_is_a_clear_error_and_changes_nothing():
    from compressor.core.errors import ModelError

    m = make()
    with pytest.raises(ModelError, match=r"forward raised RuntimeError on dummy_input \[\(1, 5, 8, 8\)\]"):
        cth.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d"]}], dependency_aware=True,
                           dummy_input=torch.randn(1, 5, 8, 8))
    assert type(m.stem) is nn.Conv2d and m.training is False
