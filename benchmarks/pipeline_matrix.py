"""The whole pipeline on real architectures, as a new user runs it (issue 23).

For each model: dependency-aware L1 filter pruning at 50 % with ``op_types: ['default']`` -> ``speedup_model``
(strict) -> a few fine-tune steps -> ``PtqQuantizer.calibrate`` on 8 batches -> the int8 artifact (QDQ ONNX in
onnxruntime on torch, full-integer TFLite in the interpreter on Keras), checked ON the artifact:

- every Conv / Linear / Dense runs in an integer kernel (onnxruntime's optimised graph: QLinearConv, QGemm,
  QLinearMatMul, MatMulInteger...; TFLite: CONV_2D / DEPTHWISE_CONV_2D / FULLY_CONNECTED with int8 weights);
- a dynamic batch (batch 1 and 16 both run);
- outputs agree with the fake-quant model (argmax agreement and relative error);
- the file is smaller than the float artifact of the pruned model;
- params / MACs ratios after speedup, zero weights left behind in the sped-up model, latency of the int8
  artifact vs the dense float artifact in the same runtime (interleaved, batch 1 and 16).

``python -m benchmarks.pipeline_matrix [--backend torch|tf|all] [--models a,b] [--latency]`` prints one
markdown table (Keras: ``--tflite-int8 all`` converts every op to int8, not only the kernels of attention /
normalization / recurrent models, see ``PtqQuantizer.export_model``); ``run_one(name)`` returns one row as a dict (the fast CI subset in
tests/*/test_pipeline_matrix.py calls it). Models are built from small configs with random weights (no
downloads); inputs are class prototypes plus noise, so a random network's logits have margins.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import os
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

N_CLASSES = 10
N_CALIB = 8            # calibration batches
BATCH = 8
N_EVAL = 64
SPARSITY = 0.5

INT_ONNX = {"QLinearConv", "QGemm", "QLinearMatMul", "MatMulInteger", "ConvInteger", "DynamicQuantizeMatMul",
            "MatMulIntegerToFloat", "DynamicQuantizeLSTM", "QAttention", "DynamicQuantizeLinear"}
FLOAT_WEIGHTED_ONNX = {"Conv", "FusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul", "ConvTranspose"}
RECURRENT_ONNX = {"LSTM", "GRU", "RNN"}  # no static int8 kernel in onnxruntime: stay float, reported
TFLITE_WEIGHTED = {"CONV_2D", "DEPTHWISE_CONV_2D", "FULLY_CONNECTED", "TRANSPOSE_CONV", "BATCH_MATMUL",
                   "CONV_3D"}


@dataclass
class Row:
    """One model's run; ``failed`` names the first step that raised (``''`` = ran clean)."""

    model: str
    backend: str
    failed: str = ""
    error: str = ""
    params_ratio: float = float("nan")
    macs_ratio: float = float("nan")
    zeros_left: int = -1
    int_kernels: int = 0
    float_kernels: list[str] = field(default_factory=list)
    dynamic_batch: bool = False
    agreement: float = float("nan")
    rel_error: float = float("nan")
    size_int8: int = 0
    size_pruned_float: int = 0
    size_dense_float: int = 0
    latency: dict[str, float] = field(default_factory=dict)
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        """Ran every step, integer kernels only, dynamic batch, agrees, smaller than the pruned float file."""
        return (not self.failed and not self.blocking_floats and self.int_kernels > 0 and self.dynamic_batch
                and self.agreement >= 0.9 and 0 < self.size_int8 < self.size_pruned_float and self.zeros_left == 0
                and self.params_ratio < 1)

    @property
    def blocking_floats(self) -> list[str]:
        """Float conv / matmul kernels with a constant weight (recurrent layers, which neither runtime runs
        in static int8, are listed but allowed)."""
        return [k for k in self.float_kernels if "recurrent" not in k]

    def markdown(self) -> str:
        if self.failed:
            status = f"FAILED at {self.failed}: {self.error[:140]}"
        else:
            problems = []
            if self.blocking_floats:
                problems.append(f"float kernels: {', '.join(self.blocking_floats[:3])}"
                                + (f" +{len(self.blocking_floats) - 3}" if len(self.blocking_floats) > 3 else ""))
            if not self.dynamic_batch:
                problems.append("fixed batch")
            if self.agreement < 0.9:
                problems.append(f"agreement {self.agreement:.0%}")
            if not self.params_ratio < 1:
                problems.append("nothing removed")
            if self.zeros_left:
                problems.append(f"{self.zeros_left} zero weights left")
            if not 0 < self.size_int8 < self.size_pruned_float:
                problems.append("not smaller than pruned float")
            status = "clean" if not problems else "; ".join(problems)
            rec = [k.split()[0] for k in self.float_kernels if "recurrent" in k]
            if rec and not problems:
                status += f" ({', '.join(sorted(set(rec)))} float: no int8 kernel)"
        lat = self.latency
        l1 = f"{lat['int8', 1] / lat['dense', 1]:.2f}x" if ("int8", 1) in lat else "-"
        l16 = f"{lat['int8', 16] / lat['dense', 16]:.2f}x" if ("int8", 16) in lat else "-"
        size = (f"{self.size_int8 / 1024:.0f} KB ({self.size_int8 / self.size_dense_float:.2f}x dense, "
                f"{self.size_int8 / self.size_pruned_float:.2f}x pruned)") if self.size_int8 else "-"
        return (f"| {self.model} | {self.backend} | {_f(self.params_ratio)} | {_f(self.macs_ratio)} | "
                f"{self.int_kernels} | {size} | {l1} | {l16} | {_f(self.agreement, '{:.0%}')} | "
                f"{_f(self.rel_error, '{:.3f}')} | {status} |")


HEADER = ("| model | backend | params | MACs | int8 kernels | int8 file | latency b1 vs dense | b16 | "
          "agreement vs fake-quant | rel. error | status |\n|---|---|---|---|---|---|---|---|---|---|---|")


def _f(v: float, fmt: str = "{:.2f}x") -> str:
    return "-" if v != v else fmt.format(v)


class _Step:
    """``with step(row, 'name'):`` records the step's time; the first exception marks the row failed."""

    def __init__(self, row: Row):
        self.row = row

    @contextlib.contextmanager
    def __call__(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        except Exception as e:
            self.row.failed = name
            self.row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.row.seconds[name] = time.perf_counter() - t0
            if os.environ.get("PIPELINE_MATRIX_TRACE"):
                traceback.print_exc()
            raise _Stop from e
        self.row.seconds[name] = time.perf_counter() - t0


class _Stop(Exception):
    pass


def prototypes(shape: tuple[int, ...], n: int, seed: int, tokens: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)``: class prototypes plus noise (images) or prototype token sequences with 25 % of the tokens
    replaced at random (``tokens`` = vocabulary size)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, N_CLASSES, n)
    if tokens:
        proto = np.random.default_rng(1234).integers(1, tokens, (N_CLASSES, *shape))
        x = proto[y].copy()
        noise = rng.random(x.shape) < 0.25
        x[noise] = rng.integers(1, tokens, int(noise.sum()))
        return x.astype(np.int64), y
    proto = np.random.default_rng(1234).standard_normal((N_CLASSES, *shape)).astype(np.float32)
    return (proto[y] + 0.5 * rng.standard_normal((n, *shape))).astype(np.float32), y


def _agreement(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    a, b = np.asarray(a, np.float64).reshape(len(a), -1), np.asarray(b, np.float64).reshape(len(b), -1)
    return float(np.mean(a.argmax(1) == b.argmax(1))), float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


# ---------------------------------------------------------------------------------------------- PyTorch


def hf(cls_name: str, cfg_name: str, **cfg: Any) -> Callable[[], tuple[Any, tuple[int, ...], int]]:
    """Builder of a Hugging Face ``transformers`` model from a small config (random weights, no download)."""
    def build():
        import transformers

        cfg.setdefault("num_labels", N_CLASSES)
        model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**cfg))
        shape = (3, 32, 32) if "pixel" in model.main_input_name else (16,)
        vocab = getattr(model.config, "vocab_size", 0) if "input_ids" == model.main_input_name else 0
        return model, shape, vocab
    return build


def app(fn_name: str, size: int = 32, **kw: Any) -> Callable[[], tuple[Any, tuple[int, ...], int]]:
    """Builder of a ``keras.applications`` model with ``weights=None`` and logits out."""
    def build():
        import keras

        fn = getattr(keras.applications, fn_name)
        model = fn(weights=None, input_shape=(size, size, 3), classes=N_CLASSES, classifier_activation=None, **kw)
        return model, (size, size, 3), 0
    return build


def _torch_models() -> dict[str, Callable[[], tuple[Any, tuple[int, ...], int]]]:
    """name -> builder returning ``(model, input shape without batch, vocabulary size or 0)``."""
    import torch
    from torch import nn

    class LSTMClassifier(nn.Module):
        def __init__(self, vocab: int = 64):
            super().__init__()
            self.emb = nn.Embedding(vocab, 32)
            self.lstm = nn.LSTM(32, 48, batch_first=True)
            self.fc1 = nn.Linear(48, 64)
            self.fc2 = nn.Linear(64, N_CLASSES)

        def forward(self, x):
            out, _ = self.lstm(self.emb(x))
            return self.fc2(torch.relu(self.fc1(out[:, -1])))

    return {
        "hf-resnet": hf("ResNetForImageClassification", "ResNetConfig", embedding_size=16, hidden_sizes=[16, 32, 64],
                        depths=[1, 1, 1], layer_type="bottleneck"),
        "hf-mobilenetv2": hf("MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=32,
                             depth_multiplier=0.35),
        "hf-convnext": hf("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[16, 32], depths=[1, 1],
                          image_size=32),
        "hf-vit": hf("ViTForImageClassification", "ViTConfig", image_size=32, patch_size=8, hidden_size=32,
                     num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        "hf-bert": hf("BertForSequenceClassification", "BertConfig", vocab_size=64, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, max_position_embeddings=32),
        "hf-gpt2": hf("GPT2ForSequenceClassification", "GPT2Config", vocab_size=64, n_embd=32, n_layer=2, n_head=4,
                      n_positions=32, pad_token_id=0, use_cache=False),
        "lstm": lambda: (LSTMClassifier(), (16,), 64),
    }


def _torch_extra_models() -> dict[str, Callable[[], tuple[Any, tuple[int, ...], int]]]:
    """Architectures the pipeline was not developed on (``--extra``): the generalisation check."""
    return {
        "hf-regnet": hf("RegNetForImageClassification", "RegNetConfig", embedding_size=16, hidden_sizes=[16, 32],
                        depths=[1, 1], groups_width=8),
        "hf-efficientnet": hf("EfficientNetForImageClassification", "EfficientNetConfig", image_size=32,
                              width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320),
        "hf-convnextv2": hf("ConvNextV2ForImageClassification", "ConvNextV2Config", num_stages=2,
                            hidden_sizes=[16, 32], depths=[1, 1], image_size=32),
        "hf-deit": hf("DeiTForImageClassification", "DeiTConfig", image_size=32, patch_size=8, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64),
        "hf-distilbert": hf("DistilBertForSequenceClassification", "DistilBertConfig", vocab_size=64, dim=32,
                            n_layers=2, n_heads=4, hidden_dim=64, max_position_embeddings=32),
        "hf-roberta": hf("RobertaForSequenceClassification", "RobertaConfig", vocab_size=64, hidden_size=32,
                         num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                         max_position_embeddings=40, pad_token_id=1),
        "hf-opt": hf("OPTForSequenceClassification", "OPTConfig", vocab_size=64, hidden_size=32, num_hidden_layers=2,
                     num_attention_heads=4, ffn_dim=64, max_position_embeddings=32, word_embed_proj_dim=32,
                     pad_token_id=1, use_cache=False),
        "hf-llama": hf("LlamaForSequenceClassification", "LlamaConfig", vocab_size=64, hidden_size=32,
                       intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32, pad_token_id=0, use_cache=False),
    }


def _logits(out: Any) -> Any:
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    return out


def run_torch(name: str, latency: bool = False, workdir: str | None = None) -> Row:
    import onnxruntime as ort
    import torch

    import compressor.torch as ct

    ort.set_default_logger_severity(3)
    row = Row(name, "torch")
    step = _Step(row)
    torch.manual_seed(0)
    model, shape, vocab = {**_torch_models(), **_torch_extra_models()}[name]()
    model.eval()
    xs, ys = prototypes(shape, N_CALIB * BATCH + N_EVAL, 0, vocab)
    as_t = (lambda a: torch.from_numpy(a)) if not vocab else (lambda a: torch.from_numpy(a).long())
    dummy = as_t(xs[:1])
    tmp = tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(workdir)
    with tmp as d, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with step("dense float"):
                dense_path = os.path.join(d, f"{name}_dense.onnx")
                _torch_float_onnx(copy.deepcopy(model), dummy, dense_path)
                row.size_dense_float = os.path.getsize(dense_path)
                macs0, params0, _ = ct.count_flops_params(model, dummy)
            with step("prune"):
                pruner = ct.L1FilterPruner(model, [{"sparsity": SPARSITY, "op_types": ["default"]}],
                                           dependency_aware=True, dummy_input=dummy)
                pruner.compress()
            with step("speedup"):
                small = ct.speedup_model(pruner, dummy).eval()
                macs1, params1, _ = ct.count_flops_params(small, dummy)
                row.params_ratio, row.macs_ratio = params1 / params0, macs1 / macs0
                row.zeros_left = _torch_zero_weights(small)
            with step("fine-tune"):
                opt = torch.optim.Adam(small.parameters(), 1e-3)
                small.train()
                for i in range(3):
                    xb, yb = as_t(xs[i * BATCH:(i + 1) * BATCH]), torch.from_numpy(ys[i * BATCH:(i + 1) * BATCH])
                    loss = torch.nn.functional.cross_entropy(_logits(small(xb)), yb)
                    opt.zero_grad()
                    loss.backward()
                    opt.step()
                small.eval()
            with step("pruned float"):
                pruned_path = os.path.join(d, f"{name}_pruned.onnx")
                _torch_float_onnx(copy.deepcopy(small), dummy, pruned_path)
                row.size_pruned_float = os.path.getsize(pruned_path)
            with step("ptq"):
                q = ct.PtqQuantizer(small, [{"op_types": ["default"], "quant_types": ["input", "weight", "output"],
                                             "quant_bits": 8}], dummy_input=dummy)
                q.calibrate([as_t(xs[i * BATCH:(i + 1) * BATCH]) for i in range(N_CALIB)])
            with step("int8 export"):
                int8_path = os.path.join(d, f"{name}_int8.onnx")
                q.export_model(os.path.join(d, "m.pt"), os.path.join(d, "cal.pt"), onnx_path=int8_path,
                               dummy_input=dummy)
                row.size_int8 = os.path.getsize(int8_path)
            with step("artifact"):
                so = ort.SessionOptions()
                so.intra_op_num_threads = 1
                so.optimized_model_filepath = os.path.join(d, f"{name}_int8_opt.onnx")
                sess = ort.InferenceSession(int8_path, so, providers=["CPUExecutionProvider"])
                row.int_kernels, row.float_kernels = _onnx_kernels(so.optimized_model_filepath)
                feed_name = sess.get_inputs()[0].name
                x_eval = xs[N_CALIB * BATCH:]
                got = np.concatenate([sess.run(None, {feed_name: x_eval[i:i + 16]})[0]
                                      for i in range(0, N_EVAL, 16)])
                sess.run(None, {feed_name: x_eval[:1]})
                row.dynamic_batch = True
                with torch.no_grad():
                    ref = _logits(small(as_t(x_eval))).numpy()
                row.agreement, row.rel_error = _agreement(got, ref)
            if latency:
                with step("latency"):
                    row.latency = _onnx_latency({"dense": dense_path, "int8": int8_path}, xs)
        except _Stop:
            pass
        row.warnings = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
    return row


def _torch_float_onnx(model: Any, dummy: Any, path: str) -> None:
    """The float ONNX a user exports by hand (logits only, dynamic batch): the size/latency baseline."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return _logits(self.inner(x))

    wrapped = LogitsOnly(model).eval()
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            torch.onnx.export(wrapped, (dummy,), path, dynamo=False, input_names=["input"],
                              dynamic_axes={"input": {0: "batch"}})
        except Exception:  # noqa: BLE001  (the TorchScript exporter lacks an op: the dynamo exporter)
            two = dummy.repeat(2, *([1] * (dummy.dim() - 1)))  # torch.export specialises an axis of size 1
            torch.onnx.export(wrapped, (two,), path, dynamo=True, external_data=False, input_names=["input"],
                              dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
            import onnx

            proto = onnx.load(path)  # without the per-node stack traces (as compressor's own exports)
            for n in proto.graph.node:
                del n.metadata_props[:]
            onnx.save(proto, path)


def _torch_zero_weights(model: Any) -> int:
    """Exact zeros left in the weights of conv / linear layers (what speedup could not remove)."""
    import torch

    from compressor.torch.graph import module_kind

    n = 0
    for m in model.modules():  # (not e.g. ConvNeXt V2's GRN gamma [1, 1, 1, C], which starts at zero)
        w = getattr(m, "weight", None)
        if isinstance(w, torch.Tensor) and module_kind(m)[0] in ("conv", "depthwise", "group_conv", "linear"):
            n += int((w == 0).sum())
    return n


def _onnx_kernels(path: str) -> tuple[int, list[str]]:
    """(integer matmul/conv kernels, names of float conv/matmul nodes with a constant weight) in a graph."""
    import onnx

    graph = onnx.load(path).graph
    consts = {i.name for i in graph.initializer}
    consts |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    ints = sum(n.op_type in INT_ONNX for n in graph.node)
    floats = [f"{n.op_type}:{n.name}" for n in graph.node
              if n.op_type in FLOAT_WEIGHTED_ONNX and any(i in consts for i in n.input[1:3])]
    floats += [f"{n.op_type} (recurrent, float)" for n in graph.node if n.op_type in RECURRENT_ONNX]
    return ints, floats


def _onnx_latency(paths: dict[str, str], xs: np.ndarray) -> dict[tuple[str, int], float]:
    import onnxruntime as ort

    from benchmarks._interleave import interleaved_medians

    fns = {}
    for key, path in paths.items():
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1  # 1 thread, as RESULTS.md reports
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        name = sess.get_inputs()[0].name
        for b in (1, 16):
            fns[key, b] = (lambda s=sess, n=name, x=xs[:b]: s.run(None, {n: x}))
    return interleaved_medians(fns, rounds=7, calls=5)


# ------------------------------------------------------------------------------------------------ Keras


def _keras_models() -> dict[str, Callable[[], tuple[Any, tuple[int, ...], int]]]:
    import keras

    def text_transformer():
        vocab, seq, d = 64, 16, 32
        inp = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, d)(inp)
        a = keras.layers.MultiHeadAttention(num_heads=4, key_dim=8, name="mha")(h, h)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, a]))
        f = keras.layers.Dense(64, activation="relu", name="ffn1")(h)
        f = keras.layers.Dense(d, name="ffn2")(f)
        h = keras.layers.LayerNormalization()(keras.layers.Add()([h, f]))
        out = keras.layers.Dense(N_CLASSES, name="head")(keras.layers.GlobalAveragePooling1D()(h))
        return keras.Model(inp, out), (seq,), vocab

    def lstm():
        vocab, seq = 64, 16
        inp = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, 32)(inp)
        h = keras.layers.LSTM(48)(h)
        h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
        return keras.Model(inp, keras.layers.Dense(N_CLASSES, name="fc2")(h)), (seq,), vocab

    return {
        "keras-resnet50": app("ResNet50"),
        "keras-mobilenetv2": app("MobileNetV2", alpha=0.35),
        "keras-efficientnetb0": app("EfficientNetB0"),
        "keras-mobilenetv3small": app("MobileNetV3Small", alpha=0.75, minimalistic=False),
        "keras-densenet121": app("DenseNet121"),
        "keras-convnexttiny": app("ConvNeXtTiny"),
        "keras-text-transformer": text_transformer,
        "keras-lstm": lstm,
    }


def _keras_extra_models() -> dict[str, Callable[[], tuple[Any, tuple[int, ...], int]]]:
    """Architectures the pipeline was not developed on (``--extra``): the generalisation check."""
    import keras

    def gru():
        vocab, seq = 64, 16
        inp = keras.Input((seq,), dtype="int32")
        h = keras.layers.Embedding(vocab, 32)(inp)
        h = keras.layers.Bidirectional(keras.layers.GRU(24))(h)
        h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
        return keras.Model(inp, keras.layers.Dense(N_CLASSES, name="fc2")(h)), (seq,), vocab

    return {
        "keras-vgg16": app("VGG16"),
        "keras-xception": app("Xception", size=71),
        "keras-efficientnetv2b0": app("EfficientNetV2B0"),
        "keras-resnet50v2": app("ResNet50V2"),  # pre-activation residual joins (RegNetX002 is not in Keras 3)
        "keras-nasnetmobile": app("NASNetMobile", size=32),
        "keras-mobilenet": app("MobileNet", alpha=0.25),
        "keras-bigru": gru,
    }


def run_tf(name: str, latency: bool = False, workdir: str | None = None, tflite_int8: str = "auto") -> Row:
    import keras
    import tensorflow as tf

    import compressor.tf as ct

    row = Row(name, "tf")
    step = _Step(row)
    keras.utils.set_random_seed(0)
    try:  # a builder Keras lacks (keras.applications.RegNetX002 is gone in Keras 3) is a failed row, not a crash
        model, shape, vocab = {**_keras_models(), **_keras_extra_models()}[name]()
    except (AttributeError, ImportError, ValueError) as e:
        row.failed, row.error = "build", f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return row
    xs, ys = prototypes(shape, N_CALIB * BATCH + N_EVAL, 0, vocab)
    if vocab:
        xs = xs.astype(np.int32)
    tmp = tempfile.TemporaryDirectory() if workdir is None else contextlib.nullcontext(workdir)
    with tmp as d, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with step("dense float"):
                dense_path = os.path.join(d, f"{name}_dense.tflite")
                _tflite_float(model, dense_path)
                row.size_dense_float = os.path.getsize(dense_path)
                macs0, params0, _ = ct.count_flops_params(model)
                init_zeros = _keras_zero_weights(model)  # exact zeros of the random init (2 in ResNet50)
            with step("prune"):
                pruner = ct.L1FilterPruner(model, [{"sparsity": SPARSITY, "op_types": ["default"]}],
                                           dependency_aware=True)
                pruner.compress()
            with step("speedup"):
                small = ct.speedup_model(pruner)
                macs1, params1, _ = ct.count_flops_params(small)
                row.params_ratio, row.macs_ratio = params1 / params0, macs1 / macs0
                row.zeros_left = max(0, _keras_zero_weights(small) - init_zeros)
            with step("fine-tune"):
                small.compile(optimizer=keras.optimizers.Adam(1e-3),
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                small.fit(xs[:3 * BATCH], ys[:3 * BATCH], batch_size=BATCH, epochs=1, verbose=0)
            with step("pruned float"):
                pruned_path = os.path.join(d, f"{name}_pruned.tflite")
                _tflite_float(small, pruned_path)
                row.size_pruned_float = os.path.getsize(pruned_path)
            with step("ptq"):
                q = ct.PtqQuantizer(small, [{"op_types": ["default"], "quant_types": ["input", "weight", "output"],
                                             "quant_bits": 8}])
                q.calibrate([xs[i * BATCH:(i + 1) * BATCH] for i in range(N_CALIB)])
            with step("int8 export"):
                int8_path = os.path.join(d, f"{name}_int8.tflite")
                kw = {} if vocab else {"inference_input_type": tf.int8}
                with contextlib.redirect_stdout(io.StringIO()):
                    q.export_model(os.path.join(d, "m.keras"), os.path.join(d, "cal.json"), tflite_path=int8_path,
                                   inference_output_type=tf.int8, tflite_int8=tflite_int8, **kw)
                row.size_int8 = os.path.getsize(int8_path)
            with step("artifact"):
                x_eval = xs[N_CALIB * BATCH:]
                row.int_kernels, row.float_kernels = _tflite_kernels(int8_path)
                got = _tflite_run(int8_path, x_eval, 1)
                try:  # a batch of 16 as well, if the signature's batch axis is dynamic
                    _tflite_run(int8_path, x_eval[:16], 16)
                    row.dynamic_batch = True
                except RuntimeError:
                    row.dynamic_batch = False
                ref = np.asarray(small(x_eval, training=False))
                row.agreement, row.rel_error = _agreement(got, ref)
            if latency:
                with step("latency"):
                    row.latency = _tflite_latency({"dense": dense_path, "int8": int8_path}, xs)
        except _Stop:
            pass
        row.warnings = sorted({f"{w.category.__name__}: {str(w.message)[:160]}" for w in caught})
    return row


def _tflite_float(model: Any, path: str) -> None:
    """The float TFLite a user converts by hand (recurrent layers unrolled for a fixed sequence length, as
    compressor's own exports do): the size/latency baseline."""
    import tensorflow as tf

    from compressor.tf.tflite import convert_recurrent

    with contextlib.redirect_stdout(io.StringIO()):
        flat = convert_recurrent(model, lambda: tf.lite.TFLiteConverter.from_keras_model(model))
        if flat is None:
            flat = tf.lite.TFLiteConverter.from_keras_model(model).convert()
    with open(path, "wb") as f:
        f.write(flat)


def _keras_zero_weights(model: Any) -> int:
    """Exact zeros in the kernels (run_tf subtracts those of the unpruned model: keras.applications' random
    init draws a few exact zeros, e.g. 2 of ResNet50's 23.5 M kernel weights, which no pruner made)."""
    import keras

    n, seen = 0, set()
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, (keras.layers.Embedding, keras.layers.BatchNormalization)):
            continue
        for w in layer.trainable_weights:  # kernels only: an EinsumDense bias is 2-D and starts at zero
            if len(w.shape) >= 2 and "kernel" in w.path.rsplit("/", 1)[-1] and w.path not in seen:
                seen.add(w.path)
                n += int(np.sum(np.asarray(w) == 0))
    return n


def _interpreter(path: str, batch: int):
    import tensorflow as tf

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        interp = tf.lite.Interpreter(model_path=path, num_threads=1)
    inp = interp.get_input_details()[0]
    if inp["shape"][0] != batch:
        interp.resize_tensor_input(inp["index"], [batch, *inp["shape"][1:]], strict=True)
    interp.allocate_tensors()
    return interp


def _tflite_run(path: str, x: np.ndarray, batch: int) -> np.ndarray:
    interp = _interpreter(path, batch)
    inp, out = interp.get_input_details()[0], interp.get_output_details()[0]
    outs = []
    for i in range(0, len(x), batch):
        xb = x[i:i + batch]
        if inp["dtype"] in (np.int8, np.uint8) and xb.dtype.kind == "f":
            s, z = inp["quantization"]
            info = np.iinfo(inp["dtype"])
            xb = np.clip(np.round(xb / s + z), info.min, info.max)
        interp.set_tensor(inp["index"], xb.astype(inp["dtype"]))
        interp.invoke()
        y = interp.get_tensor(out["index"]).astype(np.float32)
        if out["dtype"] in (np.int8, np.uint8):
            s, z = out["quantization"]
            y = (y - z) * s
        outs.append(y)
    return np.concatenate(outs)


def _tflite_kernels(path: str) -> tuple[int, list[str]]:
    """(int8 weighted kernels, float ones): CONV_2D / FULLY_CONNECTED / BATCH_MATMUL ... with a constant
    operand (a layer's weight); a BATCH_MATMUL of two activations (attention scores) is no weighted kernel."""
    interp = _interpreter(path, 1)
    tensors = {t["index"]: t for t in interp.get_tensor_details()}
    ops = interp._get_ops_details()
    variable = {i for op in ops for i in op["outputs"]} | {d["index"] for d in interp.get_input_details()}
    ints, floats = 0, []
    for op in ops:
        operands = [i for i in op["inputs"][:2] if i >= 0]
        if op["op_name"] not in TFLITE_WEIGHTED or all(i in variable for i in operands):
            continue
        dtypes = [tensors[i]["dtype"] for i in operands]
        if all(dt in (np.int8, np.uint8, np.int16) for dt in dtypes):
            ints += 1
        else:
            floats.append(f"{op['op_name']}#{op['index']}")
    return ints, floats


def _tflite_latency(paths: dict[str, str], xs: np.ndarray) -> dict[tuple[str, int], float]:
    from benchmarks._interleave import interleaved_medians

    fns = {}
    for key, path in paths.items():
        for b in (1, 16):
            interp = _interpreter(path, b)
            inp = interp.get_input_details()[0]
            xb = np.zeros([b, *inp["shape"][1:]], inp["dtype"])

            def call(it=interp, i=inp["index"], v=xb):
                it.set_tensor(i, v)
                it.invoke()
            fns[key, b] = call
    return interleaved_medians(fns, rounds=7, calls=5)


# ------------------------------------------------------------------------------------------------- main


def model_names(backend: str = "all", extra: bool = False) -> list[str]:
    names = []
    if backend in ("torch", "all"):
        names += list(_torch_extra_models() if extra else _torch_models())
    if backend in ("tf", "all"):
        names += list(_keras_extra_models() if extra else _keras_models())
    return names


def run_one(name: str, latency: bool = False, workdir: str | None = None, tflite_int8: str = "auto") -> Row:
    if name.startswith("keras-"):
        return run_tf(name, latency=latency, workdir=workdir, tflite_int8=tflite_int8)
    return run_torch(name, latency=latency, workdir=workdir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["torch", "tf", "all"], default="all")
    p.add_argument("--models", default="", help="comma-separated subset (default: all of the backend)")
    p.add_argument("--latency", action="store_true", help="also time the int8 vs dense float artifacts")
    p.add_argument("--extra", action="store_true", help="the architectures not developed on (generalisation)")
    p.add_argument("--warnings", action="store_true", help="print the warnings each run raised")
    p.add_argument("--tflite-int8", choices=["auto", "kernels", "all"], default="auto",
                   help="Keras: which ops the .tflite runs in int8 (PtqQuantizer.export_model(tflite_int8=...))")
    args = p.parse_args(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    names = args.models.split(",") if args.models else model_names(args.backend, args.extra)
    print(HEADER, flush=True)
    rows = []
    for name in names:
        t0 = time.perf_counter()
        row = run_one(name, latency=args.latency, tflite_int8=args.tflite_int8)
        rows.append(row)
        print(row.markdown() + f" <!-- {time.perf_counter() - t0:.0f} s -->", flush=True)
        if args.warnings:
            for w in row.warnings:
                print(f"    {w}")
    print(f"\n{sum(r.clean for r in rows)} of {len(rows)} clean")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
