"""Every TF pruner on tiny hand-built Keras weights, with exact expected masks (Keras layouts)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from compressor.core.errors import ConfigError
from compressor.core.ops import NumpyOps
from compressor.core.pruning import level_mask
from compressor.tf import (
    ActivationAPoZRankFilterPruner,
    ActivationMeanRankFilterPruner,
    AGPPruner,
    FPGMPruner,
    L1FilterPruner,
    L2FilterPruner,
    LevelPruner,
    LotteryTicketPruner,
    SensitivityPruner,
    SlimPruner,
    TaylorFOWeightFilterPruner,
    TfPruner,
    WeightMasker,
)


def conv_model(filters=10, in_ch=2, k=3, use_bias=True):
    return keras.Sequential([keras.Input((5, 5, in_ch)), keras.layers.Conv2D(filters, k, use_bias=use_bias, name="conv")])


def kept_filters(wrapper):
    m = wrapper.weight_mask.numpy()
    return np.where(m.reshape(-1, m.shape[-1]).all(axis=0))[0].tolist()


def set_filters(layer, values):
    kh, kw, cin, _ = layer.kernel.shape
    layer.kernel.assign(np.stack([np.full((kh, kw, cin), v, np.float32) for v in values], axis=-1))


# ---------------------------------------------------------------- level
def test_level_prunes_k_smallest_exact():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc")])
    w = (np.arange(12, dtype=np.float32) - 5.5).reshape(4, 3)
    model.layers[0].kernel.assign(w)
    p = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Dense"]}])
    p.compress()
    mask = p.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(mask, np.abs(w) > 3)
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), np.where(np.abs(w) > 3, w, 0))
    assert p.get_modules_wrapper()[0].bias_mask.numpy().all()


def test_level_ties_broken_by_canonical_flat_index():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="fc")])
    model.layers[0].kernel.assign(np.ones((4, 3), np.float32))
    p = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}])
    p.compress()
    mask = p.get_modules_wrapper()[0].weight_mask.numpy()
    # canonical [out, in]: the first 6 flat entries are out 0 (all inputs) and out 1 (inputs 0, 1)
    expected = np.ones((4, 3), bool)
    expected[:, 0] = False
    expected[:2, 1] = False
    np.testing.assert_array_equal(mask, expected)
    canon = level_mask(NumpyOps(), np.ones((3, 4), np.float32), 0.5)
    np.testing.assert_array_equal(mask, canon.T)


def test_level_conv_matches_core_on_canonical_layout():
    model = conv_model(6, 3)
    k = np.random.default_rng(1).standard_normal((3, 3, 3, 6)).astype(np.float32)
    model.layers[0].kernel.assign(k)
    p = LevelPruner(model, [{"sparsity": 0.37, "op_types": ["default"]}])
    p.compress()
    expected = level_mask(NumpyOps(), k.transpose(3, 2, 0, 1), 0.37).transpose(2, 3, 1, 0)
    np.testing.assert_array_equal(p.get_modules_wrapper()[0].weight_mask.numpy(), expected)
    assert int((~expected).sum()) == int(np.floor(162 * 0.37))


# ---------------------------------------------------------------- filters
def test_fpgm_prunes_the_two_middle_filters():
    model = conv_model()
    set_filters(model.layers[0], range(1, 11))
    p = FPGMPruner(model, [{"sparsity": 0.2, "op_types": ["Conv2D"]}])
    p.compress()
    w = p.get_modules_wrapper()[0]
    assert kept_filters(w) == [0, 1, 2, 3, 6, 7, 8, 9]
    np.testing.assert_array_equal(w.bias_mask.numpy(), [i not in (4, 5) for i in range(10)])
    assert not model.layers[0].kernel.numpy()[..., 4:6].any()


@pytest.mark.parametrize("cls", [L1FilterPruner, L2FilterPruner])
def test_l1_l2_keep_largest_filters_and_mask_bias(cls):
    model = conv_model()
    set_filters(model.layers[0], range(10))
    model.layers[0].bias.assign(np.arange(1, 11, dtype=np.float32))
    p = cls(model, [{"sparsity": 0.6, "op_types": ["Conv2D"]}])
    p.compress()
    w = p.get_modules_wrapper()[0]
    assert kept_filters(w) == [6, 7, 8, 9]
    np.testing.assert_array_equal(model.layers[0].bias.numpy(), [0, 0, 0, 0, 0, 0, 7, 8, 9, 10])


def test_filter_pruner_default_types_is_conv2d_only():
    model = keras.Sequential([keras.Input((5, 5, 2)), keras.layers.Conv2D(4, 3, name="conv"),
                              keras.layers.Flatten(), keras.layers.Dense(3, name="fc")])
    p = L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    assert [w.name for w in p.get_modules_wrapper()] == ["conv"]


# ---------------------------------------------------------------- slim
def two_bn_model():
    inp = keras.Input((5,))
    a = keras.layers.BatchNormalization(name="bn1")(inp)
    b = keras.layers.BatchNormalization(name="bn2")(inp)
    return keras.Model(inp, keras.layers.Concatenate()([a, b]))


def test_slim_global_threshold_prunes_index_zero_of_each():
    model = two_bn_model()
    bn1, bn2 = model.get_layer("bn1"), model.get_layer("bn2")
    bn1.gamma.assign(np.arange(5, dtype=np.float32))
    bn2.gamma.assign(-np.arange(5, dtype=np.float32))
    bn1.beta.assign(np.ones(5, np.float32))
    p = SlimPruner(model, [{"sparsity": 0.2, "op_types": ["BatchNormalization"]}])
    p.compress()
    for w in p.get_modules_wrapper():
        np.testing.assert_array_equal(w.weight_mask.numpy(), [False, True, True, True, True])
        np.testing.assert_array_equal(w.bias_mask.numpy(), [False, True, True, True, True])
    np.testing.assert_array_equal(bn1.beta.numpy(), [0, 1, 1, 1, 1])
    out = model.predict(np.ones((2, 5), np.float32), verbose=0)
    assert out[:, 0].tolist() == [0.0, 0.0] and out[:, 5].tolist() == [0.0, 0.0]


def test_slim_entries_must_agree():
    with pytest.raises(ConfigError, match="one global threshold"):
        SlimPruner(two_bn_model(), [{"sparsity": 0.2, "op_names": ["bn1"]}, {"sparsity": 0.3, "op_names": ["bn2"]}])


def test_slim_l1_penalty():
    model = two_bn_model()
    model.get_layer("bn1").gamma.assign(np.arange(5, dtype=np.float32))
    p = SlimPruner(model, [{"sparsity": 0.2, "op_types": ["BatchNormalization"]}])
    np.testing.assert_allclose(float(p.l1_penalty(0.5)), 0.5 * (10 + 5), rtol=1e-6)


# ---------------------------------------------------------------- sensitivity (Han et al.)
def test_sensitivity_threshold_is_q_times_std_and_iterates():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, name="fc")])
    w = np.array([[0.1, -0.2, 1.0, -2.0], [0.05, 0.5, -0.8, 3.0]], np.float32)
    model.layers[0].kernel.assign(w)
    p = SensitivityPruner(model, [{"sensitivity": 0.5, "op_types": ["Dense"]}])
    p.compress()
    m1 = p.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(m1, np.abs(w) >= 0.5 * w.std())
    p.prune_iteration()  # std of the kept weights: prunes further, monotone
    kept = w[m1]
    m2 = p.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(m2, m1 & (np.abs(w) >= 0.5 * kept.std()))
    assert p.iteration == 2


def test_sensitivity_refuses_sparsity():
    with pytest.raises(ConfigError, match="sensitivity"):
        SensitivityPruner(conv_model(), [{"sparsity": 0.5, "sensitivity": 1.0, "op_types": ["default"]}])


# ---------------------------------------------------------------- AGP
def test_agp_masks_change_only_on_schedule_epochs():
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, name="fc")])
    model.layers[0].kernel.assign(np.random.default_rng(0).permutation(100).reshape(10, 10).astype(np.float32) + 1)
    p = AGPPruner(model, [{"initial_sparsity": 0.1, "final_sparsity": 0.8, "start_epoch": 0, "end_epoch": 6,
                           "frequency": 2, "op_types": ["default"]}])
    p.compress()
    w = p.get_modules_wrapper()[0]
    pruned = []
    for epoch in range(7):
        p.update_epoch(epoch)
        pruned.append(int((~w.weight_mask.numpy()).sum()))
    # span = ((6 - 0 - 1) // 2) * 2 = 4: updates at epochs 0, 2, 4; s(2) = 0.8 - 0.7 * 0.5 ** 3 = 0.7125
    assert pruned == [10, 10, 71, 71, 80, 80, 80]
    assert p.target_sparsity(0, 2) == pytest.approx(0.7125)
    # monotone and exactly the smallest magnitudes
    k = model.layers[0].kernel.numpy()
    assert (k[~w.weight_mask.numpy()] == 0).all()


def test_agp_values_of_the_reference():
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, name="fc")])
    p = AGPPruner(model, [{"final_sparsity": 0.8, "end_epoch": 10, "op_types": ["default"]}])
    got = [round(p.target_sparsity(0, e), 4) for e in range(10)]
    assert got == [0.0, 0.2381, 0.4236, 0.563, 0.6628, 0.7298, 0.7704, 0.7912, 0.7989, 0.8]


@pytest.mark.filterwarnings("ignore::compressor.core.errors.ConfigWarning")
def test_agp_bad_algorithm_untouched():
    model = conv_model()
    with pytest.raises(ConfigError, match="pruning_algorithm"):
        AGPPruner(model, [{"final_sparsity": 0.5, "op_types": ["default"]}], pruning_algorithm="magic")
    assert "call" not in vars(model.layers[0])


# ---------------------------------------------------------------- data-driven: activations, Taylor
def one_by_one(kernel_values, use_bias=False):
    model = keras.Sequential([keras.Input((2, 2, 1)), keras.layers.Conv2D(len(kernel_values), 1, use_bias=use_bias,
                                                                          name="conv"), keras.layers.Flatten()])
    model.layers[0].kernel.assign(np.array(kernel_values, np.float32).reshape(1, 1, 1, -1))
    return model


@pytest.mark.parametrize("cls, expected", [
    (ActivationAPoZRankFilterPruner, [1, 3]),  # relu out [1, 2, 0, .5]: APoZ importance [1, 1, 0, 1]
    (ActivationMeanRankFilterPruner, [0, 1]),  # mean activation [1, 2, 0, .5]
])
def test_activation_rank_pruners_from_fit(cls, expected):
    model = one_by_one([1.0, 2.0, -3.0, 0.5])
    opt = keras.optimizers.SGD(0.0)
    model.compile(opt, "mse")
    p = cls(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt, statistics_batch_num=2)
    p.compress()
    w = p.get_modules_wrapper()[0]
    assert kept_filters(w) == [0, 1, 2, 3]  # no statistics yet
    model.fit(np.ones((3, 2, 2, 1), np.float32), np.zeros((3, 16), np.float32), batch_size=1, epochs=1, verbose=0)
    assert int(w.act_batches.numpy()) == 2  # stopped adding after statistics_batch_num batches
    np.testing.assert_allclose(w.act_count.numpy(), [8, 8, 8, 8])
    np.testing.assert_allclose(w.act_zeros.numpy(), [0, 0, 8, 0])
    assert kept_filters(w) == expected
    p.update_epoch(1)  # eager sync: all layers done -> the collector is removed
    assert p.masker._collector_id is None and p._calculated == {0}


def test_activation_relu6():
    model = one_by_one([10.0, 2.0, -3.0, 7.0])
    opt = keras.optimizers.SGD(0.0)
    model.compile(opt, "mse")
    p = ActivationMeanRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt, activation="relu6")
    p.compress()
    model.fit(np.ones((1, 2, 2, 1), np.float32), np.zeros((1, 16), np.float32), verbose=0)
    np.testing.assert_allclose(p.get_modules_wrapper()[0].act_total.numpy(), [24, 8, 0, 24])
    assert kept_filters(p.get_modules_wrapper()[0]) == [0, 3]


def test_taylor_fo_from_gradients_in_custom_loop():
    model = one_by_one([1.0, -3.0, 2.0, 0.5])
    opt = keras.optimizers.SGD(0.0)
    p = TaylorFOWeightFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt, statistics_batch_num=2)
    p.compress()

    @tf.function
    def train(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(model(x, training=True))
        opt.apply_gradients(zip(tape.gradient(loss, model.trainable_variables), model.trainable_variables))

    x = np.ones((1, 2, 2, 1), np.float32)
    for _ in range(3):
        train(x)
    w = p.get_modules_wrapper()[0]
    # dL/dw_f = 4 (four positions of input 1): per batch (4 w_f)^2; two batches counted
    np.testing.assert_allclose(w.taylor_contribution.numpy(), [32, 288, 128, 8])
    assert int(w.taylor_batches.numpy()) == 2
    assert kept_filters(w) == [1, 2]
    np.testing.assert_array_equal(model.layers[0].kernel.numpy().ravel(), [0, -3, 2, 0])


# ---------------------------------------------------------------- lottery ticket
def test_lottery_rounds_rewind_weights_and_optimizer():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((10,)), keras.layers.Dense(10, name="fc")])
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, "mse")
    p = LotteryTicketPruner(model, [{"sparsity": 0.75, "prune_iterations": 2, "op_types": ["default"]}], opt)
    k0 = model.layers[0].kernel.numpy().copy()
    assert list(p.get_prune_iterations()) == [0, 1, 2]
    x = np.random.default_rng(0).random((16, 10), dtype=np.float32)
    pruned = []
    for _ in p.get_prune_iterations():
        p.prune_iteration_start()
        mask = p.get_modules_wrapper()[0].weight_mask.numpy()
        pruned.append(int((~mask).sum()))
        k = model.layers[0].kernel.numpy()
        np.testing.assert_array_equal(k, np.where(mask, k0, 0))  # rewound to the initial weights
        assert int(opt.iterations.numpy()) == 0
        assert all(not v.numpy().any() for v in opt.variables if "momentum" in v.path)
        model.fit(x, x, epochs=1, batch_size=8, verbose=0)
        assert (model.layers[0].kernel.numpy()[~mask] == 0).all()
    assert pruned == [0, 50, 75]  # keep ratio 0.5 per round
    with pytest.raises(RuntimeError, match="rounds are done"):
        p.prune_iteration_start()


# ---------------------------------------------------------------- a custom algorithm, seed 003 style
class MyMasker(WeightMasker):
    def calc_mask(self, sparsity, wrapper, wrapper_idx=None):
        return {"weight_mask": tf.abs(wrapper.weight) > sparsity}


class MyPruner(TfPruner):
    def __init__(self, model, config_list, optimizer=None):
        super().__init__(model, config_list, optimizer)
        self.set_wrappers_attribute("if_calculated", False)
        self.masker = MyMasker(model, self)

    def calc_mask(self, wrapper, wrapper_idx=None):
        sparsity = wrapper.config["sparsity"]
        if wrapper.if_calculated:
            return None
        masks = self.masker.calc_mask(sparsity=sparsity, wrapper=wrapper, wrapper_idx=wrapper_idx)
        wrapper.if_calculated = True
        return masks


def test_custom_pruner_seed_style_runs_in_fit():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4, name="fc")])
    w0 = np.array([[0.1, 0.9, -0.2, 0.6]] * 4, np.float32)
    model.layers[0].kernel.assign(w0)
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, "mse")
    pruner = MyPruner(model, [{"sparsity": 0.5, "op_types": ["Dense"]}], opt)
    model = pruner.compress()
    model.fit(np.ones((8, 4), np.float32), np.ones((8, 4), np.float32), epochs=2, batch_size=4, verbose=0)
    mask = pruner.get_modules_wrapper()[0].weight_mask.numpy()
    np.testing.assert_array_equal(mask, np.abs(w0) > 0.5)
    assert (model.layers[0].kernel.numpy()[~mask] == 0).all()
    assert (model.layers[0].kernel.numpy()[mask] != w0[mask]).all()  # trained
