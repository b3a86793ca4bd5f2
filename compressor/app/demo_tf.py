"""The demo's TensorFlow / Keras 3 harness: the same helpers as the torch one, for Keras models (NHWC).

``compressor demo`` (:mod:`compressor.app.demo`, the backend-neutral driver) runs its stages through it, and the
examples (``examples/``) reuse it with their own models; :func:`compressor.app.demo.get_harness` picks it.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

import compressor.tf as backend  # the harness's backend: importing the harness imports it

from .progress import progress_bar as _progress

__all__ = ["TfHarness", "TfliteRunner"]


@contextlib.contextmanager
def _native_output_muted() -> Any:
    """Mute what TensorFlow's converter and TFLite's runtime print (Python ``print`` AND their C++ logging to
    file descriptors 1 and 2: 'Saved artifact at ...', 'fully_quantize: ...', 'Created TensorFlow Lite XNNPACK
    delegate'), which would bury the demo's tables. Errors still raise, with their message."""
    import io
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    saved = []
    try:
        for fd in (1, 2):
            saved.append((fd, os.dup(fd)))
        null = os.open(os.devnull, os.O_WRONLY)
        for fd, _ in saved:
            os.dup2(null, fd)
        os.close(null)
    except OSError:  # no real descriptors (an embedding host): leave them
        for fd, keep in saved:
            os.dup2(keep, fd)
            os.close(keep)
        saved = []
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        for fd, keep in saved:
            os.dup2(keep, fd)
            os.close(keep)


class TfliteRunner:
    """A ``.tflite`` file loaded in ``tf.lite.Interpreter``: what the demo measures its accuracy and latency on.

    One interpreter per batch size (the input resized); ``interpreters`` maps batch size -> the
    ``tf.lite.Interpreter`` that produced the numbers, ``path`` is the file they loaded. Images
    ``[N, H, W]`` go in as float32 NHWC (the demo's artifacts take and return float32)."""

    def __init__(self, path: str, threads: int | None = 1):
        import tensorflow as tf

        self.tf = tf
        self.path = path
        self.threads = threads
        self.interpreters: dict[int, Any] = {}
        self.runtime = f"TFLite interpreter, TF {tf.__version__} ({threads or 'default'} thread{'s' * (threads != 1)})"

    def interpreter(self, batch: int) -> Any:
        """The interpreter of input batch ``batch`` (made on first use)."""
        if batch not in self.interpreters:
            import warnings

            with warnings.catch_warnings(), _native_output_muted():
                warnings.simplefilter("ignore")  # tf.lite.Interpreter's deprecation notice (LiteRT)
                it = self.tf.lite.Interpreter(model_path=self.path, num_threads=self.threads or None)
                d = it.get_input_details()[0]
                it.resize_tensor_input(d["index"], [batch, *d["shape"][1:]])
                it.allocate_tensors()
                it.invoke()  # the first invoke applies the XNNPACK delegate (and logs that it did)
            self.interpreters[batch] = it
        return self.interpreters[batch]

    def feed(self, x: np.ndarray) -> tuple[Any, np.ndarray]:
        """(interpreter, input) for images ``x`` (prepared once, outside the timed calls)."""
        return self.interpreter(len(x)), np.ascontiguousarray(x[..., None], dtype=np.float32)

    def run(self, feed: tuple[Any, np.ndarray]) -> np.ndarray:
        it, x = feed
        it.set_tensor(it.get_input_details()[0]["index"], x)
        it.invoke()
        return it.get_tensor(it.get_output_details()[0]["index"])

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Logits of images ``x`` (one invoke)."""
        return self.run(self.feed(x))

    def int8_evidence(self) -> str:
        """How many of the file's tensors are int8 (weights and activations of a full-integer model)."""
        details = self.interpreter(1).get_tensor_details()
        n8 = sum(np.dtype(d["dtype"]) == np.int8 for d in details)
        return f"{n8} of {len(details)} tensors int8" if n8 else f"none of {len(details)} tensors int8 (float)"


class TfHarness:
    """The same helpers for Keras 3 models (NHWC), trained with ``model.fit`` and the compressor's callback."""

    name = "tf"

    def __init__(self, device: str = "cpu"):
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
        import keras
        import tensorflow as tf

        self.tf = tf
        self.keras = keras
        self.backend = backend
        self.device = "/GPU:0" if device.startswith("cuda") else "/CPU:0"

    def seed(self, seed: int) -> None:
        self.keras.utils.set_random_seed(seed)

    @contextlib.contextmanager
    def threads(self, n: int | None) -> Any:
        """Ask TF for ``n`` intra-op threads; only possible before TF's runtime starts (else left as is)."""
        if n:
            with contextlib.suppress(RuntimeError):
                self.tf.config.threading.set_intra_op_parallelism_threads(n)
                self.tf.config.threading.set_inter_op_parallelism_threads(n)
        yield

    def to_input(self, x: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(x[..., None])  # NHWC

    def build_cnn(self, image_shape: tuple[int, int], num_classes: int) -> Any:
        """The same CNN as :meth:`TorchHarness.build_cnn` (same layer names)."""
        L = self.keras.layers
        h, w = image_shape
        pools = 1 if h <= 16 else 2
        layers: list[Any] = [self.keras.Input((h, w, 1)), L.Conv2D(16, 3, padding="same", name="conv1"), L.ReLU(name="relu1")]
        if pools == 2:
            layers.append(L.MaxPooling2D(2, name="pool1"))
        layers += [L.Conv2D(32, 3, padding="same", name="conv2"), L.ReLU(name="relu2"), L.MaxPooling2D(2, name="pool2"),
                   L.Flatten(name="flatten"), L.Dense(64, name="fc1"), L.ReLU(name="relu3"), L.Dense(num_classes, name="fc2")]
        return self.keras.Sequential(layers, name="cnn")

    def copy(self, model: Any) -> Any:
        clone = self.keras.models.clone_model(model)
        clone.set_weights(model.get_weights())
        return clone

    def optimizer(self, model: Any, lr: float, kind: str = "adam", momentum: float = 0.9, weight_decay: float = 0.0) -> Any:
        """A Keras optimizer, compiled into ``model`` (``model.optimizer`` is the one returned)."""
        opts = self.keras.optimizers
        wd = weight_decay or None
        opt = opts.Adam(lr, weight_decay=wd) if kind == "adam" else opts.SGD(lr, momentum=momentum, weight_decay=wd)
        loss = self.keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        return opt

    def set_lr(self, optimizer: Any, lr: float) -> None:
        optimizer.learning_rate.assign(lr)

    def _callbacks(self, compressor: Any) -> list[Any]:
        if compressor is None:
            return []
        return [self.backend.CompressionCallback(compressor)]

    def fit(self, model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
            seed: int = 0, compressor: Any = None, desc: str = "train", progress: bool | None = None,
            epoch_end: Callable[[int], None] | None = None) -> list[float]:
        keras = self.keras
        bar = _progress(None, epochs, f"{self.name} {desc}", progress)
        harness = self

        class Progress(keras.callbacks.Callback):
            def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
                bar.update(1)
                bar.set_postfix(loss=f"{(logs or {}).get('loss', float('nan')):.4f}")
                if epoch_end is not None:
                    epoch_end(epoch)

        keras.utils.set_random_seed(seed)
        with self.tf.device(harness.device):
            hist = model.fit(self.to_input(x), y, batch_size=batch_size, epochs=epochs, shuffle=True, verbose=0,
                             callbacks=[*self._callbacks(compressor), Progress()])
        bar.close()
        return [float(v) for v in hist.history.get("loss", [])]

    def evaluate(self, model: Any, x: np.ndarray, y: np.ndarray, batch_size: int = 1000) -> float:
        with self.tf.device(self.device), self._quiet():
            logits = model.predict(self.to_input(x), batch_size=batch_size, verbose=0)
        return float((np.argmax(logits, axis=1) == y).mean())

    def time_steps(self, runs: Sequence[tuple[Any, Any]], x: np.ndarray, y: np.ndarray, batch_size: int,
                   rounds: int, steps: int) -> list[list[float]]:
        """Seconds per ``model.fit`` step (batch callbacks), interleaved round by round, same batches."""
        keras = self.keras
        xb, yb = self.to_input(x[:batch_size * steps]), y[:batch_size * steps]

        class Timer(keras.callbacks.Callback):
            def __init__(self) -> None:
                super().__init__()
                self.times: list[float] = []

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                self.t0 = time.perf_counter()

            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                self.times.append(time.perf_counter() - self.t0)

        times: list[list[float]] = [[] for _ in runs]
        for r in range(rounds + 1):
            for i, (model, _opt) in enumerate(runs):
                timer = Timer()
                with self.tf.device(self.device):
                    model.fit(xb, yb, batch_size=batch_size, epochs=1, shuffle=False, verbose=0, callbacks=[timer])
                if r:
                    times[i].extend(timer.times[1:])  # the first batch of a fit call pays the dispatch set-up
        return times

    def param_count(self, model: Any) -> dict[str, int]:
        return {v.path: int(np.prod(v.shape)) for v in model.weights if "float" in str(v.dtype)}

    def export_pruned(self, pruner: Any, model: Any, directory: str) -> dict[str, np.ndarray]:
        """Export through the pruner (a plain ``.keras`` model) and reload it: layer -> kernel."""
        path = os.path.join(directory, "pruned.keras")
        pruner.export_model(path, os.path.join(directory, "masks.npz"))
        plain = self.keras.models.load_model(path, compile=False)
        return {layer.name: np.asarray(layer.kernel) for layer in plain.layers if hasattr(layer, "kernel")}

    def mask_bytes(self, pruner: Any) -> int:
        total = 0
        for w in pruner.get_modules_wrapper():
            for name in ("weight_mask", "bias_mask"):
                m = getattr(w, name, None)
                if m is not None:
                    total += int(np.prod(m.shape)) * self.tf.as_dtype(m.dtype).size
        return total

    def export_quantized(self, quantizer: Any, model: Any, directory: str) -> dict[str, dict[str, Any]]:
        return quantizer.export_model(os.path.join(directory, "quant.keras"), os.path.join(directory, "calib.json"))

    pruned_file, quant_file, suffix, file_format = "pruned.keras", "quant.keras", ".keras", ".keras"

    @contextlib.contextmanager
    def _quiet(self) -> Any:
        """No 'tf.function retracing' warnings: every demo model traces its own predict function once."""
        logger = self.tf.get_logger()
        level = logger.level
        logger.setLevel("ERROR")
        try:
            yield
        finally:
            logger.setLevel(level)

    def struct_pruner(self, model: Any, optimizer: Any, x: np.ndarray, config_list: list[dict[str, Any]]) -> Any:
        """Dependency-aware L1 filter pruner of ``config_list`` (the demo's :func:`~compressor.app.demo.struct_config`;
        the Functional graph gives the coupling, ``x`` is not needed)."""
        return self.backend.L1FilterPruner(model, config_list, optimizer, dependency_aware=True)

    def speedup(self, pruner: Any, x: np.ndarray) -> Any:
        """A NEW plain Keras model without the pruner's pruned channels (uncompiled)."""
        return self.backend.speedup_model(pruner)

    def flops(self, model: Any, x: np.ndarray) -> tuple[int, int]:
        macs, params, _ = self.backend.count_flops_params(model)
        return macs, params

    def out_channels(self, model: Any, layer: str) -> int:
        lay = model.get_layer(layer)
        lay = getattr(lay, "layer", lay)  # a pruner's wrapper
        return int(getattr(lay, "filters", None) or lay.units)

    def save(self, model: Any, path: str) -> int:
        """Save an uncompiled copy as ``.keras`` (no optimizer state); returns the file's bytes."""
        self.copy(model).save(path)
        return os.path.getsize(path)

    # ------------------------------------------------------------------ the shipped artifact (TFLite)
    artifact_suffix, artifact_format = ".tflite", "TFLite"

    def export_float_artifact(self, model: Any, path: str, x: np.ndarray) -> None:
        """``model`` as a float TFLite file (``TFLiteConverter.from_keras_model``, no optimisation)."""
        with self._quiet(), _native_output_muted():
            blob = self.tf.lite.TFLiteConverter.from_keras_model(model).convert()
        with open(path, "wb") as f:
            f.write(blob)

    def ptq(self, model: Any, config_list: list[dict[str, Any]], x: np.ndarray, batch_size: int = 32) -> tuple[Any, Any]:
        """``PtqQuantizer`` on ``model``, calibrated on images ``x``: (quantizer, fake-quant model)."""
        q = self.backend.PtqQuantizer(model, config_list)
        model = q.compress()
        q.calibrate([self.to_input(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
        return q, model

    def export_int8_artifact(self, quantizer: Any, path: str) -> None:
        """The calibrated quantizer's full-integer TFLite (int8 kernels, float input/output)."""
        with _native_output_muted():
            quantizer.export_model(tflite_path=path, verbose=False)

    def load_artifact(self, path: str, threads: int | None = 1) -> TfliteRunner:
        """``path`` loaded in ``tf.lite.Interpreter``."""
        return TfliteRunner(path, threads)

    def infer_times(self, models: Sequence[Any], x: np.ndarray, rounds: int) -> list[list[float]]:
        """Seconds of ``predict_on_batch`` on all of ``x`` per model, interleaved (first round: warm-up,
        which also traces the predict function)."""
        xb = self.to_input(x)
        times: list[list[float]] = [[] for _ in models]
        with self.tf.device(self.device), self._quiet():
            for r in range(rounds + 1):
                for i, m in enumerate(models):
                    t0 = time.perf_counter()
                    m.predict_on_batch(xb)
                    if r:
                        times[i].append(time.perf_counter() - t0)
        return times
