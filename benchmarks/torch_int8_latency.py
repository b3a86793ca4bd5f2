"""int8 vs float ONNX on onnxruntime: latency at batch 1 and 32, file size, agreement (issue 15 benchmark).

Models (random weights; BatchNorm statistics randomised as a trained model has them): the demo's digits
CNN (1x8x8), Caffe's LeNet-5 (1x28x28) and a CIFAR-style ResNet-18 (3x32x32, 11.2 M parameters). Each is
exported three ways:

* ``float``: ``torch.onnx.export`` of the float model (dynamic batch);
* ``ours-int8``: ``PtqQuantizer`` (min-max observer, per-channel symmetric int8 weights, uint8 per-tensor
  inputs/outputs of every Conv2d/Linear, BN folded, ReLU fused) calibrated on 256 inputs, then
  ``export_model(..., onnx_path=...)``: int8 weight initializers + QDQ;
* ``ort-quantize_static``: onnxruntime's own PTQ of the float ONNX on the same 256 inputs (QDQ, per-channel
  int8 weights, uint8 activations, MinMax), the anchor.

Latency: onnxruntime CPU, ``--threads`` intra-op threads, default graph optimisation (ORT_ENABLE_ALL),
medians over ``--rounds`` rounds; each round runs every (variant, batch) ``--calls`` times in a shuffled
order, so load on the machine hits all variants alike. Agreement: argmax of the artifact vs the fake-quant
torch model (ours) or the float model (anchor) on 256 inputs.

    python benchmarks/torch_int8_latency.py [--rounds 10] [--calls 3] [--threads 2] [--models ...]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._interleave import artifact_row, inputs, interleaved_medians  # noqa: E402
from benchmarks.torch_speedup import ResNet18, randomize_norms  # noqa: E402
from compressor.app.demo import TorchHarness  # noqa: E402
from compressor.torch import PtqQuantizer  # noqa: E402
from examples.models_torch import lenet_5  # noqa: E402

INTEGER_OPS = {"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm", "MatMulIntegerToFloat", "QLinearAdd",
               "QLinearMul", "QLinearConcat", "QLinearAveragePool", "QLinearGlobalAveragePool", "DynamicQuantizeMatMul"}
MODELS = {
    "digits-cnn": (lambda: TorchHarness().build_cnn((8, 8), 10), (1, 8, 8)),
    "lenet5": (lambda: lenet_5(10, 28), (1, 28, 28)),
    "resnet18-cifar": (ResNet18, (3, 32, 32)),
}


def export(name: str, tmp: str) -> tuple[dict[str, str], dict[str, np.ndarray], np.ndarray]:
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().eval()
    randomize_norms(model)
    calib, x_eval = inputs(shape, 256, 1), inputs(shape, 256, 2)
    paths = {v: os.path.join(tmp, f"{name}-{v}.onnx") for v in ("float", "ours-int8", "ort-quantize_static")}
    with torch.no_grad():
        float_logits = model(torch.from_numpy(x_eval)).numpy()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(copy.deepcopy(model), (torch.from_numpy(calib[:1]),), paths["float"], dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "batch"}})
        q = PtqQuantizer(model, [{"op_types": ["Conv2d", "Linear"], "quant_types": ["input", "weight", "output"],
                                  "quant_bits": 8}], dummy_input=torch.from_numpy(calib[:1]))
        q.calibrate([torch.from_numpy(calib[i:i + 32]) for i in range(0, 256, 32)])
        q.export_model(os.path.join(tmp, f"{name}.pt"), onnx_path=paths["ours-int8"])
    with torch.no_grad():
        fq_logits = model(torch.from_numpy(x_eval)).numpy()

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input": calib[i:i + 32]} for i in range(0, 256, 32)])

        def get_next(self):  # noqa: ANN201
            return next(self.it, None)

    pre = os.path.join(tmp, f"{name}-float-pre.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        quant_pre_process(paths["float"], pre)
        quantize_static(pre, paths["ort-quantize_static"], Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                        activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return paths, {"float": float_logits, "ours-int8": fq_logits, "ort-quantize_static": float_logits}, x_eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--calls", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort

    torch.set_num_threads(args.threads)
    print(f"onnxruntime {ort.__version__}, CPUExecutionProvider, {args.threads} intra-op threads, graph optimisation "
          f"ALL; medians of {args.rounds} interleaved rounds x {args.calls} calls\n")
    print("| model | variant | file KB | size vs float | batch 1 ms | vs float | batch 32 ms | vs float | "
          "argmax agreement | integer kernels |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in args.models:
        with tempfile.TemporaryDirectory() as tmp:
            paths, reference, x_eval = export(name, tmp)
            sessions, kernels = {}, {}
            for v, path in paths.items():
                so = ort.SessionOptions()
                so.intra_op_num_threads = args.threads
                so.inter_op_num_threads = 1
                so.log_severity_level = 3
                so.optimized_model_filepath = os.path.join(tmp, f"{v}-opt.onnx")
                sessions[v] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
                ops = {n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node}
                kernels[v] = ", ".join(sorted(ops & INTEGER_OPS)) or "float only"
            sizes = {v: os.path.getsize(p) for v, p in paths.items()}
            agree = {}
            for v, sess in sessions.items():
                got = np.concatenate([sess.run(None, {"input": x_eval[i:i + 32]})[0] for i in range(0, 256, 32)])
                agree[v] = float((got.argmax(1) == reference[v].argmax(1)).mean())
            feeds = {b: {"input": x_eval[:b]} for b in (1, 32)}
            med = interleaved_medians({(v, b): (lambda s=sessions[v], f=feeds[b]: s.run(None, f))
                                       for v in sessions for b in feeds}, args.rounds, args.calls)
        for v in sessions:
            print(artifact_row(name, v, sizes[v], sizes["float"], med, agree[v],
                               "fake-quant torch" if v == "ours-int8" else "float torch", kernels[v]), flush=True)

if __name__ == "__main__":
    main()
