"""The demo's PyTorch harness: training, evaluation, export and timing helpers for small image models.

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

import compressor.torch as backend  # the harness's backend: importing the harness imports it

from .progress import progress_bar as _progress

__all__ = ["OnnxRunner", "TorchHarness"]

#: onnxruntime kernels that compute in integers (what an int8 ONNX is fused into)
INTEGER_KERNELS = frozenset({"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm",
                             "MatMulIntegerToFloat", "DynamicQuantizeMatMul"})


class OnnxRunner:
    """An ONNX file loaded in onnxruntime (CPU): what the demo measures its accuracy and latency on.

    ``session`` is the ``onnxruntime.InferenceSession`` that produced the numbers, ``path`` the file it
    loaded. Images ``[N, H, W]`` go in as float32 NCHW."""

    def __init__(self, path: str, threads: int | None = 1):
        import onnxruntime as ort

        so = ort.SessionOptions()
        so.intra_op_num_threads = threads or 0
        so.inter_op_num_threads = 1
        so.log_severity_level = 3
        self.path = path
        self.threads = threads
        self.session = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        self.input = self.session.get_inputs()[0].name
        self.runtime = f"onnxruntime {ort.__version__} (CPU, {threads or 'default'} thread{'s' * (threads != 1)})"

    def feed(self, x: np.ndarray) -> dict[str, np.ndarray]:
        """The session's input for images ``x`` (prepared once, outside the timed calls)."""
        return {self.input: np.ascontiguousarray(x[:, None], dtype=np.float32)}

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.session.run(None, feed)[0]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Logits of images ``x`` (one call)."""
        return self.run(self.feed(x))

    def optimized_ops(self) -> dict[str, int]:
        """Op type -> count in the graph onnxruntime actually runs (its optimised graph, default level)."""
        import tempfile
        from collections import Counter

        import onnx
        import onnxruntime as ort

        with tempfile.TemporaryDirectory() as d:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            so.optimized_model_filepath = os.path.join(d, "optimized.onnx")
            ort.InferenceSession(self.path, so, providers=["CPUExecutionProvider"])
            return dict(Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node))

    def int8_evidence(self) -> str:
        """The integer kernels in the optimised graph (``'none (float kernels)'`` for a float model)."""
        ops = self.optimized_ops()
        found = sorted(k for k in ops if k in INTEGER_KERNELS)
        return ", ".join(f"{k} x{ops[k]}" for k in found) if found else "none (float kernels)"


class TorchHarness:
    """Training/evaluation helpers for PyTorch models on numpy image arrays ``[N, H, W]`` (CPU or ``device``)."""

    name = "torch"

    def __init__(self, device: str = "cpu"):
        import torch

        self.torch = torch
        self.backend = backend
        self.device = torch.device(device)

    @contextlib.contextmanager
    def threads(self, n: int | None) -> Any:
        """Use ``n`` CPU threads inside the block (tiny models run fastest on one: no sync between threads)."""
        old = self.torch.get_num_threads()
        if n:
            self.torch.set_num_threads(n)
        try:
            yield
        finally:
            self.torch.set_num_threads(old)

    def seed(self, seed: int) -> None:
        self.torch.manual_seed(seed)

    def to_input(self, x: np.ndarray) -> Any:
        return self.torch.from_numpy(np.ascontiguousarray(x[:, None])).to(self.device)  # NCHW

    def build_cnn(self, image_shape: tuple[int, int], num_classes: int) -> Any:
        """conv1(16) - conv2(32) - maxpool - fc1(64) - fc2; images above 16 px get a pool after conv1 too."""
        from collections import OrderedDict

        from torch import nn

        h, w = image_shape
        pools = 1 if h <= 16 else 2
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        layers["conv1"] = nn.Conv2d(1, 16, 3, padding=1)
        layers["relu1"] = nn.ReLU()
        if pools == 2:
            layers["pool1"] = nn.MaxPool2d(2)
        layers["conv2"] = nn.Conv2d(16, 32, 3, padding=1)
        layers["relu2"] = nn.ReLU()
        layers["pool2"] = nn.MaxPool2d(2)
        layers["flatten"] = nn.Flatten()
        layers["fc1"] = nn.Linear(32 * (h >> pools) * (w >> pools), 64)
        layers["relu3"] = nn.ReLU()
        layers["fc2"] = nn.Linear(64, num_classes)
        return nn.Sequential(layers).to(self.device)

    def copy(self, model: Any) -> Any:
        import copy

        return copy.deepcopy(model)

    def optimizer(self, model: Any, lr: float, kind: str = "adam", momentum: float = 0.9, weight_decay: float = 0.0) -> Any:
        """Weight decay is decoupled, as in Keras (``p -= lr * wd * p`` before the update): AdamW for Adam,
        a step pre-hook for SGD (torch's own SGD ``weight_decay`` would add ``wd * p`` to the gradient)."""
        params = list(model.parameters())
        if kind == "adam":
            if weight_decay:
                return self.torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
            return self.torch.optim.Adam(params, lr=lr)
        opt = self.torch.optim.SGD(params, lr=lr, momentum=momentum)
        if weight_decay:
            torch = self.torch

            def decay(optimizer: Any, args: Any, kwargs: Any) -> None:
                with torch.no_grad():
                    for g in optimizer.param_groups:
                        torch._foreach_mul_(g["params"], 1.0 - g["lr"] * weight_decay)

            opt.register_step_pre_hook(decay)
        return opt

    def set_lr(self, optimizer: Any, lr: float) -> None:
        for g in optimizer.param_groups:
            g["lr"] = lr

    def fit(self, model: Any, optimizer: Any, x: np.ndarray, y: np.ndarray, epochs: int, batch_size: int,
            seed: int = 0, compressor: Any = None, desc: str = "train", progress: bool | None = None,
            epoch_end: Callable[[int], None] | None = None) -> list[float]:
        """Train ``epochs`` epochs (shuffled with ``seed``); ``compressor.update_epoch(e)`` runs before epoch e.
        Returns the mean loss per epoch."""
        torch = self.torch
        xt, yt = self.to_input(x), torch.from_numpy(y).to(self.device)
        gen = torch.Generator().manual_seed(seed)
        losses = []
        bar = _progress(range(epochs), epochs, f"{self.name} {desc}", progress)
        for epoch in bar:
            if compressor is not None:
                compressor.update_epoch(epoch)
            model.train()
            perm = torch.randperm(len(xt), generator=gen).to(self.device)
            total = torch.zeros((), device=self.device)
            for i in range(0, len(xt), batch_size):
                idx = perm[i:i + batch_size]
                total += self._step(model, optimizer, xt[idx], yt[idx]).detach() * len(idx)
            losses.append(float(total) / len(xt))
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
            if epoch_end is not None:
                epoch_end(epoch)
        return losses

    def _step(self, model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
        optimizer.zero_grad(set_to_none=True)
        loss = self.torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        return loss

    def evaluate(self, model: Any, x: np.ndarray, y: np.ndarray, batch_size: int = 1000) -> float:
        torch = self.torch
        model.eval()
        correct = 0
        with torch.no_grad():
            for i in range(0, len(x), batch_size):
                pred = model(self.to_input(x[i:i + batch_size])).argmax(1).cpu().numpy()
                correct += int((pred == y[i:i + batch_size]).sum())
        model.train()
        return correct / len(x)

    def time_steps(self, runs: Sequence[tuple[Any, Any]], x: np.ndarray, y: np.ndarray, batch_size: int,
                   rounds: int, steps: int) -> list[list[float]]:
        """Seconds per training step of each ``(model, optimizer)``, interleaved round by round (the
        first round is a discarded warm-up), on the same batches."""
        torch = self.torch
        xb, yb = self.to_input(x[:batch_size]), torch.from_numpy(y[:batch_size]).to(self.device)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times: list[list[float]] = [[] for _ in runs]
        for r in range(rounds + 1):
            for i, (model, opt) in enumerate(runs):
                model.train()
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    self._step(model, opt, xb, yb)
                    sync()
                    if r:
                        times[i].append(time.perf_counter() - t0)
        return times

    def param_count(self, model: Any) -> dict[str, int]:
        """Parameter name -> number of elements (the float32 payload of a checkpoint)."""
        return {k: v.numel() for k, v in model.state_dict().items() if v.is_floating_point() and "mask" not in k}

    def export_pruned(self, pruner: Any, model: Any, directory: str) -> dict[str, np.ndarray]:
        """Export through the pruner and reload the file into a fresh dense model: layer -> weight."""
        path = os.path.join(directory, "pruned.pt")
        pruner.export_model(path, os.path.join(directory, "masks.pt"))
        state = self.torch.load(path, weights_only=True)
        return {k.rsplit(".", 1)[0]: v.cpu().numpy() for k, v in state.items() if k.endswith(".weight")}

    def mask_bytes(self, pruner: Any) -> int:
        total = 0
        for w in pruner.get_modules_wrapper():
            for m in (w.weight_mask, w.bias_mask):
                if m is not None:
                    total += m.numel() * m.element_size()
        return total

    def export_quantized(self, quantizer: Any, model: Any, directory: str) -> dict[str, dict[str, Any]]:
        """Export through the quantizer; returns the calibration config (layer -> bits, scales, ...)."""
        return quantizer.export_model(os.path.join(directory, "quant.pt"), os.path.join(directory, "calib.pt"))

    #: file names export_pruned / export_quantized write, and the suffix of :meth:`save`
    pruned_file, quant_file, suffix, file_format = "pruned.pt", "quant.pt", ".pt", "state_dict .pt"

    def struct_pruner(self, model: Any, optimizer: Any, x: np.ndarray, config_list: list[dict[str, Any]]) -> Any:
        """Dependency-aware L1 filter pruner of ``config_list`` (the demo's :func:`~compressor.app.demo.struct_config`;
        traced on one sample of ``x``)."""
        return self.backend.L1FilterPruner(model, config_list, optimizer, dependency_aware=True,
                                           dummy_input=self.to_input(x[:1]))

    def speedup(self, pruner: Any, x: np.ndarray) -> Any:
        """A smaller, unwrapped copy of the pruner's model without its pruned channels."""
        return self.backend.speedup_model(pruner, self.to_input(x[:1]))

    def flops(self, model: Any, x: np.ndarray) -> tuple[int, int]:
        """(MACs per sample, parameters) of ``model`` (``count_flops_params``)."""
        macs, params, _ = self.backend.count_flops_params(model, self.to_input(x[:1]))
        return macs, params

    def out_channels(self, model: Any, layer: str) -> int:
        m = model.get_submodule(layer)
        m = getattr(m, "module", m)  # a pruner's wrapper
        return int(getattr(m, "out_channels", None) or m.out_features)

    def save(self, model: Any, path: str) -> int:
        """Save the state_dict; returns the file's bytes."""
        self.torch.save(model.state_dict(), path)
        return os.path.getsize(path)

    # ------------------------------------------------------------------ the shipped artifact (ONNX)
    #: the artifact's suffix and format (the demo's file names)
    artifact_suffix, artifact_format = ".onnx", "ONNX"

    def export_float_artifact(self, model: Any, path: str, x: np.ndarray) -> None:
        """``model`` as a float ONNX file (dynamic batch axis; TorchScript exporter), checked in onnxruntime."""
        from ..torch.onnx_io import export_onnx

        model.eval()
        try:
            export_onnx(model, path, (self.to_input(x[:1]),), dynamo=False)
        finally:
            model.train()

    def ptq(self, model: Any, config_list: list[dict[str, Any]], x: np.ndarray, batch_size: int = 32) -> tuple[Any, Any]:
        """``PtqQuantizer`` on ``model`` (in place), calibrated on images ``x``: (quantizer, fake-quant model)."""
        q = self.backend.PtqQuantizer(model, config_list, dummy_input=self.to_input(x[:1]))
        model = q.compress()
        q.calibrate([self.to_input(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
        return q, model

    def export_int8_artifact(self, quantizer: Any, path: str) -> None:
        """The calibrated quantizer's integer ONNX (int8 weight initializers, QDQ activations); its state_dict
        (quantized weights as floats) goes next to it as ``.pt`` (``export_model`` needs a model path)."""
        quantizer.export_model(os.path.splitext(path)[0] + ".pt", onnx_path=path)

    def load_artifact(self, path: str, threads: int | None = 1) -> OnnxRunner:
        """``path`` loaded in onnxruntime."""
        return OnnxRunner(path, threads)

    def infer_times(self, models: Sequence[Any], x: np.ndarray, rounds: int) -> list[list[float]]:
        """Seconds of one eval forward of all of ``x`` (one batch) per model, interleaved round by round
        (the first round is a discarded warm-up)."""
        torch = self.torch
        xb = self.to_input(x)
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        times: list[list[float]] = [[] for _ in models]
        for m in models:
            m.eval()
        with torch.no_grad():
            for r in range(rounds + 1):
                for i, m in enumerate(models):
                    sync()
                    t0 = time.perf_counter()
                    m(xb)
                    sync()
                    if r:
                        times[i].append(time.perf_counter() - t0)
        for m in models:
            m.train()
        return times
