"""TF / Keras 3 quantization overhead: ``model.fit`` step time of a QAT small CNN vs the same dense model.

Side by side in one process, interleaved rounds, medians:

* ``dense``          plain Keras 3 model
* ``QAT w``          QAT_Quantizer, weights only (int8 per_channel_symmetric)
* ``QAT w+out``      weights + outputs (uint8 per_tensor_affine, EMA ranges) on every Conv2D / Dense
* ``QAT w+out comp`` the same with ``fused = False`` (core's composed fake-quant instead of TF's fused
                     ``fake_quant_with_min_max_vars`` for the per-tensor outputs): what the fused kernel saves
* inference (``predict_on_batch``) for all of them.

tfmot's ``quantize_model`` targets Keras 2 (``tf_keras``) only and is not compared here.

    python benchmarks/tf_quant.py [--rounds 30] [--steps 3] [--jit] [--threads N]

``--threads N`` pins TF's intra-/inter-op pools to N threads: steadier ratios on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")

BATCH, SHAPE, CLASSES = 64, (32, 32, 3), 10
W = {"quant_dtype": {"weight": "int"}, "quant_scheme": {"weight": "per_channel_symmetric"}}
WO = {"quant_dtype": {"weight": "int", "output": "uint"},
      "quant_scheme": {"weight": "per_channel_symmetric", "output": "per_tensor_affine"}}
VARIANTS = {
    "dense": None,
    "QAT w": ([{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["default"], **W}], True),
    "QAT w+out": ([{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"], **WO}], True),
    "QAT w+out comp": ([{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"], **WO}], False),
}


def build(keras):
    L = keras.layers
    return keras.Sequential([
        keras.Input(SHAPE), L.Conv2D(32, 3, activation="relu"), L.Conv2D(64, 3, activation="relu"),
        L.MaxPooling2D(), L.Flatten(), L.Dense(128, activation="relu"), L.Dense(CLASSES),
    ])


def data(np, n):
    rng = np.random.default_rng(0)
    return rng.random((n, *SHAPE), dtype=np.float32), rng.integers(0, CLASSES, n)


def time_fit(model, x, y, steps):
    """Seconds of each of ``steps`` ``train_on_batch`` calls (the graph-mode train step ``fit`` runs)."""
    out = []
    for i in range(steps):
        sl = slice(i * BATCH, (i + 1) * BATCH)
        t = time.perf_counter()
        model.train_on_batch(x[sl], y[sl])
        out.append(time.perf_counter() - t)
    return out


def time_predict(model, x, steps):
    out = []
    for i in range(steps):
        t = time.perf_counter()
        model.predict_on_batch(x[i * BATCH:(i + 1) * BATCH])
        out.append(time.perf_counter() - t)
    return out


def run(rounds, steps, jit):
    import keras
    import numpy as np

    from compressor.tf import QAT_Quantizer

    x, y = data(np, steps * BATCH)
    models = {}
    for name, spec in VARIANTS.items():
        keras.utils.set_random_seed(0)
        m = build(keras)
        opt = keras.optimizers.SGD(0.01, momentum=0.9)
        if spec is not None:
            config, fused = spec
            cls = QAT_Quantizer if fused else type("ComposedQAT", (QAT_Quantizer,), {"fused": False})
            cls(m, config, opt).compress()
        m.compile(opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=jit)
        time_fit(m, x, y, 2)  # trace + warm up
        time_predict(m, x, 2)
        models[name] = m
    fit = {n: [] for n in models}
    pred = {n: [] for n in models}
    for r in range(rounds):  # interleaved at the step level: a load spike hits every variant alike
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for n in order:
            fit[n] += time_fit(models[n], x, y, steps)
            pred[n] += time_predict(models[n], x, steps)
    return {n: statistics.median(v) for n, v in fit.items()}, {n: statistics.median(v) for n, v in pred.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--jit", action="store_true", help="compile the train step with XLA (jit_compile=True)")
    ap.add_argument("--threads", type=int, default=0, help="TF intra/inter-op threads (0: TF's default)")
    args = ap.parse_args()
    import tensorflow as tf

    if args.threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
        tf.config.threading.set_inter_op_parallelism_threads(args.threads)

    print(f"TF {tf.__version__}; small CNN {SHAPE} batch {BATCH}, 8-bit QAT, jit_compile={args.jit}, threads={args.threads or 'default'}; "
          f"{args.rounds} interleaved rounds x {args.steps} steps, medians of single steps")
    fit, pred = run(args.rounds, args.steps, args.jit)
    print(f"{'variant':<16}{'fit ms/step':>12}{'vs dense':>10}{'predict ms/batch':>18}{'vs dense':>10}")
    for n in fit:
        print(f"{n:<16}{fit[n] * 1e3:>12.2f}{fit[n] / fit['dense']:>9.3f}x{pred[n] * 1e3:>18.2f}"
              f"{pred[n] / pred['dense']:>9.3f}x")


if __name__ == "__main__":
    main()
