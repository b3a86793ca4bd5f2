"""``compressor demo``: compress a small CNN end to end on every installed backend and print what it cost.

Per backend: train a small CNN (scikit-learn's bundled 8x8 digits by default; MNIST with ``--data mnist
--data-dir DIR``), then from the same dense weights (a) prune it gradually to 80 % with ``AGPPruner``
while fine-tuning, (b) quantize it to int8 with ``QAT_Quantizer`` while fine-tuning and (c) prune 50 % of
the channels of conv1, conv2 and fc1 with a dependency-aware ``L1FilterPruner``, fine-tune briefly and
remove the pruned channels with ``speedup_model`` (structured + speedup). The table gives test accuracy,
the sparsity of the EXPORTED pruned weights, parameters and MACs per sample (``count_flops_params``),
model bytes (dense float32 vs. the extra bool masks vs. an int8 export vs. the smaller float32 model),
the size of each saved file, and the inference (test set, one batch) and training-step times relative
to the dense model, measured interleaved in the same run. Only the structured column is really smaller
and faster: masks keep every dense shape. Seeds are fixed.

This module is the backend-neutral driver (arguments, the stage sequence, the table and the plot). The
per-backend training code is a small "harness" next to each backend
(:class:`compressor.torch.demo_harness.TorchHarness`, :class:`compressor.tf.demo_harness.TfHarness`, also
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

from .core.quant import quantized_bytes
from .data import DataError, Dataset, load_dataset

# TorchHarness / TfHarness stay importable from here (module __getattr__) but out of __all__: a star import
# must not import a framework
__all__ = ["BackendResult", "Schedule", "get_harness", "main", "run_demo", "save_plot"]

BACKENDS = ("torch", "tf")
FRAMEWORK = {"torch": "torch", "tf": "tensorflow"}
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


SCHEDULES: dict[tuple[str, bool], Schedule] = {
    ("digits", False): Schedule(dense_epochs=20, prune_epochs=15, agp_end_epoch=8, quant_epochs=4, struct_epochs=5),
    ("digits", True): Schedule(dense_epochs=8, prune_epochs=4, agp_end_epoch=3, quant_epochs=1, struct_epochs=2,
                               timing_rounds=3, infer_rounds=5),
    ("mnist", False): Schedule(dense_epochs=3, prune_epochs=4, agp_end_epoch=3, quant_epochs=1, struct_epochs=1,
                               batch_size=128),
    ("mnist", True): Schedule(dense_epochs=2, prune_epochs=3, agp_end_epoch=2, quant_epochs=1, struct_epochs=1,
                              batch_size=64, n_train=6000, n_test=2000, timing_rounds=3, infer_rounds=5),
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


# ---------------------------------------------------------------------------------------------- results
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
            ("", "dense", f"pruned (AGP {SPARSITY:.0%})", "quantized (QAT int8)",
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
            rows.append((f"inference ({self.n_infer} images), median", *per(
                self.infer, lambda v, t: f"{t * ms:.2f} ms" + ("" if v == "dense" else f" ({self.infer_ratio(v):.2f}x)"))))
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
        lines.append("  (only the structured column is really smaller and faster: speedup_model removed its pruned "
                     "channels; AGP masks keep every dense shape, so its file and MACs are the dense ones, and "
                     "QAT shrinks only the int8 export)")
        return "\n".join(lines)


def _pct(v: float) -> str:
    return f"{100.0 * v:.2f} %"


# ---------------------------------------------------------------------------------------------- harnesses
def get_harness(backend: str, device: str = "cpu") -> Any:
    """The training harness of ``backend`` ('torch': :class:`compressor.torch.demo_harness.TorchHarness`,
    'tf': :class:`compressor.tf.demo_harness.TfHarness`), imported only here: running one backend never
    imports the other framework."""
    if backend == "torch":
        from .torch.demo_harness import TorchHarness

        return TorchHarness(device)
    if backend == "tf":
        from .tf.demo_harness import TfHarness

        return TfHarness(device)
    raise ValueError(f"unknown backend {backend!r}; allowed: {list(BACKENDS)}")


def __getattr__(name: str) -> Any:
    """``compressor.demo.TorchHarness`` / ``TfHarness`` (their home is next to the backend; imported on use)."""
    if name == "TorchHarness":
        from .torch.demo_harness import TorchHarness

        return TorchHarness
    if name == "TfHarness":
        from .tf.demo_harness import TfHarness

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
                device: str = "cpu", threads: int | None = 1, log: Callable[[str], None] = print) -> BackendResult:
    """Train, prune (AGP) and quantize (QAT) the demo CNN on one backend and measure everything."""
    h = get_harness(backend, device)
    with h.threads(threads):
        return _run_backend(h, ds, schedule, seed, progress, log)


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
                 log: Callable[[str], None]) -> BackendResult:
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
    quant_model, qopt, quantizer, acc_quant = _finetune_stage(
        h, ds, s, dense, lambda m, o: h.backend.QAT_Quantizer(m, QAT_CONFIG, o), s.quant_epochs, seed + 2,
        "QAT int8", progress)
    log(f"[{backend}] quantized accuracy {_pct(acc_quant)}")

    # structured: dependency-aware filter pruning (one shot), a short fine-tune with the masks held, then
    # speedup_model removes the pruned channels (its outputs equal the masked model's)
    _, _, spruner, acc_masked = _finetune_stage(
        h, ds, s, dense, lambda m, o: h.struct_pruner(m, o, ds.x_test, struct_config()), s.struct_epochs, seed + 3,
        "structured", progress)
    struct = h.speedup(spruner, ds.x_test)
    acc_struct = h.evaluate(struct, ds.x_test, ds.y_test)
    log(f"[{backend}] structured accuracy {_pct(acc_struct)} after speedup ({_pct(acc_masked)} masked)")
    struct_opt = h.optimizer(struct, s.finetune_lr)  # for the step timing (tf: compiles the new model)
    channels = {k: (h.out_channels(dense, k), h.out_channels(struct, k)) for k in STRUCT_LAYERS}

    params = h.param_count(dense)
    flops = {"dense": h.flops(dense, ds.x_test), "pruned": h.flops(pruned_model, ds.x_test),
             "quant": h.flops(quant_model, ds.x_test), "struct": h.flops(struct, ds.x_test)}
    with tempfile.TemporaryDirectory() as tmp:
        exported = h.export_pruned(pruner, pruned_model, tmp)
        calibration = h.export_quantized(quantizer, quant_model, tmp)
        files = {"dense": h.save(dense, os.path.join(tmp, "dense" + h.suffix)),
                 "pruned": os.path.getsize(os.path.join(tmp, h.pruned_file)),
                 "quant": os.path.getsize(os.path.join(tmp, h.quant_file)),
                 "struct": h.save(struct, os.path.join(tmp, "structured" + h.suffix))}
    sparsity, per_layer = _sparsity({k: exported[k] for k in LAYERS if k in exported})

    # inference on the test set as one batch, interleaved; then the step time, also interleaved (after the
    # accuracies, since timing trains the models a little further)
    names = ("dense", "pruned", "quant", "struct")
    infer = h.infer_times([dense, pruned_model, quant_model, struct], ds.x_test, s.infer_rounds)
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
    )


def save_plot(results: Sequence[BackendResult], path: str) -> None:
    """Per-layer sparsity and the four accuracies of each backend, side by side, as an image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    width = 0.8 / max(len(results), 1)
    for i, r in enumerate(results):
        names = list(r.layer_sparsity)
        xs = np.arange(len(names)) + i * width
        axes[0].bar(xs, [100 * r.layer_sparsity[n] for n in names], width, label=r.backend)
        axes[0].set_xticks(np.arange(len(names)) + width * (len(results) - 1) / 2, names)
        accs = [r.acc_dense, r.acc_pruned, r.acc_quant, r.acc_struct]
        axes[1].bar(np.arange(4) + i * width, [100 * a for a in accs], width, label=r.backend)
    axes[0].axhline(100 * SPARSITY, color="gray", linestyle="--", linewidth=1)
    axes[0].set_ylim(0, 115)
    axes[0].set_ylabel("sparsity (%)")
    axes[0].set_title("per-layer sparsity after AGP")
    axes[1].set_xticks(np.arange(4) + width * (len(results) - 1) / 2, ["dense", "pruned", "QAT int8", "structured"])
    low = min((min(r.acc_dense, r.acc_pruned, r.acc_quant, r.acc_struct) for r in results), default=0.9)
    axes[1].set_ylim(max(0.0, 100 * low - 5), 101)
    axes[1].set_ylabel("test accuracy (%)")
    axes[1].set_title("accuracy")
    for ax in axes:
        ax.legend(loc="upper right", ncol=len(results))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_demo(backends: Sequence[str], data: str = "digits", data_dir: str | None = None, quick: bool = False,
             seed: int = 0, plot: str | None = None, progress: bool | None = None, device: str = "cpu",
             threads: int | None = 1, out: Callable[[str], None] = print) -> list[BackendResult]:
    """Run the demo on ``backends``, printing each table through ``out``; returns the results."""
    ds = load_dataset(data, data_dir, seed=seed)
    schedule = SCHEDULES[(data, quick)]
    if schedule.n_train or schedule.n_test:
        ds = ds.subset(schedule.n_train, schedule.n_test)
    out(f"compressor demo: {ds.describe()}; backends: {', '.join(backends)}{' (quick)' if quick else ''}")
    results = []
    for b in backends:
        r = run_backend(b, ds, schedule, seed=seed, progress=progress, device=device, threads=threads, log=out)
        out(r.table())
        results.append(r)
    if plot:
        save_plot(results, plot)
        out(f"figure saved to {plot}")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compressor demo", description=(
        "Train a small CNN, then prune it with AGP to 80 %, quantize it with QAT int8 while fine-tuning, and "
        "prune 50 % of its channels (dependency-aware L1 filters) and remove them with speedup_model, on every "
        "installed backend; print accuracy, sparsity, params, MACs, model and file sizes, inference and "
        "train-step time per backend."))
    p.add_argument("--backend", choices=("torch", "tf", "all"), default="all",
                   help="which backend to run (default: every installed one)")
    p.add_argument("--data", choices=("digits", "mnist"), default="digits",
                   help="digits: scikit-learn's bundled 8x8 digits (no download); mnist: IDX files in --data-dir")
    p.add_argument("--data-dir", help="directory holding the four MNIST IDX(.gz) files")
    p.add_argument("--quick", action="store_true", help="fewer epochs (a smoke test, seconds per backend)")
    p.add_argument("--plot", metavar="OUT.png", help="save a per-layer sparsity and accuracy figure")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads per framework (default 1: the demo's model is too small to gain from more; 0 = "
                        "the framework's default)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``compressor demo``; returns the exit code (2 on bad input, one line on stderr)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--lm" in argv:  # the language-model demo (compressor.demo_lm) has its own options
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
    if args.data == "mnist" and not args.data_dir:
        print("compressor demo: error: --data mnist needs --data-dir DIR (the four MNIST IDX files)", file=sys.stderr)
        return 2
    progress = False if args.no_progress else None
    try:
        run_demo(backends, args.data, args.data_dir, args.quick, args.seed, args.plot, progress, args.device,
                 args.threads or None)
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
