"""int8 vs float TFLite on the TFLite interpreter: latency at batch 1 and 32, file size, agreement (issues 15, 27).

Models (random weights; BatchNorm statistics randomised as a trained model has them): the demo's digits
CNN (8x8x1), Caffe's LeNet-5 (28x28x1) and a CIFAR-style ResNet-18 (32x32x3, 11.2 M parameters; the twin
of ``benchmarks/torch_speedup.py``'s); issue 27 adds keras.applications MobileNetV2 (alpha 0.35, 96x96x3), a
BERT-style encoder (token ids, 64 long; 2 blocks of MultiHeadAttention 4 x 32 + Dense(256, gelu) / Dense(128) FFN
+ LayerNormalization) and a ViT-tiny-like model (32x32x3, 4x4 patches, width 192, 3 heads, MLP 768, 4 of
ViT-tiny's 12 blocks). Each is converted three ways:

* ``float``: ``TFLiteConverter.from_keras_model`` of the float model, no optimisation;
* ``ours-int8``: ``PtqQuantizer`` (min-max observer, per-channel int8 weights, uint8 per-tensor
  inputs/outputs of every Conv2D/Dense, BN folded, ReLU fused, ranges shared) calibrated on 256 inputs,
  then ``export_model(tflite_path=...)``: full-integer int8 kernels, float input/output (for the transformers
  ``tflite_int8='auto'`` keeps softmax / norms / GELU / score matmuls float: see compressor.tf.quantization.ptq);
* ``tflite-ptq``: the TFLite converter's own full-integer PTQ of the float model with the same 256 inputs
  as representative dataset (float input/output), the anchor.

and the transformers two more ways: ``ours-dynamic`` (``PtqQuantizer(activation='dynamic')``, no calibration)
next to ``tflite-dynamic`` (the converter's dynamic-range quantization of the float model), its anchor.

Latency: ``tf.lite.Interpreter`` with ``--threads`` threads (XNNPACK, the default delegate), one
interpreter per batch size (input resized), medians over ``--rounds`` rounds; each round runs every
(variant, batch) ``--calls`` times in a shuffled order. Agreement: argmax of the artifact vs the
fake-quant Keras model (ours) or the float model (anchor) on 256 inputs; the last column adds every artifact's
argmax agreement and relative error (||y - y_float|| / ||y_float||) against the float Keras model.

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
from compressor.app.demo import TfHarness  # noqa: E402
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


def mha_encoder(seq: int = 64, vocab: int = 1000, width: int = 128, heads: int = 4, mlp: int = 256, blocks: int = 2,
                classes: int = 10) -> keras.Model:
    """BERT-style: token + position embedding, post-LN blocks of MultiHeadAttention and a GELU FFN."""
    ids = keras.Input((seq,), dtype="int32")
    h = L.Embedding(vocab, width)(ids) + L.Embedding(seq, width)(keras.ops.arange(seq))[None]
    for _ in range(blocks):
        h = L.LayerNormalization()(h + L.MultiHeadAttention(heads, width // heads)(h, h))
        f = L.EinsumDense("abc,cd->abd", (None, width), bias_axes="d")(L.Dense(mlp, activation="gelu")(h))
        h = L.LayerNormalization()(h + f)
    return keras.Model(ids, L.Dense(classes)(L.GlobalAveragePooling1D()(h)), name="mha_encoder")


def vit_tiny(blocks: int = 4, width: int = 192, heads: int = 3, mlp: int = 768, patch: int = 4,
             classes: int = 10) -> keras.Model:
    """ViT-tiny's width / heads / MLP on 32x32 inputs (pre-LN blocks, mean-pooled tokens instead of a class token)."""
    inp = keras.Input((32, 32, 3))
    h = L.Reshape((-1, width))(L.Conv2D(width, patch, patch)(inp))
    h = h + L.Embedding((32 // patch) ** 2, width)(keras.ops.arange((32 // patch) ** 2))[None]
    for _ in range(blocks):
        a = L.LayerNormalization(epsilon=1e-6)(h)
        h = h + L.MultiHeadAttention(heads, width // heads)(a, a)
        a = L.LayerNormalization(epsilon=1e-6)(h)
        h = h + L.Dense(width)(L.Dense(mlp, activation="gelu")(a))
    h = L.LayerNormalization(epsilon=1e-6)(h)
    return keras.Model(inp, L.Dense(classes)(L.GlobalAveragePooling1D()(h)), name="vit_tiny")


MODELS = {
    "digits-cnn": (lambda: TfHarness().build_cnn((8, 8), 10), (8, 8, 1)),
    "lenet5": (lambda: lenet_5(10, 28), (28, 28, 1)),
    "resnet18-cifar": (resnet18_cifar, (32, 32, 3)),
    "mobilenetv2": (lambda: keras.applications.MobileNetV2((96, 96, 3), alpha=0.35, weights=None, classes=10),
                    (96, 96, 3)),
    "mha-encoder": (mha_encoder, (64,)),
    "vit-tiny": (vit_tiny, (32, 32, 3)),
}
#: token-id models (int32 inputs) and the models that get the dynamic-range variants too
TOKENS = ("mha-encoder",)
TRANSFORMERS = ("mha-encoder", "vit-tiny")
QUANTIZED = ["Conv2D", "DepthwiseConv2D", "Dense", "EinsumDense", "MultiHeadAttention"]


def model_inputs(name: str, shape: tuple[int, ...], n: int, seed: int) -> np.ndarray:
    if name in TOKENS:
        return np.random.default_rng(seed).integers(0, 1000, (n, *shape)).astype(np.int32)
    return inputs(shape, n, seed)


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
    calib, x_eval = model_inputs(name, shape, 256, 1), model_inputs(name, shape, 256, 2)
    variants = ["float", "ours-int8", "tflite-ptq"] + (["ours-dynamic", "tflite-dynamic"] if name in TRANSFORMERS else [])
    paths = {v: os.path.join(tmp, f"{name}-{v}.tflite") for v in variants}
    float_logits = np.asarray(model(x_eval, training=False))

    def representative():
        for i in range(0, 256, 32):
            for j in range(i, i + 32):
                yield [calib[j:j + 1]]

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        Path(paths["float"]).write_bytes(tf.lite.TFLiteConverter.from_keras_model(model).convert())
        if name in TRANSFORMERS:
            conv = tf.lite.TFLiteConverter.from_keras_model(model)
            conv.optimizations = [tf.lite.Optimize.DEFAULT]
            Path(paths["tflite-dynamic"]).write_bytes(conv.convert())
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.representative_dataset = representative
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        Path(paths["tflite-ptq"]).write_bytes(conv.convert())
        present = {type(la).__name__ for la in model._flatten_layers()}
        cfg = [{"op_types": [t for t in QUANTIZED if t in present], "quant_types": ["input", "weight", "output"],
                "quant_bits": 8}]
        fq = {}
        if name in TRANSFORMERS:  # a copy of the float model: the static quantizer folds / wraps the original
            dyn_model = keras.models.clone_model(model)
            dyn_model.set_weights(model.get_weights())
            dq = PtqQuantizer(dyn_model, cfg, activation="dynamic")
            dq.export_model(tflite_path=paths["ours-dynamic"])
            fq["ours-dynamic"] = np.asarray(dyn_model(x_eval, training=False))
        q = PtqQuantizer(model, cfg)
        q.calibrate([calib[i:i + 32] for i in range(0, 256, 32)])
        q.export_model(tflite_path=paths["ours-int8"])
    fq["ours-int8"] = np.asarray(model(x_eval, training=False))
    return paths, {v: fq.get(v, float_logits) for v in variants}, x_eval


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
          "argmax agreement | int8 tensors | vs float Keras: argmax, rel. error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
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
                ref = reference["float"]
                int8[v] = (f"{sum(d['dtype'] == np.int8 for d in details)}/{len(details)} | "
                           f"{(got.argmax(1) == ref.argmax(1)).mean():.1%}, "
                           f"{np.linalg.norm(got - ref) / np.linalg.norm(ref):.3f}")
            feeds = {1: x_eval[:1], 32: x_eval[:32]}
            med = interleaved_medians({(v, b): (lambda it=its[(v, b)], x=feeds[b]: run(it, x)) for v, b in its},
                                      args.rounds, args.calls, warmup=1)
        for v in paths:
            print(artifact_row(name, v, sizes[v], sizes["float"], med, agree[v],
                               "fake-quant Keras" if v.startswith("ours") else "float Keras", int8[v]), flush=True)

if __name__ == "__main__":
    main()
