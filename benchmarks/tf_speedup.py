"""Structured pruning + speedup on Keras 3: really smaller and faster keras.applications models.

For each model and channel sparsity (30 / 50 / 70 %): ``L1FilterPruner(dependency_aware=True)`` on every
Conv2D (the classifier left alone), ``compress()``, ``speedup_model``. Prints params and MACs
(``count_flops_params``) and measured CPU latency of a compiled forward at batch 1 and 32 as ratios to the
dense model, interleaved in one run (median of ``--rounds``), and the time to prune + speed up. No other
Keras 3 library does structured speedup, so there is no side-by-side row.

    python benchmarks/tf_speedup.py [--rounds 10] [--threads 2] [--ratios 0.3 0.5 0.7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import compressor.tf as ctf  # noqa: E402

MODELS = {
    "ResNet50": ({}, 64),
    "MobileNetV2": ({"alpha": 0.5}, 96),
    "EfficientNetB0": ({}, 64),
}


def build(name: str) -> keras.Model:
    kwargs, size = MODELS[name]
    keras.utils.set_random_seed(0)
    model = getattr(keras.applications, name)(weights=None, input_shape=(size, size, 3), classes=10, **kwargs)
    rng = np.random.default_rng(0)
    for layer in model.layers:  # fresh BatchNorms are identities; give them trained-looking statistics
        if isinstance(layer, keras.layers.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.normal(0, 0.1, c),
                               rng.uniform(0.5, 1.5, c)])
    return model


def latency(fn, x: tf.Tensor, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        fn(x).numpy()
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    args = p.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    print(f"tensorflow {tf.__version__}, keras {keras.__version__}, {args.threads} threads, {args.rounds} "
          f"interleaved rounds, medians; ratios = sped-up / dense of the same round")
    print("| model | sparsity | params | MACs | latency b1 | latency b32 | prune+speedup s |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        dense = build(name)
        size = MODELS[name][1]
        x1 = tf.random.normal((1, size, size, 3))
        x32 = tf.random.normal((32, size, size, 3))
        dmacs, dparams, _ = ctf.count_flops_params(dense)
        print(f"| {name} | 0 | {dparams / 1e6:.2f} M | {dmacs / 1e6:.1f} M | 1 | 1 | - |", flush=True)
        dense_fn = tf.function(lambda x, m=dense: m(x, training=False))
        for ratio in args.ratios:
            model = build(name)
            t0 = time.perf_counter()
            config = [{"sparsity": ratio, "op_types": ["Conv2D"]}]
            pruner = ctf.L1FilterPruner(model, config, dependency_aware=True)
            pruner.compress()
            small = ctf.speedup_model(pruner)
            secs = time.perf_counter() - t0
            macs, params, _ = ctf.count_flops_params(small)
            small_fn = tf.function(lambda x, m=small: m(x, training=False))
            for fn in (dense_fn, small_fn):
                latency(fn, x1, 2)
                latency(fn, x32, 1)
            r1, r32 = [], []
            for _ in range(args.rounds):
                b1, b32 = latency(dense_fn, x1, 10), latency(dense_fn, x32, 2)
                r1.append(latency(small_fn, x1, 10) / b1)
                r32.append(latency(small_fn, x32, 2) / b32)
            print(f"| {name} | {ratio:.0%} | {params / dparams:.3f}x | {macs / dmacs:.3f}x | "
                  f"{statistics.median(r1):.3f}x | {statistics.median(r32):.3f}x | {secs:.1f} |", flush=True)


if __name__ == "__main__":
    main()
