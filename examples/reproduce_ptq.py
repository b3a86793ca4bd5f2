"""Post-training int8 quantization (PTQ) measured on the exported artifacts, next to each runtime's own PTQ.

Per backend: train one float model (the demo's digits CNN on scikit-learn's 8x8 digits, or LeNet-5 on
MNIST), export it as a float artifact (ONNX / TFLite) and measure its test error there. Then, from that
same float model:

* ``ours/<observer>``: ``PtqQuantizer`` (int8 per-channel symmetric weights, uint8 per-tensor activations)
  calibrated on the same ~500 training images with the ``minmax``, ``percentile`` or ``mse`` observer,
  exported as integer QDQ ONNX (torch) / full-integer TFLite (tf) and evaluated IN onnxruntime / the
  TFLite interpreter (int8 input/output converted as the artifact's quantization parameters say);
  ``sim`` is the same quantizer's fake-quantized model in the framework, for reference;
* anchors, same float model and same calibration images: onnxruntime's ``quantize_static`` (QDQ,
  per-channel, U8S8, MinMax and Percentile calibration) on the float ONNX; the TFLite converter's own
  full-integer PTQ (``Optimize.DEFAULT`` + ``representative_dataset``) on the float Keras model.

Target (issue 15): int8 error <= float + 0.2 pp on the artifact, and >= the anchor's accuracy.

Note on the TFLite side: the converter re-derives activation ranges itself from the representative
dataset (min/max); for the percentile and MSE observers our export clips each quantized activation to
our range first, so the artifact carries our ranges (min-max: the converter's own min/max of the same
data, through the already quantized weights).

    python -m examples.reproduce_ptq --data digits|mnist [--backend torch|tf|all] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import tempfile
import warnings
from typing import Any

import numpy as np

from examples.common import (
    BACKEND_LABEL,
    Timer,
    add_common_args,
    backends_of,
    err,
    md_table,
    save_json,
)

OBSERVERS = ("minmax", "percentile", "mse")
TOLERANCE = 0.002  # int8 error <= float error + 0.2 pp
N_CALIB = 500


# ------------------------------------------------------------------------------------------ data / model
def load(args: argparse.Namespace) -> Any:
    from compressor.app.data import load_digits, load_mnist

    if args.data == "digits":
        return load_digits(seed=args.seed)
    ds = load_mnist(args.data_dir)
    return ds.subset(6000, 2000) if args.quick else ds


def train_float(h: Any, ds: Any, args: argparse.Namespace, progress: Any) -> Any:
    """The demo's digits CNN with the demo's schedule, or LeNet-5 on MNIST."""
    from compressor.app.demo import SCHEDULES

    h.seed(args.seed)
    if args.data == "digits":
        s = SCHEDULES[("digits", args.quick)]
        model = h.build_cnn(ds.image_shape, ds.num_classes)
        opt = h.optimizer(model, s.lr)
        h.fit(model, opt, ds.x_train, ds.y_train, s.dense_epochs, s.batch_size, args.seed, desc="float",
              progress=progress)
    else:
        from examples.common import Train, dense_baseline

        phase = Train(2, 2e-3, 64) if args.quick else Train(4, 1e-3, decay=0.7)
        model = dense_baseline(h, "lenet5", ds, phase, args.seed, progress)
    return model


def calibration_images(ds: Any, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed + 123)
    idx = rng.choice(len(ds.x_train), size=min(N_CALIB, len(ds.x_train)), replace=False)
    return ds.x_train[np.sort(idx)]


def size(path: str) -> int:
    return os.path.getsize(path)


def measure(logits: np.ndarray, y: np.ndarray, ref: np.ndarray | None, path: str) -> dict[str, Any]:
    """Accuracy, file size and, against the float artifact's logits ``ref``: relative logit error
    ``||l - l_float|| / ||l_float||`` and top-1 agreement (the observers' effect beyond accuracy)."""
    r: dict[str, Any] = {"acc": float((logits.argmax(1) == y).mean()), "bytes": size(path)}
    if ref is not None:
        r["logit_rel_err"] = float(np.linalg.norm(logits - ref) / np.linalg.norm(ref))
        r["agree"] = float((logits.argmax(1) == ref.argmax(1)).mean())
    return r


# ------------------------------------------------------------------------------------------ torch / ONNX
def ort_session(path: str, threads: int) -> Any:
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads or 0
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])


def ort_logits(path: str, x: np.ndarray, threads: int, batch: int = 500) -> np.ndarray:
    """Logits of an ONNX file in onnxruntime on NCHW float input (QDQ models take float and quantize inside)."""
    sess = ort_session(path, threads)
    inp = sess.get_inputs()[0]
    step = 1 if isinstance(inp.shape[0], int) else batch
    return np.concatenate([sess.run(None, {inp.name: x[i:i + step]})[0] for i in range(0, len(x), step)])


def onnx_int8_ops(path: str) -> list[str]:
    import onnx

    return sorted({n.op_type for n in onnx.load(path).graph.node if n.op_type in ("QuantizeLinear", "DequantizeLinear",
                                                                                   "QLinearConv", "QGemm")})


def run_torch(h: Any, ds: Any, args: argparse.Namespace, tmp: str, progress: Any) -> dict[str, Any]:
    import torch

    from compressor.torch import PtqQuantizer

    threads = args.threads
    model = train_float(h, ds, args, progress).eval()
    x_test = np.ascontiguousarray(ds.x_test[:, None]).astype(np.float32)
    calib = np.ascontiguousarray(calibration_images(ds, args.seed)[:, None]).astype(np.float32)
    shape = (1, *x_test.shape[1:])
    res: dict[str, Any] = {"float_sim_acc": h.evaluate(model, ds.x_test, ds.y_test)}

    fpath = os.path.join(tmp, "float.onnx")
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        torch.onnx.export(model.cpu(), (torch.zeros(shape),), fpath, dynamo=False, input_names=["input"],
                          output_names=["logits"], dynamic_axes={"input": {0: "batch"}, "logits": {0: "batch"}})
    ref = ort_logits(fpath, x_test, threads)
    res["float"] = measure(ref, ds.y_test, None, fpath)
    print(f"[torch] float ONNX error {err(res['float']['acc'])} ({res['float']['bytes']} B)", flush=True)

    cfg = [{"op_types": ["Conv2d", "Linear"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}]
    for obs in OBSERVERS:
        m = h.copy(model).cpu().eval()
        q = PtqQuantizer(m, cfg, observer=obs)
        with Timer() as t:
            q.calibrate([torch.from_numpy(calib[i:i + 100]) for i in range(0, len(calib), 100)])
        sim = h.evaluate(m, ds.x_test, ds.y_test)
        path = os.path.join(tmp, f"ours_{obs}.onnx")
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            q.export_model(os.path.join(tmp, f"ours_{obs}.pt"), onnx_path=path, input_shape=shape)
        res[f"ours/{obs}"] = {**measure(ort_logits(path, x_test, threads), ds.y_test, ref, path), "sim_acc": sim,
                              "calib_s": round(t.seconds, 2), "ops": onnx_int8_ops(path)}
        print(f"[torch] ours/{obs}: artifact error {err(res[f'ours/{obs}']['acc'])}, sim {err(sim)}, "
              f"{size(path)} B", flush=True)

    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input": calib[i:i + 1]} for i in range(len(calib))])

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.it, None)

    for name, method in (("ort/minmax", CalibrationMethod.MinMax), ("ort/percentile", CalibrationMethod.Percentile)):
        path = os.path.join(tmp, name.replace("/", "_") + ".onnx")
        root = logging.getLogger()
        level = root.level
        root.setLevel(logging.ERROR)  # quantize_static's "consider pre-processing" warnings
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), Timer() as t:
                warnings.simplefilter("ignore")
                quantize_static(fpath, path, Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                                activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                                calibrate_method=method)
        finally:
            root.setLevel(level)
        res[name] = {**measure(ort_logits(path, x_test, threads), ds.y_test, ref, path),
                     "calib_s": round(t.seconds, 2), "ops": onnx_int8_ops(path)}
        print(f"[torch] anchor {name}: error {err(res[name]['acc'])}, {size(path)} B", flush=True)
    return res


# ------------------------------------------------------------------------------------------ tf / TFLite
def tflite_logits(blob_path: str, x: np.ndarray, threads: int, batch: int = 250) -> np.ndarray:
    """Logits of a .tflite file in the TFLite interpreter; int8/uint8 input quantized with the input's
    (scale, zero point), int8/uint8 output dequantized with the output's."""
    import tensorflow as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice
        interp = tf.lite.Interpreter(model_path=blob_path, num_threads=threads or None)
    inp = interp.get_input_details()[0]
    interp.resize_tensor_input(inp["index"], [batch, *x.shape[1:]])
    interp.allocate_tensors()
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    logits = []
    for i in range(0, len(x), batch):
        xb = x[i:i + batch]
        n = len(xb)
        if n < batch:
            xb = np.concatenate([xb, np.zeros((batch - n, *x.shape[1:]), x.dtype)])
        if inp["dtype"] in (np.int8, np.uint8):
            s, z = inp["quantization"]
            info = np.iinfo(inp["dtype"])
            xb = np.clip(np.round(xb / s + z), info.min, info.max).astype(inp["dtype"])
        interp.set_tensor(inp["index"], xb)
        interp.invoke()
        lb = interp.get_tensor(out["index"])[:n].astype(np.float32)
        if out["dtype"] in (np.int8, np.uint8):
            s, z = out["quantization"]
            lb = (lb - z) * s
        logits.append(lb)
    return np.concatenate(logits)


def tflite_is_full_integer(path: str) -> bool:
    import tensorflow as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path)
    return not [d for d in interp.get_tensor_details() if d["dtype"] == np.float32]


def run_tf(h: Any, ds: Any, args: argparse.Namespace, tmp: str, progress: Any) -> dict[str, Any]:
    import tensorflow as tf

    from compressor.tf import PtqQuantizer

    threads = args.threads
    model = train_float(h, ds, args, progress)
    x_test = np.ascontiguousarray(ds.x_test[..., None]).astype(np.float32)
    calib = np.ascontiguousarray(calibration_images(ds, args.seed)[..., None]).astype(np.float32)
    res: dict[str, Any] = {"float_sim_acc": h.evaluate(model, ds.x_test, ds.y_test)}

    @contextlib.contextmanager
    def quiet() -> Any:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield

    fpath = os.path.join(tmp, "float.tflite")
    with quiet():
        blob = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    with open(fpath, "wb") as f:
        f.write(blob)
    ref = tflite_logits(fpath, x_test, threads)
    res["float"] = measure(ref, ds.y_test, None, fpath)
    print(f"[tf] float TFLite error {err(res['float']['acc'])} ({res['float']['bytes']} B)", flush=True)

    cfg = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_types": ["default"]}]
    for obs in OBSERVERS:
        m = h.copy(model)
        q = PtqQuantizer(m, cfg, observer=obs, batch_size=100, keep_batches=len(calib) // 100 + 1)
        with Timer() as t:
            q.calibrate(calib)
        sim = h.evaluate(m, ds.x_test, ds.y_test)
        path = os.path.join(tmp, f"ours_{obs}.tflite")
        with quiet():
            q.export_model(tflite_path=path, inference_input_type=tf.int8, inference_output_type=tf.int8)
        res[f"ours/{obs}"] = {**measure(tflite_logits(path, x_test, threads), ds.y_test, ref, path), "sim_acc": sim,
                              "calib_s": round(t.seconds, 2),
                              "full_integer": tflite_is_full_integer(path)}
        print(f"[tf] ours/{obs}: artifact error {err(res[f'ours/{obs}']['acc'])}, sim {err(sim)}, "
              f"{size(path)} B", flush=True)

    def rep() -> Any:
        for i in range(len(calib)):
            yield [calib[i:i + 1]]

    path = os.path.join(tmp, "tflite_ptq.tflite")
    with quiet(), Timer() as t:
        conv = tf.lite.TFLiteConverter.from_keras_model(model)
        conv.optimizations = [tf.lite.Optimize.DEFAULT]
        conv.representative_dataset = rep
        conv.target_spec.supported_ops = [tf.lite.OpsSet.TFLITE_BUILTINS_INT8]
        conv.inference_input_type = tf.int8
        conv.inference_output_type = tf.int8
        blob = conv.convert()
    with open(path, "wb") as f:
        f.write(blob)
    res["tflite"] = {**measure(tflite_logits(path, x_test, threads), ds.y_test, ref, path),
                     "calib_s": round(t.seconds, 2), "full_integer": tflite_is_full_integer(path)}
    print(f"[tf] anchor tflite: error {err(res['tflite']['acc'])}, {size(path)} B", flush=True)
    return res


# ------------------------------------------------------------------------------------------ report
def anchors(backend: str) -> list[str]:
    return ["ort/minmax", "ort/percentile"] if backend == "torch" else ["tflite"]


def report(results: dict[str, Any], backend: str, data: str) -> str:
    r = results
    model = "digits CNN" if data == "digits" else "LeNet-5"
    fmt = "ONNX (onnxruntime)" if backend == "torch" else "TFLite (interpreter)"
    f_err = 1 - r["float"]["acc"]
    best_anchor = max(r[a]["acc"] for a in anchors(backend))
    header = ["variant", f"error on {fmt}", "vs float", "logit rel. err", "top-1 agree", "sim error", "file",
              "x float", "<= float + 0.2 pp", ">= anchor acc"]
    rows = [[f"float ({model})", err(r["float"]["acc"]), "-", "-", "-", err(r["float_sim_acc"]),
             f"{r['float']['bytes'] / 1024:.1f} KiB", "1.00", "-", "-"]]
    for v in [*(f"ours/{o}" for o in OBSERVERS), *anchors(backend)]:
        a = r[v]["acc"]
        d = (1 - a) - f_err
        ok = (1 - a) <= f_err + TOLERANCE + 1e-12
        rows.append([f"**{v}**" if v.startswith("ours") else f"anchor {v}", err(a), f"{100 * d:+.2f} pp",
                     f"{r[v]['logit_rel_err']:.4f}", f"{100 * r[v]['agree']:.2f} %", err(r[v].get("sim_acc")), f"{r[v]['bytes'] / 1024:.1f} KiB",
                     f"{r[v]['bytes'] / r['float']['bytes']:.2f}", "yes" if ok else "no",
                     ("yes" if a >= best_anchor - 1e-12 else "no") if v.startswith("ours") else "-"])
    return f"**{BACKEND_LABEL[backend]}**, {data}, test n = {r['n_test']}\n\n" + md_table(header, rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--data", choices=("digits", "mnist"), default="digits")
    args = p.parse_args(argv)
    progress = False if args.no_progress else None
    from compressor.app.demo import get_harness

    ds = load(args)
    print(f"data: {ds.describe()}{' (quick)' if args.quick else ''}", flush=True)
    results: dict[str, Any] = {}
    for b in backends_of(args):
        h = get_harness(b, args.device)
        with h.threads(args.threads or None), Timer() as t, tempfile.TemporaryDirectory() as tmp:
            results[b] = (run_torch if b == "torch" else run_tf)(h, ds, args, tmp, progress)
        results[b]["n_test"] = len(ds.x_test)
        results[b]["n_calib"] = min(N_CALIB, len(ds.x_train))
        results[b]["seconds"] = round(t.seconds, 1)
        print(f"[{b}] done in {t.seconds:.0f} s", flush=True)
    print()
    for b in results:
        print(report(results[b], b, args.data))
        print()
    save_json(args.json, results, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
