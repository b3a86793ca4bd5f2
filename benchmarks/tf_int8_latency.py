"""int8 vs float TFLite on the TFLite interpreter: latency at batch 1 and 32, file size, agreement (issue 15).

Models (random weights; BatchNorm statistics randomised as a trained model has them): the demo's digits
CNN (8x8x1), Caffe's LeNet-5 (28x28x1) and a CIFAR-style ResNet-18 (32x32x3, 11.2 M parameters; the twin
of ``benchmarks/torch_speedup.py``'s). Each is converted three ways:

* ``float``: ``TFLiteConverter.from_keras_model`` of the float model, no optimisation;
* ``ours-int8``: ``PtqQuantizer`` (min-max observer, per-channel int8 weights, uint8 per-tensor
  inputs/outputs of every Conv2D/Dense, BN folded, ReLU fused, ranges shared) calibrated on 256 inputs,
  then ``export_model(tflite_path=...)``: full-integer int8 kernels, float input/output;
* ``tflite-ptq``: the TFLite converter's own full-integer PTQ of the float model with the same 256 inputs
  as representative dataset (float input/output), the anchor.

Latency: ``tf.lite.Interpreter`` with ``--threads`` threads (XNNPACK, the default delegate), one
interpreter per batch size (input resized), medians over ``--rounds`` rounds; each round runs every
(variant, batch) ``--calls`` times in a shuffled order. Agreement: argmax of the artifact vs the
fake-quant Keras model (ours) or the float model (anchor) on 256 inputs.

    python benchmarks/tf_int8_latency.py [--rounds 10] [--calls 3] [--threads 2] [--models ...]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from benchmarks._interleave import artifact_row, inputs, interleaved_medians  # noqa: E402
from compressor.demo import TfHarness  # noqa: E402
from compressor.tf import PtqQuantizer  # noqa: E402
from examples.models_tf import lenet_5  # noqa: E402

L = keras.layers


def resnet18_cifar(classes: int = 10) -> keras.Model:
    """The CIFAR ResNet-18 (3x3 stem, no max-pool, 11.17 M parameters), Functional API."""

    def block(x, cout: int, stride: int):
        y = L.Conv2D(cout, 3, stride, padding="same", use_bias=False)(x)
        y = L.ReLU()(L.BatchNormalization()(y))
        y = L.BatchNormalization()(L.Conv2D(cout, 3, padding="same", use_bias=False)(y))
        if stride != 1 or x.shape[-1] != cout:
            x = L.BatchNormalization()(L.Conv2D(cout, 1, stride, use_bias=False)(x))
        return L.ReLU()(L.Add()([y, x]))

    inp = keras.Input((32, 32, 3))
    x = L.ReLU()(L.BatchNormalization()(L.Conv2D(64, 3, padding="same", use_bias=False)(inp)))
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        x = block(block(x, cout, stride), cout, 1)
    return keras.Model(inp, L.Dense(classes)(L.GlobalAveragePooling2D()(x)), name="resnet18_cifar")


MODELS = {
    "digits-cnn": (lambda: TfHarness().build_cnn((8, 8), 10), (8, 8, 1)),
    "lenet5": (lambda: lenet_5(10, 28), (28, 28, 1)),
    "resnet18-cifar": (resnet18_cifar, (32, 32, 3)),
}


def randomize_norms(model: keras.Model) -> None:
    rng = np.random.default_rng(0)
    for layer in model.layers:
        if isinstance(layer, L.BatchNormalization):
            c = layer.gamma.shape[0]
            layer.set_weights([rng.uniform(0.5, 1.5, c), rng.normal(0, 0.1, c), rng.normal(0, 0.1, c),
                               rng.uniform(0.5, 1.5, c)])


def export(name: str, tmp: str) -> tuple[dict[str, str], dict[str, np.ndarray], np.ndarray]:
    make, shape = MODELS[name]
    keras.utils.set_random_seed(0)
    model = make()
    randomize_norms(model)
    calib, x_eval = inputs(shape, 256, 1), inputs(shape, 256, 2)
    paths = {v: os.path.join(tmp, f"{name}-{v}.tflite") for v in ("float", "ours-int8", "tflite-ptq")}
    float_logits = np.asarray(model(x_eval, training=False))

    def representative():
        for i in range(0, 256, 32):
            for j in range(i, i + 32):
                yield [calib[j:j + 1]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Path(paths["float"]).write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.representative_dataset = representative
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        Path(paths["tflite-ptq"]).write_bytes(conv.convert())
        q = PtqQuantizer(model, [{"op_types": ["Conv2D", "Dense"], "quant_types": ["input", "weight", "output"],
                                  "quant_bits": 8}])
        q.calibrate([calib[i:i + 32] for i in range(0, 256, 32)])
        q.export_model(tflite_path=paths["ours-int8"])
    fq_logits = np.asarray(model(x_eval, training=False))
    return paths, {"float": float_logits, "ours-int8": fq_logits, "tflite-ptq": float_logits}, x_eval


def interpreter(path: str, batch: int, threads: int) -> tf.lite.Interpreter:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        it = tf.lite.Interpreter(model_path=path, num_threads=threads)
    d = it.get_input_details()[0]
    it.resize_tensor_input(d["index"], [batch, *d["shape"][1:]])
    it.allocate_tensors()
    return it


def run(it: tf.lite.Interpreter, x: np.ndarray) -> np.ndarray:
    it.set_tensor(it.get_input_details()[0]["index"], x)
    it.invoke()
    return it.get_tensor(it.get_output_details()[0]["index"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    print(f"TensorFlow {tf.__version__} TFLite interpreter (XNNPACK), {args.threads} threads; medians of "
          f"{args.rounds} interleaved rounds x {args.calls} calls\n")
    print("| model | variant | file KB | size vs float | batch 1 ms | vs float | batch 32 ms | vs float | "
          "argmax agreement | int8 tensors |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            paths, reference, x_eval = export(name, tmp)
            its = {(v, b): interpreter(p, b, args.threads) for v, p in paths.items() for b in (1, 32)}
            sizes = {v: os.path.getsize(p) for v, p in paths.items()}
            agree, int8 = {}, {}
            for v in paths:
                it = its[(v, 32)]
                got = np.concatenate([run(it, x_eval[i:i + 32]) for i in range(0, 256, 32)])
                agree[v] = float((got.argmax(1) == reference[v].argmax(1)).mean())
                details = it.get_tensor_details()
                int8[v] = f"{sum(d['dtype'] == np.int8 for d in details)}/{len(details)}"
            feeds = {1: x_eval[:1], 32: x_eval[:32]}
            med = interleaved_medians({(v, b): (lambda it=its[(v, b)], x=feeds[b]: run(it, x)) for v, b in its},
                                      args.rounds, args.calls, warmup=1)
        for v in paths:
            print(artifact_row(name, v, sizes[v], sizes["float"], med, agree[v],
                               "fake-quant Keras" if v == "ours-int8" else "float Keras", int8[v]), flush=True)

if __name__ == "__main__":
    main()
