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

L = keras.layers
N_CLASSES = 4
VOCAB, SEQ = 50, 16
WEIGHTED = ("Conv1D", "Conv2D", "DepthwiseConv2D", "Dense", "EinsumDense")
#: TFLite ops each weighted Keras layer must become (int8)
INT8_OPS = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "BATCH_MATMUL"}


def text_transformer() -> keras.Model:
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, 16, name="emb")(inp)
    a = L.MultiHeadAttention(2, 8, name="mha")(h, h)
    h = L.LayerNormalization(name="ln1")(L.Add()([h, a]))
    f = L.Dense(32, activation="relu", name="ffn1")(h)
    f = L.Dense(16, name="ffn2")(f)
    h = L.LayerNormalization(name="ln2")(L.Add()([h, f]))
    h = L.GlobalAveragePooling1D()(h)
    return keras.Model(inp, L.Dense(N_CLASSES, name="fc")(h))


def lstm_classifier() -> keras.Model:
    inp = keras.Input((SEQ,), dtype="int32")
    h = L.Embedding(VOCAB, 16, name="emb")(inp)
    h = L.LSTM(16, name="lstm")(h)
    h = L.Dense(16, activation="relu", name="fc1")(h)
    return keras.Model(inp, L.Dense(N_CLASSES, name="fc")(h))


def make_model(name: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    if name == "text":
        return text_transformer()
    if name == "lstm":
        return lstm_classifier()
    kw = {"weights": None, "input_shape": (32, 32, 3), "classes": N_CLASSES, "classifier_activation": None}
    if name.startswith(("MobileNetV3", "ConvNeXt", "EfficientNet")):
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


def tflite_ops(path: str) -> list[str]:
    from tensorflow.lite.python import schema_py_generated as schema  # noqa: PLC0415

    with open(path, "rb") as f:
        m = schema.Model.GetRootAsModel(f.read(), 0)
    names = {v: k for k, v in vars(schema.BuiltinOperator).items() if not k.startswith("_")}
    out = []
    for s in range(m.SubgraphsLength()):
        g = m.Subgraphs(s)
        for i in range(g.OperatorsLength()):
            code = m.OperatorCodes(g.Operators(i).OpcodeIndex())
            out.append(names.get(max(code.BuiltinCode(), code.DeprecatedBuiltinCode()), "?"))
    return out


def run_tflite(path: str, x: np.ndarray) -> tuple[np.ndarray, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path, num_threads=1)
    interp.allocate_tensors()
    ind, outd = interp.get_input_details()[0], interp.get_output_details()[0]
    got = []
    for i in range(x.shape[0]):
        xi = x[i:i + 1]
        if ind["dtype"] in (np.int8, np.uint8) and x.dtype.kind == "f":
            s, z = ind["quantization"]
            info = np.iinfo(ind["dtype"])
            xi = np.clip(np.round(xi / s + z), info.min, info.max)
        interp.set_tensor(ind["index"], xi.astype(ind["dtype"]))
        interp.invoke()
        o = interp.get_tensor(outd["index"])[0]
        if outd["dtype"] in (np.int8, np.uint8):
            s, z = outd["quantization"]
            o = (o.astype(np.float32) - z) * s
        got.append(o)
    return np.stack(got), {"input": ind["dtype"], "output": outd["dtype"]}


def float_tflite(model: keras.Model) -> bytes:
    """The float TFLite of ``model`` at batch 1 (recurrent layers need a static batch)."""
    spec = [tf.TensorSpec((1, *t.shape[1:]), t.dtype) for t in model.inputs]
    fn = tf.function(lambda *xs: model(list(xs) if len(xs) > 1 else xs[0], training=False), input_signature=spec)
    conv = tf.lite.TFLiteConverter.from_concrete_functions([fn.get_concrete_function()], model)
    return conv.convert()


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
    q = ctf.PtqQuantizer(small, [{"op_types": ["default"], "quant_types": ["input", "weight", "output"],
                                  "quant_bits": 8}])
    q.calibrate(make_data(name, 64, seed=2), num_batches=8) if False else q.calibrate(
        [make_data(name, 8, seed=10 + i) for i in range(8)])
    path = os.path.join(workdir, "pruned_int8.tflite")
    t = time.perf_counter()
    q.export_model(os.path.join(workdir, "m.keras"), os.path.join(workdir, "cal.json"), tflite_path=path,
                   inference_input_type=tf.int8, inference_output_type=tf.int8)
    res["convert_s"] = time.perf_counter() - t
    res["float_bytes"], res["int8_bytes"] = os.path.getsize(float_path), os.path.getsize(path)
    x_eval = make_data(name, n_eval, seed=3)
    want = np.asarray(small(x_eval, training=False))
    got, res["io_dtypes"] = run_tflite(path, x_eval)
    res["agreement"] = float(np.mean(np.argmax(got, -1) == np.argmax(want, -1)))
    res["rel_err"] = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-12))
    res["ops"] = tflite_ops(path)
    res["float_ops"] = sorted(set(o for o in res["ops"] if o not in ("QUANTIZE", "DEQUANTIZE")))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path)
    res["float_tensors"] = [d["name"] for d in interp.get_tensor_details() if d["dtype"] == np.float32]
    res["weighted_layers"] = sum(1 for layer in small.layers if type(layer).__name__ in WEIGHTED[:4])
    return res


if __name__ == "__main__":
    import sys

    with tempfile.TemporaryDirectory() as d:
        r = pipeline(sys.argv[1], d)
    ops_count = {o: r["ops"].count(o) for o in sorted(set(r["ops"]))}
    for k, v in r.items():
        if k not in ("ops", "float_tensors"):
            print(k, v)
    print("ops", ops_count)
    print("float tensors", len(r["float_tensors"]), r["float_tensors"][:5])
