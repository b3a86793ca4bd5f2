"""The user pipeline of issue 23 on one Keras model: dependency-aware L1FilterPruner at 50 % 'default' ->
strict speedup -> 2 fit steps -> PtqQuantizer calibrated on 8 batches -> full-integer TFLite, run in
tf.lite.Interpreter and compared with the fake-quant Keras model. Shared by the tests and by
``python tests/tf/_keras_pipeline.py NAME`` (prints the measurements)."""

from __future__ import annotations

import os
import tempfile
import time
import warnings

import keras
import numpy as np
import tensorflow as tf

import compressor.tf as ctf
from compressor.tf.compressor import iter_layers

L = keras.layers
N_CLASSES = 4
VOCAB, SEQ, DIM = 400, 16, 64
WEIGHTED = ("Conv1D", "Conv2D", "DepthwiseConv2D", "Dense", "EinsumDense")
#: TFLite ops each weighted Keras layer must become (int8)
INT8_OPS = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL"}


def text_transformer() -> keras.Model:
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, DIM, name="emb")(inp)
    a = L.MultiHeadAttention(4, DIM // 4, name="mha")(h, h)
    h = L.LayerNormalization(name="ln1")(L.Add()([h, a]))
    f = L.Dense(4 * DIM, activation="relu", name="ffn1")(h)
    f = L.Dense(DIM, name="ffn2")(f)
    h = L.LayerNormalization(name="ln2")(L.Add()([h, f]))
    h = L.GlobalAveragePooling1D()(h)
    return keras.Model(inp, L.Dense(N_CLASSES, name="fc")(h))


def lstm_classifier() -> keras.Model:
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, DIM, name="emb")(inp)
    h = L.LSTM(DIM, name="lstm")(h)
    h = L.Dense(DIM, activation="relu", name="fc1")(h)
    return keras.Model(inp, L.Dense(N_CLASSES, name="fc")(h))


def make_model(name: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    if name == "text":
        return text_transformer()
    if name == "lstm":
        return lstm_classifier()
    kw = {"weights": None, "input_shape": (32, 32, 3), "classes": N_CLASSES, "classifier_activation": None}
    if name.startswith(("MobileNetV3", "ConvNeXt")):
        kw["include_preprocessing"] = False
    if name == "MobileNetV2":
        kw["alpha"] = 0.35
    return getattr(keras.applications, name)(**kw)


def make_data(name: str, n: int, seed: int = 0) -> np.ndarray:
    """Structured inputs: class prototypes plus noise (images) / class-specific token ranges (text)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, n)
    if name in ("text", "lstm"):
        lo = y[:, None] * (VOCAB // N_CLASSES)
        return (lo + rng.integers(0, VOCAB // N_CLASSES, (n, SEQ))).astype("int32")
    proto = np.random.default_rng(100).standard_normal((N_CLASSES, 32, 32, 3)).astype(np.float32)
    return (proto[y] + 0.5 * rng.standard_normal((n, 32, 32, 3))).astype(np.float32)


def zero_filters(model: keras.Model) -> dict[str, int]:
    """Output channels of Conv/Dense kernels that are all zero (removable weights speedup left)."""
    out = {}
    for layer in model.layers:
        if type(layer).__name__ not in WEIGHTED[:4] or not layer.weights:
            continue
        k = layer.get_weights()[0]
        k = k.reshape(-1, k.shape[-2] * k.shape[-1]) if type(layer).__name__ == "DepthwiseConv2D" else k.reshape(-1, k.shape[-1])
        dead = int((~np.any(k != 0, axis=0)).sum())
        if dead:
            out[layer.name] = dead
    return out


def tflite_ops(path: str) -> list[tuple[str, list[str], bool]]:
    """``(op name, dtypes of its inputs, whether an operand is a constant = a layer's weight)`` of every op."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path)
    dtypes = {d["index"]: np.dtype(d["dtype"]).name for d in interp.get_tensor_details()}
    ops = interp._get_ops_details()
    variable = {i for op in ops for i in op["outputs"]} | {d["index"] for d in interp.get_input_details()}
    return [(op["op_name"], [dtypes.get(i, "none") for i in op["inputs"] if i >= 0],
             any(i not in variable for i in op["inputs"][:2] if i >= 0)) for op in ops]


def int8_weighted_ops(ops: list[tuple[str, list[str], bool]]) -> tuple[int, list[str]]:
    """(number of int8 CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED / BATCH_MATMUL ops with a weight, those
    that are not int8: their names and input dtypes). A BATCH_MATMUL of two activations (attention scores)
    holds no weight: not counted."""
    good, bad = 0, []
    for name, dts, weighted in ops:
        if name in INT8_OPS and weighted:
            if dts[0] == "int8" and all(d in ("int8", "int32") for d in dts[1:]):
                good += 1
            else:
                bad.append(f"{name}{dts}")
    return good, bad


def run_tflite(path: str, x: np.ndarray, batch: int = 1) -> tuple[np.ndarray, dict]:
    """Outputs of the .tflite on ``x`` in batches of ``batch`` (the input resized when its batch differs)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path, num_threads=1)
    ind = interp.get_input_details()[0]
    if ind["shape"][0] != batch:
        interp.resize_tensor_input(ind["index"], [batch, *ind["shape"][1:]], strict=True)
    interp.allocate_tensors()
    outd = interp.get_output_details()[0]
    got = []
    for i in range(0, x.shape[0], batch):
        xi = x[i:i + batch]
        if ind["dtype"] in (np.int8, np.uint8) and x.dtype.kind == "f":
            s, z = ind["quantization"]
            info = np.iinfo(ind["dtype"])
            xi = np.clip(np.round(xi / s + z), info.min, info.max)
        interp.set_tensor(ind["index"], xi.astype(ind["dtype"]))
        interp.invoke()
        o = interp.get_tensor(outd["index"])
        if outd["dtype"] in (np.int8, np.uint8):
            s, z = outd["quantization"]
            o = (o.astype(np.float32) - z) * s
        got.append(o)
    return np.concatenate(got), {"input": ind["dtype"], "output": outd["dtype"]}


def float_tflite(model: keras.Model) -> bytes:
    """The float TFLite of ``model`` (a saved model at batch 1: recurrent layers need a static batch)."""
    spec = [tf.TensorSpec((1, *t.shape[1:]), t.dtype) for t in model.inputs]
    with tempfile.TemporaryDirectory() as d:
        model.export(d, format="tf_saved_model", verbose=False, input_signature=spec if len(spec) == 1 else [spec])
        return tf.lite.TFLiteConverter.from_saved_model(d).convert()


def pipeline(name: str, workdir: str, n_eval: int = 64) -> dict:
    """Runs the whole pipeline; returns the measurements (raises where a step fails)."""
    model = make_model(name)
    res: dict = {"params": model.count_params()}
    t = time.perf_counter()
    pruner = ctf.L1FilterPruner(model, [{"sparsity": 0.5, "op_types": ["default"]}], dependency_aware=True)
    pruner.compress()
    small = ctf.speedup_model(pruner)
    res["prune_speedup_s"] = time.perf_counter() - t
    res["pruned_params"] = small.count_params()
    res["zero_filters"] = zero_filters(small)
    x_train = make_data(name, 8, seed=1)
    y_train = keras.utils.to_categorical(np.arange(8) % N_CLASSES, N_CLASSES)
    small.compile(optimizer=keras.optimizers.SGD(1e-3), loss=keras.losses.CategoricalCrossentropy(from_logits=True))
    small.fit(x_train, y_train, batch_size=4, epochs=1, verbose=0)  # 2 steps
    float_path = os.path.join(workdir, "pruned_float.tflite")
    with open(float_path, "wb") as f:
        f.write(float_tflite(small))
    types = ["default", "MultiHeadAttention"] if name == "text" else ["default"]
    q = ctf.PtqQuantizer(small, [{"op_types": types, "quant_types": ["input", "weight", "output"], "quant_bits": 8}])
    q.calibrate([make_data(name, 8, seed=10 + i) for i in range(8)])  # 8 batches
    path = os.path.join(workdir, "pruned_int8.tflite")
    t = time.perf_counter()
    q.export_model(os.path.join(workdir, "m.keras"), os.path.join(workdir, "cal.json"), tflite_path=path,
                   inference_input_type=tf.int8, inference_output_type=tf.int8)
    res["convert_s"] = time.perf_counter() - t
    res["float_bytes"], res["int8_bytes"] = os.path.getsize(float_path), os.path.getsize(path)
    x_eval = make_data(name, n_eval, seed=3)
    want = np.asarray(small(x_eval, training=False))
    got, res["io_dtypes"] = run_tflite(path, x_eval)
    res["batch16_max_diff"] = float(np.abs(run_tflite(path, x_eval, 16)[0] - got).max())  # dynamic batch
    res["agreement"] = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
    res["rel_err"] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))
    res["ops"] = tflite_ops(path)
    res["int8_weighted_ops"], res["not_int8"] = int8_weighted_ops(res["ops"])
    res["float_tensors"] = sorted({dt for _, dts, _ in res["ops"] for dt in dts if dt == "float32"})
    res["weighted_layers"] = sum(1 for _, layer in iter_layers(small) if type(layer).__name__ in WEIGHTED)
    return res


if __name__ == "__main__":
    import sys

    with tempfile.TemporaryDirectory() as d:
        r = pipeline(sys.argv[1], d)
    names = [o for o, _, _ in r["ops"]]
    ops_count = {o: names.count(o) for o in sorted(set(names))}
    for k, v in r.items():
        if k not in ("ops", "float_tensors"):
            print(k, v)
    print("ops", ops_count)

