"""Keras 3: N:M pruning (LevelPruner / AGPPruner with ``sparse_pattern``) and the compressed model file
(``export_model(..., compressed_path=...)``, ``load_compressed``)."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import compressor
from compressor.core.errors import CompressedFileError, ConfigError
from compressor.core.ops import NumpyOps
from compressor.core.pruning import nm_mask
from compressor.tf import AGPPruner, FPGMPruner, LevelPruner, PruningCallback, load_compressed
from compressor.tf.cmpk import model_arrays

RNG = np.random.default_rng(0)
X = RNG.random((16, 6, 6, 4), dtype=np.float32)
Y = RNG.integers(0, 6, 16)


def net(seed=0, out=6, name="net"):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([keras.Input((6, 6, 4)), keras.layers.Conv2D(8, 3, name="conv"),
                             keras.layers.BatchNormalization(name="bn"), keras.layers.ReLU(), keras.layers.Flatten(),
                             keras.layers.Dense(16, name="fc1"), keras.layers.ReLU(),
                             keras.layers.Dense(out, name="fc2")], name=name)


def canonical(mask):
    m = np.asarray(mask)
    return m.transpose(3, 2, 0, 1) if m.ndim == 4 else m.T


def two_of_four(mask_keras):
    g = np.moveaxis(canonical(mask_keras), 1, -1).reshape(-1, 4)
    return bool((g.sum(axis=1) == 2).all())


def test_level_two_of_four_masks_equal_core_and_survive_fit():
    model = net()
    conv_w = canonical(model.get_layer("conv").kernel.numpy())
    opt = keras.optimizers.SGD(0.1, momentum=0.9)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_names": ["conv", "fc1"]}], opt)
    pruner.compress()
    wrappers = {w.name: w for w in pruner.get_modules_wrapper()}
    np.testing.assert_array_equal(canonical(wrappers["conv"].weight_mask.numpy()), nm_mask(NumpyOps(), conv_w, 2, 4))
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[PruningCallback(pruner)])
    for name in ("conv", "fc1"):
        assert two_of_four(wrappers[name].weight_mask.numpy())
        assert two_of_four(model.get_layer(name).kernel.numpy() != 0)


@pytest.mark.parametrize("config, match", [
    ([{"sparse_pattern": "2:4", "sparsity": 0.3, "op_names": ["fc1"]}], "contradicts"),
    ([{"sparse_pattern": "4:8", "op_names": ["fc2"]}], r"layer 'fc2' \(Dense\) has input dimension 20 .*M=8"),
    ([{"sparse_pattern": "2:4", "op_names": ["bn"]}], r"'bn' \(BatchNormalization\) cannot take sparse_pattern"),
    ([{"sparse_pattern": "1:1", "op_names": ["fc1"]}], "1 <= N < M"),
])
def test_bad_sparse_pattern_is_refused_before_the_model_changes(config, match):
    model = keras.Sequential([keras.Input((20,)), keras.layers.BatchNormalization(name="bn"),
                              keras.layers.Dense(20, name="fc1"), keras.layers.Dense(3, name="fc2")])
    before = [w.numpy().copy() for w in model.weights]
    with pytest.raises(ConfigError, match=match):
        LevelPruner(model, config)
    assert not any(hasattr(layer, "_compressor_pruner") for layer in model.layers)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, model.weights))


def test_agp_ramps_to_exact_two_of_four():
    model = net()
    pruner = AGPPruner(model, [{"sparse_pattern": "2:4", "op_names": ["fc1"], "start_epoch": 0, "end_epoch": 3}])
    pruner.compress()
    w = pruner.get_modules_wrapper()[0]
    pruned = []
    for epoch in range(5):
        pruner.update_epoch(epoch)
        m = w.weight_mask.numpy()
        pruned.append(int((~m).sum()))
        assert (np.moveaxis(canonical(m), 1, -1).reshape(-1, 4).sum(axis=1) >= 2).all()
    assert pruned == sorted(pruned) and pruned[0] == 0 and pruned[-1] == 128 * 16 // 2
    assert two_of_four(w.weight_mask.numpy())


@pytest.mark.parametrize("make", [
    lambda m, o: LevelPruner(m, [{"sparsity": 0.8, "op_types": ["default"]}], o),
    lambda m, o: LevelPruner(m, [{"sparse_pattern": "2:4", "op_names": ["conv", "fc1"]}], o),
    lambda m, o: FPGMPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], o),
    lambda m, o: AGPPruner(m, [{"final_sparsity": 0.6, "op_types": ["default"], "end_epoch": 1}], o),
], ids=["level", "2:4", "fpgm", "agp"])
def test_compressed_export_is_the_keras_file_bit_for_bit(tmp_path, make):
    model = net()
    opt = keras.optimizers.Adam(1e-2)
    model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pruner = make(model, opt)
    pruner.compress()
    model.fit(X, Y, epochs=1, batch_size=8, verbose=0, callbacks=[PruningCallback(pruner)])
    pruner.export_model(str(tmp_path / "m.keras"), compressed_path=str(tmp_path / "m.cmpk"))
    saved = keras.models.load_model(tmp_path / "m.keras", compile=False)
    unpacked = compressor.unpack(tmp_path / "m.cmpk")
    want = model_arrays(saved)
    assert list(unpacked) == list(want) and "bn/moving_mean" in want and "fc1/kernel" in want
    for k, v in want.items():
        assert unpacked[k].dtype == v.dtype and unpacked[k].tobytes() == v.tobytes(), k
    fresh = load_compressed(net(seed=1), tmp_path / "m.cmpk")
    np.testing.assert_array_equal(fresh.predict(X, verbose=0), saved.predict(X, verbose=0))
    # a model built under another name (Keras numbers unnamed models) matches too: names are below the model
    renamed = load_compressed(net(seed=2, name="other"), tmp_path / "m.cmpk")
    np.testing.assert_array_equal(renamed.predict(X, verbose=0), saved.predict(X, verbose=0))


def test_bad_file_or_wrong_model_leaves_the_model_untouched(tmp_path):
    model = net()
    pruner = LevelPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}])
    pruner.compress()
    pruner.export_model(compressed_path=str(tmp_path / "m.cmpk"))
    data = (tmp_path / "m.cmpk").read_bytes()
    (tmp_path / "bad.cmpk").write_bytes(data[:40] + bytes([data[40] ^ 1]) + data[41:])
    for target, path, match in ((net(seed=3), "bad.cmpk", "checksum"),
                                (net(seed=3, out=7), "m.cmpk", r"'fc2/kernel' has shape \(16, 6\)")):
        before = [w.numpy().copy() for w in target.weights]
        with pytest.raises(CompressedFileError, match=match):
            load_compressed(target, tmp_path / path)
        assert all(np.array_equal(a, w.numpy()) for a, w in zip(before, target.weights))


def test_names_are_layer_paths_the_same_on_a_built_and_a_reloaded_nested_model(tmp_path):
    inp = keras.Input((4,))
    inner = keras.Sequential([keras.layers.Dense(3, name="a")], name="blk")
    model = keras.Model(inp, keras.layers.Dense(2, name="b")(inner(inp)), name="fun")
    model.save(tmp_path / "f.keras")
    names = ["blk/a/kernel", "blk/a/bias", "b/kernel", "b/bias"]
    assert list(model_arrays(model)) == names
    assert list(model_arrays(keras.models.load_model(tmp_path / "f.keras"))) == names  # Keras' own paths differ


def test_cli_pack_unpack_keras(tmp_path, capsys):
    from compressor.app.cli import main

    model = net()
    LevelPruner(model, [{"sparsity": 0.9, "op_types": ["default"]}]).compress()
    model.save(tmp_path / "m.keras")
    assert main(["pack", str(tmp_path / "m.keras"), str(tmp_path / "m.cmpk"), "--codec", "huffman"]) == 0
    assert "smaller" in capsys.readouterr().out
    assert main(["unpack", str(tmp_path / "m.cmpk"), str(tmp_path / "back.keras"), "--model",
                 str(tmp_path / "m.keras")]) == 0
    back = keras.models.load_model(tmp_path / "back.keras", compile=False)
    want = model_arrays(keras.models.load_model(tmp_path / "m.keras", compile=False))
    got = model_arrays(back)
    assert list(got) == list(want) and all(got[k].tobytes() == want[k].tobytes() for k in want)


# ------------------------------------------------------------------------------------------ weight sharing
def sparse_mlp(seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu", name="fc1"),
                              keras.layers.Dense(4, name="fc2")])
    k = model.get_layer("fc1").kernel
    k.assign(np.where(np.abs(k.numpy()) < 0.1, 0, k.numpy()))
    return model


def test_weight_sharing_sums_member_gradients_and_keeps_clusters_tied_through_fit(tmp_path):
    import tensorflow as tf

    from compressor.tf import WeightSharingQuantizer

    model = sparse_mlp()
    pruned = model.get_layer("fc1").kernel.numpy() == 0
    x = RNG.random((64, 20), dtype=np.float32)
    y = RNG.integers(0, 4, 64)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    sharer = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 3, "op_types": ["Dense"]}])
    model = sharer.compress()
    w = sharer.get_modules_wrapper()[0]
    a, k = w.ws_assignment.numpy(), w.ws_k
    plain = sparse_mlp()
    for v, p in zip(model.weights, plain.weights):
        p.assign(v)
    with tf.GradientTape(persistent=True) as tape:
        shared_loss, plain_loss = loss(y, model(x)), loss(y, plain(x))
    g = tape.gradient(shared_loss, model.get_layer("fc1").kernel).numpy()
    g0 = tape.gradient(plain_loss, plain.get_layer("fc1").kernel).numpy()
    for c in range(k):
        np.testing.assert_allclose(g[a == c], g0[a == c].sum(), rtol=1e-5, atol=1e-6)
    assert (g[a == k] == 0).all()
    model.compile(keras.optimizers.Adam(1e-2), loss)
    model.fit(x, y, epochs=2, batch_size=16, verbose=0)
    kernel = model.get_layer("fc1").kernel.numpy()
    for c in range(k):
        assert np.unique(kernel[a == c]).size == 1
    assert (kernel[pruned] == 0).all()
    books = sharer.export_model(str(tmp_path / "m.keras"), compressed_path=str(tmp_path / "m.cmpk"))
    saved = model_arrays(keras.models.load_model(tmp_path / "m.keras", compile=False))
    unpacked = compressor.unpack(tmp_path / "m.cmpk")
    assert list(unpacked) == list(saved) and all(unpacked[n].tobytes() == saved[n].tobytes() for n in saved)
    assert books["fc1"].size <= 8


def test_weight_sharing_export_to_one_file_twice_names_the_arguments(tmp_path):
    from compressor.tf import WeightSharingQuantizer

    model = sparse_mlp()
    sharer = WeightSharingQuantizer(model, [{"quant_types": ["weight"], "quant_bits": 2, "op_types": ["Dense"]}])
    sharer.compress()
    before = [v.numpy().copy() for v in model.weights]
    (tmp_path / "m.keras").write_bytes(b"old")
    with pytest.raises(ConfigError, match=r"model_path and compressed_path are the same file .*m\.keras"):
        sharer.export_model(str(tmp_path / "m.keras"), compressed_path=str(tmp_path / "m.keras"))
    assert (tmp_path / "m.keras").read_bytes() == b"old" and sorted(p.name for p in tmp_path.iterdir()) == ["m.keras"]
    after = [v.numpy() for v in model.weights]  # refused before tie() moved any weight to its centroid
    assert len(after) == len(before) and all(np.array_equal(a, b) for a, b in zip(after, before))
