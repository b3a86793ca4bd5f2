"""Model families as plug-ins (issue 24): an adapter declared through the ``compressor_add_model_families``
pluggy hook changes how the backend sees a layer type, without the backend naming it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from compressor.core.errors import ConfigError
from compressor.core.hookspecs import hookimpl
from compressor.core.registry import register_plugin, registry, unregister_plugin
from compressor.torch import L1FilterPruner
from compressor.torch.families import ModelFamily, families, is_in_out_linear

pytestmark = pytest.mark.torch


class InOut(nn.Module):
    """A Linear that stores its weight ``[in, out]`` (like HF Conv1D), unknown to compressor."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = InOut(4, 3)

    def forward(self, x):
        return self.proj(x)


class MyFamily(ModelFamily):
    name = "mine"

    def __init__(self):
        self.compressed = []

    def claims(self, model):
        return isinstance(model, Net)

    def is_in_out_linear(self, layer):
        return isinstance(layer, InOut)

    def on_compress(self, model):
        self.compressed.append(model)


class Plugin:
    def __init__(self, family):
        self.family = family

    @hookimpl
    def compressor_add_model_families(self, registry):
        registry.add_model_family("torch", "mine", self.family)


@pytest.fixture
def family():
    fam = MyFamily()
    plugin = Plugin(fam)
    register_plugin(plugin, name="test-family")
    try:
        yield fam
    finally:
        unregister_plugin(plugin)


def test_builtin_hugging_face_family_is_declared_lazily():
    from compressor.torch.hf import FAMILY

    assert [f.name for f in registry().model_families("torch")] == ["huggingface"]
    assert families() == [FAMILY]
    assert registry().model_families("tf") == []


def test_a_plugged_family_decides_the_layout_and_sees_the_compression(family):
    model = Net()
    # output neuron j has |w| column sum j + 1: the filter pruner must rank the COLUMNS (out-first view)
    with torch.no_grad():
        model.proj.weight.copy_(torch.tensor([[1.0, 2.0, 3.0]] * 4) / 4)
    assert is_in_out_linear(model.proj)
    pruner = L1FilterPruner(model, [{"sparsity": 0.34, "op_types": ["InOut"]}])
    pruner.compress()
    mask = pruner.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(mask, np.array([[False, True, True]] * 4))
    assert family.compressed == [model]


def test_without_the_plugin_the_layer_is_not_a_linear():
    assert not is_in_out_linear(InOut(4, 3))
    with pytest.raises(ConfigError, match=r"layer .proj. \(InOut\) is not supported"):
        L1FilterPruner(Net(), [{"sparsity": 0.34, "op_types": ["InOut"]}]).compress()
