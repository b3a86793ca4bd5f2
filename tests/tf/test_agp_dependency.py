"""Dependency-aware AGP on Keras: on every schedule epoch coupled layers (and their BatchNorms) get one
decision at the epoch's target, exactly floor(C * s) channels per group, monotone across epochs; weight
criteria eagerly at update_epoch, data criteria in-graph inside fit; the final masked model equals its
speedup; 'level' is refused."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import compressor.tf as ctf
from compressor.core.agp import agp_target
from compressor.core.errors import ConfigError, ConfigWarning
from compressor.core.pruning import prune_count
from compressor.tf.pruning.agp import AGPPruner
from tests.tf.test_dependency import block, kept

pytestmark = pytest.mark.tf

CONFIG = [{"final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 4, "frequency": 1, "op_types": ["Conv2D"]}]
GROUPS = {("stem", "conv2", "bn2"): 6, ("conv1", "bn1"): 4, ("head",): 5}


@pytest.mark.parametrize("algo", ["l1", "taylorfo"])
def test_groups_pruned_together_at_each_schedule_epoch(algo):
    model = block(1)
    opt = keras.optimizers.SGD(0.05)
    model.compile(opt, "mse")
    p = AGPPruner(model, CONFIG, opt, pruning_algorithm=algo, dependency_aware=True)
    p.compress()
    assert sorted(w.name for w in p.get_modules_wrapper()) == ["bn1", "bn2", "conv1", "conv2", "head", "stem"]
    rng = np.random.default_rng(2)
    x, y = rng.standard_normal((4, 8, 8, 3)).astype("float32"), rng.standard_normal((4, 2)).astype("float32")
    history = []
    for epoch in range(5):
        p.update_epoch(epoch)
        model.fit(x, y, batch_size=2, epochs=1, verbose=0)
        p.sync()
        history.append({w.name: kept(p, w.name).copy() for w in p.get_modules_wrapper()})
    for epoch, keeps in enumerate(history):
        s = agp_target(CONFIG[0], epoch)
        for layers, channels in GROUPS.items():
            for layer in layers[1:]:
                np.testing.assert_array_equal(keeps[layer], keeps[layers[0]], err_msg=f"{epoch} {layer}")
            assert int((~keeps[layers[0]]).sum()) == prune_count(channels, s), (epoch, layers)
        if epoch:
            for name, k in keeps.items():
                assert not (k & ~history[epoch - 1][name]).any(), (epoch, name)
    assert not p._pending
    xs = rng.standard_normal((2, 8, 8, 3)).astype("float32")
    ref = np.asarray(model(xs, training=False))
    small = ctf.speedup_model(p)
    assert [small.get_layer(n).filters for n in ("stem", "conv1", "conv2", "head")] == [2, 1, 2, 2]
    out = np.asarray(small(xs, training=False))
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_slim_ranks_the_groups_globally():
    model = block(3)
    with pytest.warns(ConfigWarning, match=r"bn2: 6 of 6 channels never pruned \(6: layer 'stem' \(Conv2D\) shares them "
                                           r"but is not selected"):
        p = AGPPruner(model, [{"final_sparsity": 0.5, "end_epoch": 2, "op_types": ["BatchNormalization"]}],
                      pruning_algorithm="slim", dependency_aware=True)
    p.compress()
    for epoch in range(3):
        p.update_epoch(epoch)
    assert sorted(w.name for w in p.get_modules_wrapper()) == ["bn1", "bn2"]
    # as on torch: bn2's channels meet the unselected stem at the add, so speedup could not remove them and
    # they are not chosen; the one global threshold prunes floor(4 * 0.5) of bn1's
    assert int((~kept(p, "bn1")).sum()) == 2 and int((~kept(p, "bn2")).sum()) == 0


def test_level_and_bad_arguments_are_refused():
    model = block()
    with pytest.raises(ConfigError, match="filter criterion"):
        AGPPruner(model, CONFIG, pruning_algorithm="level", dependency_aware=True)
    with pytest.raises(ConfigError, match="True or False"):
        AGPPruner(model, CONFIG, pruning_algorithm="l1", dependency_aware="yes")
    assert not any(k.startswith("_compressor_") for layer in model.layers for k in vars(layer))
