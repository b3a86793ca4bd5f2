"""tf.distribute.MirroredStrategy over 2 logical CPU devices: wrap inside ``strategy.scope()``, ``fit``.

Logical devices must be configured before TensorFlow initialises its devices, so the strategy runs in a
subprocess (the rest of the test session keeps its single CPU device). In it, each algorithm trains the
same model twice from the same initialisation on the same data: under MirroredStrategy (global batch 8,
4 rows per replica) and on one device (batch 8). Keras sums the replicas' gradients of the loss scaled by
1 / replicas, i.e. applies the global batch's gradient, so both runs take the same steps (up to float
summation order); the compressors reduce their data statistics over the replicas, so both runs also pick
the same masks and scales. Every replica must hold bit-identical state, also when the compressor is
built outside ``strategy.scope()`` (its state is created mirrored like the model's weights).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap

import numpy as np
import pytest

ALGOS = ("agp", "taylorfo", "apoz", "qat", "lsq")

WORKER = textwrap.dedent('''
    import os, pickle, sys
    import tensorflow as tf
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    import keras
    import numpy as np
    from compressor.tf import (AGPPruner, ActivationAPoZRankFilterPruner, CompressionCallback, LsqQuantizer,
                               QAT_Quantizer, TaylorFOWeightFilterPruner)
    from compressor.tf.distributed import replica_values, unsynchronized

    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 8, 8, 1)).astype("float32")
    Y = rng.integers(0, 3, 16)
    QCFG = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["Conv2D", "Dense"]}]

    def compressor(algo, model, opt):
        if algo == "agp":
            return AGPPruner(model, [{"final_sparsity": 0.6, "start_epoch": 0, "end_epoch": 3,
                                      "op_types": ["Conv2D", "Dense"]}], opt)
        if algo == "taylorfo":
            return TaylorFOWeightFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt,
                                              statistics_batch_num=2)
        if algo == "apoz":
            return ActivationAPoZRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt,
                                                  statistics_batch_num=2)
        return (QAT_Quantizer if algo == "qat" else LsqQuantizer)(model, QCFG, opt)

    def run(algo, strategy, wrap_in_scope=True):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu", name="c1"),
                                      keras.layers.Conv2D(6, 3, name="c2"), keras.layers.Flatten(),
                                      keras.layers.Dense(3, name="fc")])
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            model.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if wrap_in_scope:
                comp = compressor(algo, model, opt)  # wrapped inside strategy.scope()
                comp.compress()
        if not wrap_in_scope:  # state is created mirrored like the weights all the same
            comp = compressor(algo, model, opt)
            comp.compress()
        hist = model.fit(X, Y, epochs=3, batch_size=8, shuffle=False, verbose=0, callbacks=[CompressionCallback(comp)])
        state = {}
        for w in comp.get_modules_wrapper():
            names = dict(w.state_variables())
            for var in getattr(w, "_layer_variables", ()):
                names[var.name] = var
            for name, var in names.items():
                state[w.name + "." + name] = replica_values(var)
        return {"state": state, "unsynchronized": unsynchronized(comp), "loss": hist.history["loss"],
                "replicas": strategy.num_replicas_in_sync}

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    single = tf.distribute.OneDeviceStrategy("/cpu:0")
    out = {algo: {"mirrored": run(algo, mirrored), "single": run(algo, single)} for algo in sys.argv[2].split(",")}
    out["apoz_outside_scope"] = {"mirrored": run("apoz", mirrored, wrap_in_scope=False)}
    with open(sys.argv[1], "wb") as f:
        pickle.dump(out, f)
''')


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("mirrored") / "out.pkl"
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""}
    # ~90 s on 2 busy cores; no deadline of its own short of a hang: pytest-timeout (900 s, pyproject.toml) ends
    # a stuck run first (the subprocess is killed with the test), 1800 s is the backstop without the plugin
    proc = subprocess.run([sys.executable, "-c", WORKER, str(path), ",".join(ALGOS)], env=env, capture_output=True,
                          text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-4000:]
    with open(path, "rb") as f:
        return pickle.load(f)


@pytest.mark.parametrize("algo", [*ALGOS, "apoz_outside_scope"])
def test_fit_runs_and_replicas_hold_identical_state(results, algo):
    run = results[algo]["mirrored"]
    assert run["replicas"] == 2
    assert np.isfinite(run["loss"]).all()
    assert run["unsynchronized"] == []
    for name, values in run["state"].items():
        assert len(values) == 2, name  # one copy per replica: the state is mirrored
        assert values[0].dtype == values[1].dtype and values[0].tobytes() == values[1].tobytes(), name


@pytest.mark.parametrize("algo", ALGOS)
def test_mirrored_equals_one_device_on_the_global_batch(results, algo):
    mirrored, single = (results[algo][k]["state"] for k in ("mirrored", "single"))
    assert mirrored.keys() == single.keys()
    for name, values in single.items():
        expected, got = values[0], mirrored[name][0]
        if expected.dtype == bool or expected.dtype.kind in "iu":  # masks, flags, counters: exactly
            np.testing.assert_array_equal(got, expected, err_msg=name)
        else:  # ranges, scales, statistics: up to the order of float sums
            np.testing.assert_allclose(got, expected, rtol=2e-5, atol=1e-6, err_msg=name)
    masks = {k: v[0] for k, v in single.items() if k.endswith("weight_mask")}
    if algo == "agp":  # final sparsity reached: floor(n * 0.6) weights pruned per layer
        assert {k: int((~m).sum()) for k, m in masks.items()} == {
            "c1.weight_mask": 21, "c2.weight_mask": 129, "fc.weight_mask": 172}
    elif algo in ("taylorfo", "apoz"):  # floor(F * 0.5) whole filters (last Keras kernel axis)
        assert [int((~m.reshape(-1, m.shape[-1]).all(0)).sum()) for m in masks.values()] == [2, 3]
