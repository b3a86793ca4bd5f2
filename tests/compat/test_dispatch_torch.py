"""``compressor.<Algorithm>(torch_model, ...)`` builds the PyTorch class and never imports tensorflow."""

import pytest
import torch
from torch import nn

import compressor
from compressor.core.algorithms import PRUNERS, QUANTIZERS
from tests.core.test_imports import loaded_after


def test_dispatch_and_prototype_shim_leave_tensorflow_unimported():
    stmt = (
        "import compressor, torch, compressor.torchCompressor\n"
        "m = torch.nn.Sequential(torch.nn.Linear(4, 4))\n"
        "p = compressor.LevelPruner(m, [{'sparsity': 0.5, 'op_types': ['default']}])\n"
        "assert type(p).__module__.startswith('compressor.torch.'), type(p)\n"
        "p.compress()\n"
        "assert int((m[0].module.weight == 0).sum()) == 8\n"
        "q = compressor.DoReFaQuantizer(torch.nn.Sequential(torch.nn.Linear(2, 2)),"
        " [{'quant_types': ['weight'], 'quant_bits': 2, 'op_types': ['default']}])\n"
        "assert type(q).__module__.startswith('compressor.torch.'), type(q)"
    )
    assert loaded_after(stmt) == {"torch"}


@pytest.mark.parametrize("name", PRUNERS + QUANTIZERS)
def test_every_algorithm_name_dispatches_to_the_torch_class(name):
    """An unknown key is refused by the class that was built, which names itself in the message."""
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2), nn.Flatten(), nn.Linear(2, 2))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(compressor.ConfigError, match=rf"unknown key 'bogus_key'.*{name} accepts"):
        getattr(compressor, name)(model, [{"op_types": ["default"], "bogus_key": 1}])
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert compressor.core.registry.registry().get("torch", name) is getattr(compressor.torch, name)


def test_available_lists_every_torch_algorithm():
    avail = compressor.available()["torch"]
    assert set(avail["pruners"]) >= set(PRUNERS) and set(avail["quantizers"]) >= set(QUANTIZERS)
