"""Dependency-aware AGP on torch: on every schedule epoch coupled layers (and their norms) get one
decision at the epoch's target, exactly floor(C * s) channels per group, monotone across epochs; the
final masked model equals its speedup; 'level' is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compressor.torch as cth
from compressor.core.agp import agp_target
from compressor.core.errors import ConfigError, ConfigWarning
from compressor.core.pruning import prune_count
from compressor.torch.pruning.agp import AGPPruner
from tests.torch.test_dependency import X, kept, make

pytestmark = pytest.mark.torch

CONFIG = [{"final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 4, "frequency": 1, "op_types": ["Conv2d"]}]
GROUPS = {("stem", "conv2", "bn2"): 6, ("conv1", "bn1"): 4, ("head",): 5}


def run(algo, epochs=5, seed=0):
    m = make(seed)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    p = AGPPruner(m, CONFIG, opt, pruning_algorithm=algo, dependency_aware=True, dummy_input=X)
    p.compress()
    history = []
    for epoch in range(epochs):
        p.update_epoch(epoch)
        for _ in range(2):
            opt.zero_grad()
            m(torch.randn(4, 3, 8, 8)).square().mean().backward()
            opt.step()
        history.append({w.name: kept(p, w.name).clone() for w in p.get_modules_wrapper()})
    return m, p, history


@pytest.mark.parametrize("algo", ["l1", "fpgm", "taylorfo"])
def test_groups_pruned_together_at_each_schedule_epoch(algo):
    m, p, history = run(algo)
    assert sorted(w.name for w in p.get_modules_wrapper()) == ["bn1", "bn2", "conv1", "conv2", "head", "stem"]
    for epoch, keeps in enumerate(history):
        s = agp_target(CONFIG[0], epoch)
        for layers, channels in GROUPS.items():
            for layer in layers[1:]:
                assert torch.equal(keeps[layer], keeps[layers[0]]), (epoch, layer)
            assert int((~keeps[layers[0]]).sum()) == prune_count(channels, s), (epoch, layers)
        if epoch:
            for name, k in keeps.items():  # monotone: nothing pruned comes back
                assert not (k & ~history[epoch - 1][name]).any(), (epoch, name)
    # the final model: the masked channels are dead, speedup removes them with the same outputs
    wrappers = {w.name: w for w in p.get_modules_wrapper()}
    assert torch.equal(wrappers["bn2"].bias_mask, history[-1]["bn2"])
    m.eval()
    with torch.no_grad():
        ref = m(X)
    small = cth.speedup_model(p, X)
    assert (small.stem.out_channels, small.conv1.out_channels, small.conv2.out_channels, small.head.out_channels) \
        == (2, 1, 2, 2)
    with torch.no_grad():
        out = small(X)
    assert (out - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_slim_ranks_the_groups_globally():
    m = make(3)
    config = [{"final_sparsity": 0.5, "end_epoch": 2, "op_types": ["BatchNorm2d"]}]
    with pytest.warns(ConfigWarning, match=r"bn2: 6 of 6 channels never pruned \(6: layer 'stem' \(Conv2d\) shares them "
                                           r"but is not selected"):
        p = AGPPruner(m, config, pruning_algorithm="slim", dependency_aware=True, dummy_input=X)
    p.compress()
    for epoch in range(3):
        p.update_epoch(epoch)
    assert sorted(w.name for w in p.get_modules_wrapper()) == ["bn1", "bn2"]
    # bn2's channels meet the unselected stem at the add: masking bn2 alone leaves them nonzero there, so speedup
    # could not remove them and they are not chosen; the one global threshold prunes floor(4 * 0.5) of bn1's
    assert int((~kept(p, "bn1")).sum()) == 2 and int((~kept(p, "bn2")).sum()) == 0


def test_level_and_bad_arguments_are_refused():
    m = make()
    with pytest.raises(ConfigError, match="filter criterion"):
        AGPPruner(m, CONFIG, pruning_algorithm="level", dependency_aware=True, dummy_input=X)
    with pytest.raises(ConfigError, match="needs dummy_input"):
        AGPPruner(m, CONFIG, pruning_algorithm="l1", dependency_aware=True)
    with pytest.raises(ConfigError, match="True or False"):
        AGPPruner(m, CONFIG, pruning_algorithm="l1", dependency_aware=1, dummy_input=X)
    assert type(m.stem) is nn.Conv2d
