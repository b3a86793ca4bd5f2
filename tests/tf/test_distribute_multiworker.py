"""tf.distribute.MultiWorkerMirroredStrategy with 2 local worker processes (one CPU replica each).

A custom training loop (``strategy.run`` with ``tf.nn.compute_average_loss`` over the global batch and
``optimizer.apply``), each worker on its half of every global batch of 8. Both workers must end with
bit-identical compression state: activation statistics and QAT ranges are reduced over the workers.
(Keras 3.15's ``fit`` under this strategy fails in Keras' own symbolic build here, with or without a
compressor, so the loop is written out.)
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import textwrap

import numpy as np

WORKER = textwrap.dedent('''
    import json, os, pickle, sys
    idx, ports, out = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": idx}})
    import tensorflow as tf
    tf.config.threading.set_inter_op_parallelism_threads(2)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras
    import numpy as np
    from compressor.tf import ActivationAPoZRankFilterPruner, QAT_Quantizer
    from compressor.tf.distributed import replica_values

    rng = np.random.default_rng(0)
    X = rng.normal(size=(16, 8, 8, 1)).astype("float32")
    Y = rng.integers(0, 3, 16)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    res = {}
    for algo in ("apoz", "qat"):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu", name="c1"),
                                      keras.layers.Conv2D(6, 3, name="c2"), keras.layers.Flatten(),
                                      keras.layers.Dense(3, name="fc")])
            opt = keras.optimizers.SGD(0.05, momentum=0.9)
            if algo == "apoz":
                comp = ActivationAPoZRankFilterPruner(model, [{"sparsity": 0.5, "op_types": ["Conv2D"]}], opt,
                                                      statistics_batch_num=2)
            else:
                comp = QAT_Quantizer(model, [{"quant_types": ["input", "weight", "output"], "quant_bits": 8,
                                              "op_types": ["Conv2D", "Dense"]}], opt)
            comp.compress()

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = tf.nn.compute_average_loss(loss_fn(y, model(x, training=True)), global_batch_size=8)
                opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            strategy.run(replica_step, args=(x, y))

        rows = slice(idx * 4, idx * 4 + 4)
        for epoch in range(3):
            comp.update_epoch(epoch)
            for b in range(2):
                step(tf.constant(X[b * 8:(b + 1) * 8][rows]), tf.constant(Y[b * 8:(b + 1) * 8][rows]))
        state = {}
        for w in comp.get_modules_wrapper():
            for name, var in w.state_variables().items():
                state[w.name + "." + name] = replica_values(var)
        res[algo] = {"state": state, "replicas": strategy.num_replicas_in_sync}
    with open(out, "wb") as f:
        pickle.dump(res, f)
''')


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def test_two_workers_hold_identical_state(tmp_path):
    ports = ",".join(map(str, _free_ports(2)))
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("TF_CONFIG", None)
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), ports, str(tmp_path / f"w{i}.pkl")], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        # no deadline of its own short of a hang: pytest-timeout (900 s, pyproject.toml) ends a stuck run first
        # (the workers are killed below), 1800 s is the backstop without the plugin
        errors = [p.communicate(timeout=1800)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-3000:] for e in errors)
    w0, w1 = (pickle.loads((tmp_path / f"w{i}.pkl").read_bytes()) for i in range(2))
    for algo in ("apoz", "qat"):
        assert w0[algo]["replicas"] == w1[algo]["replicas"] == 2
        assert w0[algo]["state"].keys() == w1[algo]["state"].keys()
        for name, (value,) in w0[algo]["state"].items():
            (other,) = w1[algo]["state"][name]
            assert value.dtype == other.dtype and value.tobytes() == other.tobytes(), (algo, name)
    masks = [v[0] for k, v in w0["apoz"]["state"].items() if k.endswith("weight_mask")]
    assert [int((~m.reshape(-1, m.shape[-1]).all(0)).sum()) for m in masks] == [2, 3]  # floor(F * 0.5) filters
    assert bool(w0["qat"]["state"]["c1.input_observed"][0])
    assert np.all(w0["qat"]["state"]["c1.input_scale"][0] > 0)
