"""``compressor.<Algorithm>(keras_model, ...)`` builds the TF / Keras class and never imports torch."""

import keras
import pytest

import compressor
from compressor.core.algorithms import PRUNERS, QUANTIZERS
from tests.core.test_imports import loaded_after


def test_dispatch_and_prototype_shim_leave_torch_unimported():
    stmt = (
        "import compressor, keras, compressor.tfCompressor\n"
        "m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])\n"
        "p = compressor.LevelPruner(m, [{'sparsity': 0.5, 'op_types': ['default']}])\n"
        "assert type(p).__module__.startswith('compressor.tf.'), type(p)\n"
        "p.compress()\n"
        "assert int((m.layers[0].kernel.numpy() == 0).sum()) == 8\n"
        "q = compressor.DoReFaQuantizer(keras.Sequential([keras.Input((2,)), keras.layers.Dense(2)]),"
        " [{'quant_types': ['weight'], 'quant_bits': 2, 'op_types': ['default']}])\n"
        "assert type(q).__module__.startswith('compressor.tf.'), type(q)"
    )
    assert "torch" not in loaded_after(stmt)


@pytest.mark.parametrize("name", PRUNERS + QUANTIZERS)
def test_every_algorithm_name_dispatches_to_the_tf_class(name):
    model = keras.Sequential([keras.Input((5, 5, 1)), keras.layers.Conv2D(2, 3), keras.layers.BatchNormalization(),
                              keras.layers.Flatten(), keras.layers.Dense(2)])
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(compressor.ConfigError, match=rf"unknown key 'bogus_key'.*{name} accepts"):
        getattr(compressor, name)(model, [{"op_types": ["default"], "bogus_key": 1}])
    assert all((a == b).all() for a, b in zip(before, model.get_weights()))
    assert compressor.core.registry.registry().get("tf", name) is getattr(compressor.tf, name)


def test_available_lists_every_tf_algorithm():
    avail = compressor.available()["tf"]
    assert set(avail["pruners"]) >= set(PRUNERS) and set(avail["quantizers"]) >= set(QUANTIZERS)
