"""int8 ONNX on onnxruntime, ours vs onnxruntime's own quantizers (issue 27): latency at batch 1 and 32, file
size, agreement, on a CIFAR ResNet-18, a Hugging Face MobileNetV2 (small config), a BERT-style encoder and a
ViT-tiny (random weights, structured inputs).

Variants per model:

* ``float``: ``torch.onnx.export`` of the float model (dynamic batch);
* ``ours-static``: ``PtqQuantizer`` (min-max, per-channel int8 weights, uint8 per-tensor activations, BN folded,
  ReLU fused, ranges shared, joins quantized; int8 per-row embedding tables), calibrated on 64 inputs,
  ``export_model(onnx_weight_dtype=...)``; the transformers get non-zero random Linear biases (as trained ones);
* ``ort-static``: ``quantize_static`` (QDQ, per-channel int8 weights, uint8 activations, MinMax) of the
  pre-processed float ONNX on the same 64 inputs, the anchor;
* transformers also: ``ours-dynamic`` (``PtqQuantizer(activation='dynamic')`` on the Linear layers) and
  ``ort-dynamic`` (``quantize_dynamic``, per-channel int8 weights, the anchor).

Weights: ``--weights int8`` (default; onnxruntime's own choice, u8s8 kernels) or ``uint8`` (this library's
``'auto'`` on x86 without VNNI: u8u8 kernels, exact there but slower; see compressor/core/cpu.py).
Latency: onnxruntime CPU, ``--threads`` intra-op threads, default graph optimisation (ALL); medians of
``--rounds`` rounds, each running every (variant, batch) ``--calls`` times in a shuffled order. Agreement:
argmax of the artifact vs the float torch model (all variants), and ours vs our fake-quant model.

    python benchmarks/int8_models.py [--models resnet18-cifar bert vit mobilenet_v2] [--rounds 5] [--calls 2]
"""

from __future__ import annotations

import argparse
import collections
import copy
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._interleave import inputs, interleaved_medians  # noqa: E402
from benchmarks.torch_speedup import ResNet18, randomize_norms  # noqa: E402
from compressor.torch import PtqQuantizer  # noqa: E402

INTEGER_OPS = {"QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "QLinearAdd", "QLinearMul",
               "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool", "DynamicQuantizeMatMul",
               "MatMulInteger", "ConvInteger", "QLinearSigmoid", "QLinearLeakyRelu"}
FLOAT_BETWEEN = {"Add", "Mul", "AveragePool", "GlobalAveragePool", "Clip", "Pad", "Conv", "MatMul", "Gemm",
                 "FusedConv", "FusedMatMul", "FusedGemm", "Concat", "ReduceMean"}


class Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> torch.Tensor:
        return self.model(*args, **kwargs).logits


def build(name: str) -> tuple[nn.Module, str]:
    import transformers as tr

    torch.manual_seed(0)
    if name == "resnet18-cifar":
        model = ResNet18().eval()
        randomize_norms(model)
        return model, "image"
    if name == "mobilenet_v2":
        m = tr.MobileNetV2ForImageClassification(tr.MobileNetV2Config(depth_multiplier=0.5, image_size=32,
                                                                      num_labels=10))
        for mod in m.modules():
            if isinstance(mod, nn.Conv2d):
                nn.init.kaiming_normal_(mod.weight, mode="fan_out")
        randomize_norms(m)
        return Logits(m).eval(), "image"
    if name == "vit":
        m = tr.ViTForImageClassification(tr.ViTConfig(image_size=32, patch_size=4, hidden_size=192,
                                                      num_hidden_layers=4, num_attention_heads=3,
                                                      intermediate_size=768, num_labels=10))
        return Logits(m).eval(), "image"
    m = tr.BertForSequenceClassification(tr.BertConfig(vocab_size=1000, hidden_size=256, num_hidden_layers=4,
                                                       num_attention_heads=4, intermediate_size=1024,
                                                       max_position_embeddings=128, num_labels=4))
    return Logits(m).eval(), "tokens"


def random_biases(model: nn.Module) -> None:
    """Non-zero Linear biases, as in a trained model: HF initialises them to zero, which the TorchScript exporter
    stores once and reads through Identity nodes (an export a trained model never produces)."""
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, nn.Linear) and mod.bias is not None:
                mod.bias.copy_(0.05 * torch.randn(mod.bias.shape, generator=g))


def data(kind: str, n: int, seed: int) -> np.ndarray:
    if kind == "image":
        return inputs((3, 32, 32), n, seed)
    rng = np.random.default_rng(seed)
    motif = np.random.default_rng(99).integers(1, 1000, (8, 64))
    ids = motif[rng.integers(0, 8, n)]
    noise = rng.random((n, 64)) < 0.2
    return np.where(noise, rng.integers(1, 1000, (n, 64)), ids).astype(np.int64)


def export_all(name: str, tmp: str, weights: str) -> tuple[dict[str, str], dict[str, np.ndarray], np.ndarray]:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model, kind = build(name)
    transformer = name in ("bert", "vit")
    if transformer:
        random_biases(model)
    # int8 embedding tables (per row) where the model has nn.Embedding layers, as the anchors quantize their Gathers
    emb = [{"op_types": ["Embedding"], "quant_types": ["weight"], "quant_bits": 8}] if any(
        isinstance(mod, nn.Embedding) for mod in model.modules()) else []
    calib, x_eval = data(kind, 64, 1), data(kind, 64, 2)
    t = torch.from_numpy
    paths = {"float": os.path.join(tmp, "float.onnx")}
    with torch.no_grad():
        ref = {"float": model(t(x_eval)).numpy()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model), (t(calib[:1]),), paths["float"], dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "batch"}})
        pre = os.path.join(tmp, "float-pre.onnx")
        quant_pre_process(paths["float"], pre)

        cfg = [{"op_types": ["Conv2d", "Linear"], "quant_types": ["input", "weight", "output"], "quant_bits": 8}] + emb
        m = copy.deepcopy(model)
        q = PtqQuantizer(m, cfg, dummy_input=t(calib[:1]))
        q.calibrate([t(calib[i:i + 16]) for i in range(0, 64, 16)])
        paths["ours-static"] = os.path.join(tmp, "ours-static.onnx")
        q.export_model(os.path.join(tmp, "s.pt"), onnx_path=paths["ours-static"], onnx_weight_dtype=weights)
        with torch.no_grad():
            ref["ours-static"] = m(t(x_eval)).numpy()

        class Reader(CalibrationDataReader):
            def __init__(self) -> None:
                self.it = iter([{"input": calib[i:i + 16]} for i in range(0, 64, 16)])

            def get_next(self):  # noqa: ANN201
                return next(self.it, None)

        paths["ort-static"] = os.path.join(tmp, "ort-static.onnx")
        quantize_static(pre, paths["ort-static"], Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
        if transformer:
            m = copy.deepcopy(model)
            q = PtqQuantizer(m, [{"op_types": ["Linear"], "quant_types": ["input", "weight"], "quant_bits": 8}] + emb,
                             activation="dynamic")
            paths["ours-dynamic"] = os.path.join(tmp, "ours-dynamic.onnx")
            q.export_model(os.path.join(tmp, "d.pt"), onnx_path=paths["ours-dynamic"], dummy_input=t(calib[:1]),
                           onnx_weight_dtype=weights)
            with torch.no_grad():
                ref["ours-dynamic"] = m(t(x_eval)).numpy()
            paths["ort-dynamic"] = os.path.join(tmp, "ort-dynamic.onnx")
            quantize_dynamic(pre, paths["ort-dynamic"], per_channel=True, weight_type=QuantType.QInt8)
    return paths, ref, x_eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--weights", default="int8", choices=["int8", "uint8"])
    ap.add_argument("--models", nargs="+", default=["resnet18-cifar", "mobilenet_v2", "bert", "vit"],
                    choices=["resnet18-cifar", "mobilenet_v2", "bert", "vit"])
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort

    torch.set_num_threads(args.threads)
    print(f"onnxruntime {ort.__version__}, CPU, {args.threads} threads, optimisation ALL, ours' weights {args.weights}; "
          f"medians of {args.rounds} interleaved rounds x {args.calls} calls; load {os.getloadavg()[0]:.1f}\n")
    print("| model | variant | file KB | b1 ms | b1 vs anchor | b32 ms | b32 vs anchor | argmax vs float | "
          "vs fake-quant | integer kernels | float ops left |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            paths, ref, x_eval = export_all(name, tmp, args.weights)
            sessions, kernels, floats = {}, {}, {}
            for v, path in paths.items():
                so = ort.SessionOptions()
                so.intra_op_num_threads, so.inter_op_num_threads, so.log_severity_level = args.threads, 1, 3
                so.optimized_model_filepath = os.path.join(tmp, f"{v}-opt.onnx")
                sessions[v] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
                ops = collections.Counter(n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node)
                kernels[v] = ", ".join(f"{k} {c}" for k, c in sorted(ops.items()) if k in INTEGER_OPS) or "-"
                floats[v] = ", ".join(f"{k} {c}" for k, c in sorted(ops.items()) if k in FLOAT_BETWEEN) or "-"
            got = {v: np.concatenate([s.run(None, {"input": x_eval[i:i + 16]})[0] for i in range(0, 64, 16)])
                   for v, s in sessions.items()}
            feeds = {b: {"input": np.concatenate([x_eval] * 1)[:b]} for b in (1, 32)}
            med = interleaved_medians({(v, b): (lambda s=sessions[v], f=feeds[b]: s.run(None, f))
                                       for v in sessions for b in feeds}, args.rounds, args.calls)
            sizes = {v: os.path.getsize(p) for v, p in paths.items()}
        for v in sessions:
            anchor = "ort-dynamic" if v.endswith("dynamic") else "ort-static" if v != "float" else "float"
            agree = float((got[v].argmax(1) == ref["float"].argmax(1)).mean())
            fq = f"{float((got[v].argmax(1) == ref[v].argmax(1)).mean()):.1%}" if v in ref and v != "float" else "-"
            print(f"| {name} | {v} | {sizes[v] / 1024:.0f} | {med[(v, 1)] * 1e3:.2f} | "
                  f"{med[(v, 1)] / med[(anchor, 1)]:.2f}x | {med[(v, 32)] * 1e3:.1f} | "
                  f"{med[(v, 32)] / med[(anchor, 32)]:.2f}x | {agree:.1%} | {fq} | {kernels[v]} | {floats[v]} |",
                  flush=True)


if __name__ == "__main__":
    main()
