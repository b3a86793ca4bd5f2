"""``compressor demo``: compress a small CNN end to end on every installed backend and print what it cost.

Per backend: train a small CNN (scikit-learn's bundled 8x8 digits by default; MNIST with ``--data mnist
--data-dir DIR``), then from the same dense weights (a) prune it gradually to 80 % with ``AGPPruner``
while fine-tuning, (b) quantize it to int8 with ``QAT_Quantizer`` while fine-tuning (fake quantization:
a training-time simulation of int8, in float) and (c) the pipeline that ships: prune 50 % of the channels
of conv1, conv2 and fc1 with a dependency-aware ``L1FilterPruner``, remove them with ``speedup_model``,
fine-tune the smaller model briefly, quantize it to int8 with ``PtqQuantizer`` and export the artifact
(an integer ONNX run in onnxruntime on torch, a full-integer TFLite run in ``tf.lite.Interpreter`` on
Keras). The first table gives, for the framework models, test accuracy, the sparsity of the EXPORTED
pruned weights, parameters and MACs per sample (``count_flops_params``), model bytes, the size of each
saved file, and inference (test set, one batch) and training-step times relative to the dense model,
measured interleaved. The second table is measured ON THE ARTIFACT FILES, loaded in their runtime: the
dense float file, the structured float file and the shipped int8 file (accuracy, file size, latency at
batch 1 and on the whole test set, interleaved); the last line says what the shipped file gains over
the dense float one. Seeds are fixed.

This module is the backend-neutral driver (arguments, the stage sequence, the table and the plot). The
per-backend training code is a small "harness" per backend
(:class:`compressor.app.demo_torch.TorchHarness`, :class:`compressor.app.demo_tf.TfHarness`, also
importable from here) that the examples (``examples/``) reuse with their own models; :func:`get_harness`
imports only the one asked for. Importing this module imports neither framework.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.quant import quantized_bytes

# TorchHarness / TfHarness stay importable from here (module __getattr__) but out of __all__: a star import
# must not import a framework
from ..core.timing import interleaved_times
from .data import DataError, Dataset, load_dataset

__all__ = ["Artifact", "BackendResult", "Schedule", "get_harness", "interleaved_times", "main", "plot_points",
           "run_demo", "save_plot", "summary_line"]

BACKENDS = ("torch", "tf")
FRAMEWORK = {"torch": "torch", "tf": "tensorflow"}
#: what each backend's artifact needs besides the framework (torch: the ONNX exporter and onnxruntime; tf: the
#: TFLite converter and interpreter ship with tensorflow)
ARTIFACT_NEEDS = {"torch": ("onnx", "onnxruntime"), "tf": ()}
SPARSITY = 0.8
LAYERS = ("conv1", "conv2", "fc1", "fc2")
#: channel sparsity of the structured variant (the classifier fc2 keeps its outputs)
STRUCT_SPARSITY = 0.5
STRUCT_LAYERS = ("conv1", "conv2", "fc1")


@dataclass(frozen=True)
class Schedule:
    """Epochs, batch size and learning rates of one demo run."""

    dense_epochs: int
    prune_epochs: int  # AGP fine-tuning epochs (the ramp ends at ``agp_end_epoch``, the rest recovers)
    agp_end_epoch: int
    quant_epochs: int
    struct_epochs: int = 2  # fine-tuning epochs after one-shot filter pruning, before speedup
    batch_size: int = 32
    lr: float = 2e-3
    finetune_lr: float = 5e-4
    n_train: int | None = None  # None = the whole split
    n_test: int | None = None
    timing_rounds: int = 5
    timing_steps: int = 10
    infer_rounds: int = 10  # inference timings of the test set per model (interleaved, after a warm-up)
    artifact_rounds: int = 30  # interleaved rounds of the artifact timings (each: every file, batch 1 and test set)
    artifact_calls: int = 20  # batch-1 calls per file and round (their mean is one sample)
    calib_samples: int = 256  # training images PtqQuantizer calibrates on


SCHEDULES: dict[tuple[str, bool], Schedule] = {
    ("digits", False): Schedule(dense_epochs=20, prune_epochs=15, agp_end_epoch=8, quant_epochs=4, struct_epochs=5),
    ("digits", True): Schedule(dense_epochs=8, prune_epochs=4, agp_end_epoch=3, quant_epochs=1, struct_epochs=2,
                               timing_rounds=2, infer_rounds=3, artifact_rounds=3, artifact_calls=5),
    ("mnist", False): Schedule(dense_epochs=3, prune_epochs=4, agp_end_epoch=3, quant_epochs=1, struct_epochs=1,
                               batch_size=128),
    ("mnist", True): Schedule(dense_epochs=2, prune_epochs=3, agp_end_epoch=2, quant_epochs=1, struct_epochs=1,
                              batch_size=64, n_train=6000, n_test=2000, timing_rounds=3, infer_rounds=5,
                              artifact_rounds=5, artifact_calls=5),
}


def agp_config(s: Schedule) -> list[dict[str, Any]]:
    """AGP from 0 to 80 % over ``agp_end_epoch`` epochs on every conv/dense layer (same list for both backends)."""
    return [{"initial_sparsity": 0.0, "final_sparsity": SPARSITY, "start_epoch": 0, "end_epoch": s.agp_end_epoch,
             "frequency": 1, "op_types": ["default"]}]


def struct_config() -> list[dict[str, Any]]:
    """Dependency-aware filter pruning: half the channels of the convs and of the hidden dense layer."""
    return [{"sparsity": STRUCT_SPARSITY, "op_names": list(STRUCT_LAYERS)}]


#: int8 weights and activations (layer outputs) everywhere; the first layer also quantizes its input.
QAT_CONFIG: list[dict[str, Any]] = [
    {"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]},
    {"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_names": ["conv1"]},
]


#: post-training int8 of the shipped model: every conv/dense layer's input, weight and output (8-bit; per-channel
#: symmetric weights, per-tensor activations: PtqQuantizer's defaults), so the whole network runs in int8
PTQ_CONFIG: list[dict[str, Any]] = [{"quant_types": ["input", "weight", "output"], "quant_bits": 8,
                                     "op_types": ["default"]}]

#: the artifact files (and their labels), in table order: the baseline, the pruned float, the shipped int8
ARTIFACTS = {"dense": "dense float", "struct": "structured float", "shipped": "structured + PTQ int8 (shipped)"}


# ---------------------------------------------------------------------------------------------- results
@dataclass
class Artifact:
    """One exported file, loaded in its runtime, and what was measured ON it (seconds, bytes, [0, 1]).

    ``runner`` is the loaded file (:class:`compressor.app.demo_torch.OnnxRunner` /
    :class:`compressor.app.demo_tf.TfliteRunner`; its ``session`` / ``interpreters`` produced the
    numbers); ``path`` is the file (it exists after the demo only with ``out_dir``)."""

    label: str
    path: str
    runtime: str
    runner: Any
    accuracy: float
    file_bytes: int
    latency_1: float  # median seconds of one batch-1 call
    latency_all: float  # median seconds of the whole test set in one call
    ranges: dict[str, tuple[float, float]]  # 'batch 1' / 'test set' -> (min, max) seconds over rounds
    int8: str  # the evidence: integer kernels in onnxruntime's optimised graph / int8 tensors of the .tflite


@dataclass
class BackendResult:
    """What the demo measured on one backend (accuracies in [0, 1], sizes in bytes, times in seconds)."""

    backend: str
    data: str
    acc_dense: float
    acc_pruned: float
    acc_quant: float
    sparsity: float  # zeros / weights over the pruned layers of the exported model
    layer_sparsity: dict[str, float]
    dense_bytes: int  # float32 parameters
    mask_bytes: int  # bool masks held while training with the pruner
    int8_bytes: int  # int8 weights + float32 rest + scale/zero point per quantized tensor
    step_dense: float  # median train-step seconds
    step_pruned: float
    step_quant: float
    acc_struct: float = 0.0  # structured (dependency-aware L1 filter pruning) + speedup
    step_struct: float = 0.0
    struct_bytes: int = 0  # float32 parameters of the sped-up model
    struct_channels: dict[str, tuple[int, int]] = field(default_factory=dict)  # layer -> (before, after)
    # per variant ('dense', 'pruned', 'quant', 'struct'): count_flops_params numbers, saved file bytes and
    # median inference seconds on the whole test set as one batch
    params: dict[str, int] = field(default_factory=dict)
    macs: dict[str, int] = field(default_factory=dict)
    file_bytes: dict[str, int] = field(default_factory=dict)
    infer: dict[str, float] = field(default_factory=dict)
    infer_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    n_infer: int = 0  # images per inference batch
    file_format: str = ""  # what file_bytes measured ('state_dict .pt', '.keras')
    step_ranges: dict[str, tuple[float, float]] = field(default_factory=dict)
    seconds: float = 0.0
    description: str = ""
    acc_struct_oneshot: float = 0.0  # right after speedup_model, before the fine-tune
    acc_ptq_sim: float = 0.0  # the PtqQuantizer's fake-quant model in the framework (before export)
    #: 'dense' / 'struct' / 'shipped' (see :data:`ARTIFACTS`) -> the file measured in its runtime
    artifacts: dict[str, Artifact] = field(default_factory=dict)
    artifact_format: str = ""  # 'ONNX' / 'TFLite'

    @property
    def pruned_overhead(self) -> float:
        return self.step_pruned / self.step_dense

    @property
    def quant_overhead(self) -> float:
        return self.step_quant / self.step_dense

    @property
    def struct_overhead(self) -> float:
        return self.step_struct / self.step_dense

    def infer_ratio(self, variant: str) -> float:
        return self.infer[variant] / self.infer["dense"]

    def table(self) -> str:
        """The per-backend result table (plain text)."""
        ms = 1e3
        variants = ("dense", "pruned", "quant", "struct")
        has_struct = bool(self.params.get("struct"))

        def per(values: dict[str, Any], fmt: Callable[[str, Any], str]) -> list[str]:
            return [fmt(v, values[v]) if v in values else "-" for v in variants]

        def rel(v: str, n: int, base: dict[str, int]) -> str:
            return f"{n:,}" if v == "dense" else f"{n:,} ({n / base['dense']:.2f}x)"

        rows = [
            ("", "dense", f"pruned (AGP {SPARSITY:.0%})", "QAT int8 (fake-quant simulation)",
             f"structured ({STRUCT_SPARSITY:.0%} ch.) + speedup"),
            ("test accuracy", _pct(self.acc_dense), _pct(self.acc_pruned), _pct(self.acc_quant),
             _pct(self.acc_struct) if has_struct else "-"),
            ("weight sparsity (exported)", "-", _pct(self.sparsity), "-", "-"),
        ]
        if self.params:
            rows.append(("params", *per(self.params, lambda v, n: rel(v, n, self.params))))
        if self.macs:
            rows.append(("MACs / sample", *per(self.macs, lambda v, n: rel(v, n, self.macs))))
        rows.append(("model bytes", f"{self.dense_bytes:,} fp32", f"+{self.mask_bytes:,} bool masks",
                     f"{self.int8_bytes:,} int8 export", f"{self.struct_bytes:,} fp32" if has_struct else "-"))
        if self.file_bytes:
            rows.append((f"saved file ({self.file_format})", *per(self.file_bytes, lambda v, n: f"{n:,} B")))
        if self.infer:
            # the QAT model computes in float with fake quantization: its speed says nothing about int8's
            infer = {**self.infer, "quant": None}
            rows.append((f"inference ({self.n_infer} images), median", *per(
                infer, lambda v, t: "simulation, not timed" if t is None else f"{t * ms:.2f} ms" + (
                    "" if v == "dense" else f" ({self.infer_ratio(v):.2f}x)"))))
        rows.append(("train step, median", f"{self.step_dense * ms:.2f} ms",
                     f"{self.step_pruned * ms:.2f} ms ({self.pruned_overhead:.2f}x)",
                     f"{self.step_quant * ms:.2f} ms ({self.quant_overhead:.2f}x)",
                     f"{self.step_struct * ms:.2f} ms ({self.struct_overhead:.2f}x)" if self.step_struct else "-"))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"== {self.backend}: {self.description} ({self.seconds:.1f} s) =="]
        for r in rows:
            lines.append("  " + "   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        per_layer = ", ".join(f"{k} {_pct(v)}" for k, v in self.layer_sparsity.items())
        lines.append(f"  per-layer sparsity (AGP): {per_layer}")
        if self.struct_channels:
            chans = ", ".join(f"{k} {a}->{b}" for k, (a, b) in self.struct_channels.items())
            lines.append(f"  structured channels kept: {chans}")
        if self.infer_ranges:
            spread = ", ".join(f"{k} {lo * ms:.2f}-{hi * ms:.2f}" for k, (lo, hi) in self.infer_ranges.items())
            lines.append(f"  inference min-max (ms, interleaved rounds): {spread}")
        if self.step_ranges:
            spread = ", ".join(f"{k} {lo * ms:.2f}-{hi * ms:.2f}" for k, (lo, hi) in self.step_ranges.items())
            lines.append(f"  train step min-max (ms, interleaved rounds): {spread}")
        lines.append("  (framework models. Only the structured column is really smaller and faster: speedup_model "
                     "removed its pruned channels; AGP masks keep every dense shape, so its file and MACs are the "
                     "dense ones; QAT's fake quantization simulates int8 in float while training: it shrinks only "
                     "the int8 export, and its speed is not int8's. What ships is measured below, on the files)")
        if self.artifacts:
            lines.append(self.artifact_table())
        return "\n".join(lines)

    def artifact_table(self) -> str:
        """The table measured on the artifact files in their runtime (plain text)."""
        ms = 1e3
        arts = [self.artifacts[k] for k in ARTIFACTS if k in self.artifacts]
        base = self.artifacts["dense"]

        def rel(a: Artifact, v: float, b: float, fmt: str) -> str:
            return fmt.format(v) + ("" if a is base else f" ({v / b:.2f}x)")

        rows = [
            (f"{self.artifact_format} files", *(a.label for a in arts)),
            ("file", *(os.path.basename(a.path) for a in arts)),
            ("test accuracy (in the runtime)", *(_pct(a.accuracy) for a in arts)),
            ("file size", *(rel(a, a.file_bytes, base.file_bytes, "{:,.0f} B") for a in arts)),
            ("latency batch 1, median", *(rel(a, a.latency_1 * ms, base.latency_1 * ms, "{:.3f} ms") for a in arts)),
            (f"latency {self.n_infer} images, median",
             *(rel(a, a.latency_all * ms, base.latency_all * ms, "{:.2f} ms") for a in arts)),
            ("int8 in the file", *(a.int8 for a in arts)),
        ]
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = [f"  -- measured on the files, in {base.runtime}; timings interleaved --"]
        for r in rows:
            lines.append("  " + "   ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip())
        spread = "; ".join(f"{a.label}: " + ", ".join(f"{k} {lo * ms:.3f}-{hi * ms:.3f}" for k, (lo, hi) in a.ranges.items())
                           for a in arts)
        lines.append(f"  latency min-max (ms, interleaved rounds): {spread}")
        return "\n".join(lines)


def _pct(v: float) -> str:
    return f"{100.0 * v:.2f} %"


def _faster(ratio: float) -> str:
    """``dense time / new time`` in words: '3.1x faster', '1.2x slower', 'as fast'."""
    if round(ratio, 1) == 1.0:
        return "as fast"
    return f"{ratio:.1f}x faster" if ratio > 1 else f"{1 / ratio:.1f}x slower"


def summary_line(r: BackendResult) -> str:
    """What the user gets, in words, from the numbers measured on the files: the shipped int8 file vs the
    dense float file, in the same runtime."""
    d, s = r.artifacts["dense"], r.artifacts["shipped"]
    pp = 100.0 * (s.accuracy - d.accuracy)
    runtime = s.runtime.split(" (")[0].split(",")[0]
    line = (f"{r.backend}: the shipped int8 {r.artifact_format} file is {d.file_bytes / s.file_bytes:.1f}x smaller, "
            f"{_faster(d.latency_1 / s.latency_1)} at batch 1 and {_faster(d.latency_all / s.latency_all)} on "
            f"{r.n_infer} images ({runtime}), {pp:+.1f} pp accuracy ({_pct(s.accuracy)} vs {_pct(d.accuracy)}), "
            f"compared with the dense float {r.artifact_format} file")
    st = r.artifacts.get("struct")
    if st is not None and st.latency_all < s.latency_all / 1.1:
        # say it when int8 costs speed here: on the demo CNN's 1-16-channel convolutions onnxruntime's
        # QLinearConv is slower than its float (NCHWc) Conv, though its QGemm beats the float Gemm; wider models
        # gain (benchmarks/RESULTS.md, int8 latency: ResNet-18 int8 ONNX 2x faster at batch 1)
        line += (f"; the structured float file runs {s.latency_all / st.latency_all:.1f}x faster than the int8 one "
                 f"on {r.n_infer} images: this model's layers are too narrow for the runtime's int8 kernels to pay off")
    return line


def measure_artifacts(h: Any, paths: dict[str, str], x: np.ndarray, y: np.ndarray, s: Schedule,
                      threads: int | None) -> dict[str, Artifact]:
    """Load every file of ``paths`` ('dense' / 'struct' / 'shipped' -> path) in the harness's runtime and
    measure on it: accuracy on ``(x, y)`` (the whole set in one call), size, and latency at batch 1 and on
    all of ``x``, interleaved over the files."""
    runners = {k: h.load_artifact(p, threads) for k, p in paths.items()}
    acc = {k: artifact_accuracy(r, x, y) for k, r in runners.items()}
    one, full = x[:1], x
    fns: dict[str, Callable[[], Any]] = {}
    for k, r in runners.items():
        f1, fa = r.feed(one), r.feed(full)
        fns[f"{k}|1"] = lambda r=r, f=f1: r.run(f)
        fns[f"{k}|all"] = lambda r=r, f=fa: r.run(f)
    # batch 1 is timed as the mean of `artifact_calls` calls per round, the test set as one call per round
    t1 = interleaved_times({k: f for k, f in fns.items() if k.endswith("|1")}, s.artifact_rounds, s.artifact_calls)
    ta = interleaved_times({k: f for k, f in fns.items() if k.endswith("|all")}, s.artifact_rounds, 1)
    med = statistics.median
    out = {}
    for k, r in runners.items():
        b1, ball = t1[f"{k}|1"], ta[f"{k}|all"]
        out[k] = Artifact(label=ARTIFACTS[k], path=paths[k], runtime=r.runtime, runner=r, accuracy=acc[k],
                          file_bytes=os.path.getsize(paths[k]), latency_1=med(b1), latency_all=med(ball),
                          ranges={"batch 1": (min(b1), max(b1)), "test set": (min(ball), max(ball))},
                          int8=r.int8_evidence())
    return out


def artifact_accuracy(runner: Any, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of a loaded artifact on ``(x, y)``: all of ``x`` in one call of the runtime."""
    return float((np.asarray(runner(x)).argmax(1) == y).mean())


# ---------------------------------------------------------------------------------------------- harnesses
def get_harness(backend: str, device: str = "cpu") -> Any:
    """The training harness of ``backend`` ('torch': :class:`compressor.app.demo_torch.TorchHarness`,
    'tf': :class:`compressor.app.demo_tf.TfHarness`), imported only here: running one backend never
    imports the other framework."""
    if backend == "torch":
        from .demo_torch import TorchHarness

        return TorchHarness(device)
    if backend == "tf":
        from .demo_tf import TfHarness

        return TfHarness(device)
    raise ValueError(f"unknown backend {backend!r}; allowed: {list(BACKENDS)}")


def __getattr__(name: str) -> Any:
    """``compressor.app.demo.TorchHarness`` / ``TfHarness`` (defined in :mod:`compressor.app.demo_torch` /
    :mod:`compressor.app.demo_tf`; imported on use)."""
    if name == "TorchHarness":
        from .demo_torch import TorchHarness

        return TorchHarness
    if name == "TfHarness":
        from .demo_tf import TfHarness

        return TfHarness
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def installed_backends() -> list[str]:
    return [b for b in BACKENDS if importlib.util.find_spec(FRAMEWORK[b]) is not None]


# ---------------------------------------------------------------------------------------------- the demo
def _param_layer(key: str) -> tuple[str, str]:
    """``'fc1.weight'`` / ``'cnn/fc1/kernel'`` -> (layer path with '.' separators, parameter name)."""
    parts = key.replace("/", ".").rsplit(".", 1)
    return (parts[0], parts[1]) if len(parts) == 2 else ("", parts[0])


def int8_export_bytes(params: dict[str, int], calibration: dict[str, dict[str, Any]]) -> int:
    """Bytes of an int8 deployment: quantized weights at their bit width, every other parameter as 4
    bytes (float32, or int32 biases), plus a 4-byte scale and a 4-byte zero point per quantized
    tensor (per channel for per-channel schemes)."""
    total = 0
    quantized = set()
    for layer, entry in calibration.items():
        types = entry.get("quant_types", ())
        if "weight" in types:
            name = layer.replace("/", ".")
            for key in params:
                path, pname = _param_layer(key)
                if pname in ("weight", "kernel") and (path == name or path.endswith("." + name)):
                    quantized.add(key)
                    total += quantized_bytes(params[key], int(entry["weight_bits"]))
                    break
        for t in types:
            scale = entry.get(f"{t}_scale")
            if scale is not None:
                total += 8 * (len(scale) if isinstance(scale, list) else 1)
    total += sum(4 * n for k, n in params.items() if k not in quantized)
    return total


def _sparsity(weights: dict[str, np.ndarray]) -> tuple[float, dict[str, float]]:
    per = {k: float((w == 0).mean()) for k, w in weights.items()}
    zeros = sum(int((w == 0).sum()) for w in weights.values())
    return zeros / max(sum(w.size for w in weights.values()), 1), per


def run_backend(backend: str, ds: Dataset, schedule: Schedule, seed: int = 0, progress: bool | None = None,
                device: str = "cpu", threads: int | None = 1, log: Callable[[str], None] = print,
                out_dir: str | None = None) -> BackendResult:
    """Train the demo CNN on one backend, prune it (AGP), quantize it (QAT), ship it (structured pruning,
    speedup, fine-tune, PTQ int8, the artifact file) and measure everything. The files go to ``out_dir``
    (kept) or to a temporary directory (removed at the end)."""
    h = get_harness(backend, device)
    with h.threads(threads), contextlib.ExitStack() as stack:
        if out_dir is None:
            out_dir = stack.enter_context(tempfile.TemporaryDirectory())
        os.makedirs(out_dir, exist_ok=True)
        return _run_backend(h, ds, schedule, seed, progress, log, out_dir, threads)


def _finetune_stage(h: Any, ds: Dataset, s: Schedule, dense: Any, make: Callable[[Any, Any], Any], epochs: int,
                    seed: int, desc: str, progress: bool | None) -> tuple[Any, Any, Any, float]:
    """One compression stage: a copy of ``dense`` with its own optimizer, compressed by ``make(model,
    optimizer)`` and fine-tuned ``epochs`` epochs. Returns (model, optimizer, compressor, test accuracy)."""
    model = h.copy(dense)
    opt = h.optimizer(model, s.finetune_lr)
    compressor = make(model, opt)
    model = compressor.compress()
    h.fit(model, opt, ds.x_train, ds.y_train, epochs, s.batch_size, seed, compressor=compressor, desc=desc,
          progress=progress)
    return model, opt, compressor, h.evaluate(model, ds.x_test, ds.y_test)


def _run_backend(h: Any, ds: Dataset, s: Schedule, seed: int, progress: bool | None,
                 log: Callable[[str], None], out: str, threads: int | None) -> BackendResult:
    t_start = time.perf_counter()
    backend = h.name
    h.seed(seed)
    dense = h.build_cnn(ds.image_shape, ds.num_classes)
    opt = h.optimizer(dense, s.lr)
    h.fit(dense, opt, ds.x_train, ds.y_train, s.dense_epochs, s.batch_size, seed, desc="dense", progress=progress)
    acc_dense = h.evaluate(dense, ds.x_test, ds.y_test)
    log(f"[{backend}] dense accuracy {_pct(acc_dense)}")

    # AGP pruning while fine-tuning (the optimizer hook keeps pruned weights at zero after every step)
    pruned_model, popt, pruner, acc_pruned = _finetune_stage(
        h, ds, s, dense, lambda m, o: h.backend.AGPPruner(m, agp_config(s), o), s.prune_epochs, seed + 1,
        "AGP prune", progress)
    log(f"[{backend}] pruned accuracy {_pct(acc_pruned)}")

    # QAT int8 while fine-tuning
    quant_model, qopt, qat, acc_quant = _finetune_stage(
        h, ds, s, dense, lambda m, o: h.backend.QAT_Quantizer(m, QAT_CONFIG, o), s.quant_epochs, seed + 2,
        "QAT int8", progress)
    log(f"[{backend}] quantized accuracy {_pct(acc_quant)}")

    # what ships: dependency-aware filter pruning (one shot), speedup_model removes the pruned channels, the
    # smaller model is fine-tuned briefly, then PtqQuantizer makes it int8 and exports the artifact file
    smodel = h.copy(dense)
    spruner = h.struct_pruner(smodel, h.optimizer(smodel, s.finetune_lr), ds.x_test, struct_config())
    spruner.compress()
    struct = h.speedup(spruner, ds.x_test)
    acc_oneshot = h.evaluate(struct, ds.x_test, ds.y_test)
    struct_opt = h.optimizer(struct, s.finetune_lr)  # (tf: compiles the new model)
    h.fit(struct, struct_opt, ds.x_train, ds.y_train, s.struct_epochs, s.batch_size, seed + 3, desc="structured",
          progress=progress)
    acc_struct = h.evaluate(struct, ds.x_test, ds.y_test)
    log(f"[{backend}] structured accuracy {_pct(acc_struct)} after speedup and fine-tune ({_pct(acc_oneshot)} "
        f"right after speedup)")
    channels = {k: (h.out_channels(dense, k), h.out_channels(struct, k)) for k in STRUCT_LAYERS}
    quantizer, shipped = h.ptq(h.copy(struct), PTQ_CONFIG, ds.x_train[:s.calib_samples])
    acc_ptq_sim = h.evaluate(shipped, ds.x_test, ds.y_test)
    fmt, suffix = h.artifact_format, h.artifact_suffix
    paths = {"dense": os.path.join(out, "dense" + suffix), "struct": os.path.join(out, "structured" + suffix),
             "shipped": os.path.join(out, "shipped-int8" + suffix)}
    h.export_float_artifact(dense, paths["dense"], ds.x_test)
    h.export_float_artifact(struct, paths["struct"], ds.x_test)
    h.export_int8_artifact(quantizer, paths["shipped"])
    artifacts = measure_artifacts(h, paths, ds.x_test, ds.y_test, s, threads)
    log(f"[{backend}] shipped int8 {fmt} accuracy {_pct(artifacts['shipped'].accuracy)} in its runtime "
        f"({_pct(acc_ptq_sim)} fake-quant in the framework)")

    params = h.param_count(dense)
    flops = {"dense": h.flops(dense, ds.x_test), "pruned": h.flops(pruned_model, ds.x_test),
             "quant": h.flops(quant_model, ds.x_test), "struct": h.flops(struct, ds.x_test)}
    exported = h.export_pruned(pruner, pruned_model, out)
    calibration = h.export_quantized(qat, quant_model, out)
    files = {"dense": h.save(dense, os.path.join(out, "dense" + h.suffix)),
             "pruned": os.path.getsize(os.path.join(out, h.pruned_file)),
             "quant": os.path.getsize(os.path.join(out, h.quant_file)),
             "struct": h.save(struct, os.path.join(out, "structured" + h.suffix))}
    sparsity, per_layer = _sparsity({k: exported[k] for k in LAYERS if k in exported})

    # inference on the test set as one batch, interleaved (not the QAT model: fake quantization is a
    # training-time simulation in float); then the step time, also interleaved (after the accuracies, since
    # timing trains the models a little further)
    names = ("dense", "pruned", "struct")
    infer = h.infer_times([dense, pruned_model, struct], ds.x_test, s.infer_rounds)
    t_dense, t_pruned, t_quant, t_struct = h.time_steps(
        [(dense, opt), (pruned_model, popt), (quant_model, qopt), (struct, struct_opt)],
        ds.x_train, ds.y_train, s.batch_size, s.timing_rounds, s.timing_steps)
    med = statistics.median
    n_train, n_test = len(ds.x_train), len(ds.x_test)
    hh, ww = ds.image_shape
    return BackendResult(
        backend=backend, data=ds.name, acc_dense=acc_dense, acc_pruned=acc_pruned, acc_quant=acc_quant,
        sparsity=sparsity, layer_sparsity=per_layer, dense_bytes=4 * sum(params.values()),
        mask_bytes=h.mask_bytes(pruner), int8_bytes=int8_export_bytes(params, calibration),
        step_dense=med(t_dense), step_pruned=med(t_pruned), step_quant=med(t_quant),
        acc_struct=acc_struct, step_struct=med(t_struct), struct_bytes=4 * flops["struct"][1],
        struct_channels=channels, params={k: p for k, (_, p) in flops.items()},
        macs={k: m for k, (m, _) in flops.items()}, file_bytes=files,
        infer={k: med(v) for k, v in zip(names, infer)}, infer_ranges={k: (min(v), max(v)) for k, v in zip(names, infer)},
        n_infer=len(ds.x_test), file_format=h.file_format,
        step_ranges={k: (min(v), max(v)) for k, v in (("dense", t_dense), ("pruned", t_pruned), ("quant", t_quant),
                                                       ("struct", t_struct))},
        seconds=time.perf_counter() - t_start,
        description=f"small CNN on {ds.name} {hh}x{ww} ({n_train} train / {n_test} test images)",
        acc_struct_oneshot=acc_oneshot, acc_ptq_sim=acc_ptq_sim, artifacts=artifacts, artifact_format=fmt,
    )


def plot_points(r: BackendResult) -> list[tuple[str, str, int, float | None, float]]:
    """Every stage of one backend as ``(key, label, file bytes, seconds for the test set in one call or None,
    test accuracy)``: the framework models (keys 'dense', 'pruned', 'quant', 'struct'; their saved files;
    the QAT model is not timed, its fake quantization is a simulation) and the artifact files in their
    runtime (keys 'file:dense', 'file:struct', 'file:shipped'). What :func:`save_plot` draws."""
    fw = r.file_format
    pts: list[tuple[str, str, int, float | None, float]] = [
        ("dense", f"dense ({fw})", r.file_bytes["dense"], r.infer.get("dense"), r.acc_dense),
        ("pruned", f"AGP {SPARSITY:.0%}, masks ({fw})", r.file_bytes["pruned"], r.infer.get("pruned"), r.acc_pruned),
        ("quant", f"QAT int8 simulation ({fw}, not timed)", r.file_bytes["quant"], None, r.acc_quant),
        ("struct", f"structured + speedup ({fw})", r.file_bytes["struct"], r.infer.get("struct"), r.acc_struct),
    ]
    for k, a in r.artifacts.items():
        pts.append((f"file:{k}", f"{a.label} ({r.artifact_format} in its runtime)", a.file_bytes, a.latency_all,
                    a.accuracy))
    return pts


#: marker and legend of each stage in the figure: same shape = same model; hollow = framework, filled = file
_MARKERS = {"dense": "o", "pruned": "s", "quant": "^", "struct": "D", "file:dense": "o", "file:struct": "D",
            "file:shipped": "*"}
_LEGEND = {"dense": "dense (framework)", "pruned": f"AGP {SPARSITY:.0%}, masks (framework)",
           "quant": "QAT int8 simulation (framework, not timed)", "struct": "structured + speedup (framework)",
           "file:dense": "dense float file", "file:struct": "structured float file",
           "file:shipped": "structured + PTQ int8 file (shipped)"}


def save_plot(results: Sequence[BackendResult], path: str) -> None:
    """Accuracy vs file size and accuracy vs latency (test set in one call) of every stage of every backend,
    as an image (headless matplotlib): hollow markers are framework models, filled ones the artifact files
    measured in their runtime; one colour per backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    handles: dict[str, Any] = {}  # the backends' colours first, then the stages' markers
    for i, r in enumerate(results):
        handles[r.backend] = Line2D([], [], color=colors[i % len(colors)], marker="s", linestyle="", label=r.backend)
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        for key, _, size, latency, acc in plot_points(r):
            filled = key.startswith("file:")
            style = {"marker": _MARKERS[key], "s": 160 if key == "file:shipped" else 60, "edgecolors": color,
                     "facecolors": color if filled else "none", "linewidths": 1.5}
            axes[0].scatter(size / 1024, 100 * acc, **style)
            if latency is not None:
                axes[1].scatter(latency * 1e3, 100 * acc, **style)
            if key not in handles:
                handles[key] = Line2D([], [], color="gray", marker=_MARKERS[key], linestyle="",
                                      markerfacecolor="gray" if filled else "none", label=_LEGEND[key])
    n = results[0].n_infer if results else 0
    for ax, xlabel, title in ((axes[0], "file size (KiB, log scale)", "accuracy vs file size"),
                              (axes[1], f"latency, {n} test images in one call (ms, log scale)",
                               "accuracy vs latency")):
        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
    fig.legend(handles=list(handles.values()), loc="lower center", ncol=4, fontsize=8, frameon=False)
    runtimes = ", ".join(f"{r.backend}: {r.artifact_format}" for r in results)
    fig.suptitle(f"compressor demo: hollow = framework model, filled = file run in its runtime ({runtimes})")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(backends: Sequence[str], data: str = "digits", data_dir: str | None = None, quick: bool = False,
             seed: int = 0, plot: str | None = None, progress: bool | None = None, device: str = "cpu",
             threads: int | None = 1, out: Callable[[str], None] = print,
             out_dir: str | None = None) -> list[BackendResult]:
    """Run the demo on ``backends``, printing each table through ``out``; returns the results. With
    ``out_dir`` the files (the artifacts and the framework models) are kept in ``out_dir/<backend>/``."""
    ds = load_dataset(data, data_dir, seed=seed)
    schedule = SCHEDULES[(data, quick)]
    if schedule.n_train or schedule.n_test:
        ds = ds.subset(schedule.n_train, schedule.n_test)
    out(f"compressor demo: {ds.describe()}; backends: {', '.join(backends)}{' (quick)' if quick else ''}")
    results = []
    for b in backends:
        r = run_backend(b, ds, schedule, seed=seed, progress=progress, device=device, threads=threads, log=out,
                        out_dir=None if out_dir is None else os.path.join(out_dir, b))
        out(r.table())
        results.append(r)
    out("what you get (the shipped file vs the dense float file, measured on both in the same runtime):")
    for r in results:
        out("  " + summary_line(r))
    if out_dir is not None:
        out(f"files kept in {out_dir}")
    if plot:
        save_plot(results, plot)
        out(f"figure saved to {plot}")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compressor demo", description=(
        "Train a small CNN, then prune it with AGP to 80 %, quantize it with QAT int8 while fine-tuning (a "
        "training-time simulation), and ship it: prune 50 % of its channels (dependency-aware L1 filters), "
        "remove them with speedup_model, fine-tune, quantize to int8 with PtqQuantizer and export the artifact "
        "(int8 ONNX in onnxruntime on torch, full-integer TFLite on Keras), on every installed backend; print "
        "accuracy, sizes and latencies of the framework models and, measured on the files in their runtime, of "
        "the dense float and the shipped int8 artifacts."))
    p.add_argument("--backend", choices=("torch", "tf", "all"), default="all",
                   help="which backend to run (default: every installed one)")
    p.add_argument("--data", choices=("digits", "mnist"), default="digits",
                   help="digits: scikit-learn's bundled 8x8 digits (no download); mnist: IDX files in --data-dir")
    p.add_argument("--data-dir", help="directory holding the four MNIST IDX(.gz) files")
    p.add_argument("--quick", action="store_true", help="fewer epochs (a smoke test, seconds per backend)")
    p.add_argument("--plot", metavar="OUT.png", help="save a figure: accuracy vs file size and vs latency, every stage")
    p.add_argument("--out", metavar="DIR", help="keep the files (artifacts, framework models) in DIR/<backend>/ "
                                                "(default: a temporary directory, removed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lm", action="store_true",
                   help="the language-model demo instead: one-shot SparseGPT / Wanda / GPTQ / AWQ on a small byte-level "
                        "Llama trained offline (its options: compressor demo --lm --help)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per framework (default 1: the demo's model is too small to gain from more; 0 = "
                        "the framework's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``compressor demo``; returns the exit code (2 on bad input, one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--lm" in argv:  # the language-model demo (compressor.app.demo_lm) has its own options
        from .demo_lm import main as lm_main

        return lm_main([a for a in argv if a != "--lm"])
    args = build_parser().parse_args(argv)
    installed = installed_backends()
    if args.backend == "all":
        backends = installed
        if not backends:
            print("compressor demo: error: neither torch nor tensorflow is installed "
                  "(pip install 'compressor[torch,demo]' or 'compressor[tf,demo]')", file=sys.stderr)
            return 2
    else:
        backends = [args.backend]
        if args.backend not in installed:
            print(f"compressor demo: error: backend {args.backend!r} needs {FRAMEWORK[args.backend]}, which is not "
                  f"installed (pip install 'compressor[{args.backend},demo]')", file=sys.stderr)
            return 2
    for b in backends:
        missing = [m for m in ARTIFACT_NEEDS[b] if importlib.util.find_spec(m) is None]
        if missing:
            print(f"compressor demo: error: the {b} artifact is an ONNX file run in onnxruntime, which needs "
                  f"{' and '.join(missing)} (pip install 'compressor[onnx]'); or run another backend with "
                  f"--backend", file=sys.stderr)
            return 2
    if args.data == "mnist" and not args.data_dir:
        print("compressor demo: error: --data mnist needs --data-dir DIR (the four MNIST IDX files)", file=sys.stderr)
        return 2
    progress = False if args.no_progress else None
    try:
        run_demo(backends, args.data, args.data_dir, args.quick, args.seed, args.plot, progress, args.device,
                 args.threads or None, out_dir=args.out)
    except (FileNotFoundError, DataError) as e:
        print(f"compressor demo: error: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"compressor demo: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":  # pragma: no cover
    with contextlib.suppress(KeyboardInterrupt):
        raise SystemExit(main())
