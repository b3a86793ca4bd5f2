"""Integer ONNX inference: float ONNX vs compressor's int8 QDQ export vs onnxruntime's ``quantize_static``.

One small CNN (3 conv + 2 linear on 3x32x32), QAT-trained briefly with compressor's ``QAT_Quantizer``
(8-bit per-channel symmetric int8 weights; uint8 per-tensor affine inputs and outputs of every
Conv2d/Linear), then exported three ways:

* ``float``: the same architecture's float weights (the QAT model's, unquantized), ``torch.onnx`` export;
* ``ours-int8``: ``quantizer.export_model(..., onnx_path=...)`` (int8 weight initializers + QDQ);
* ``ort-quantize_static``: onnxruntime's own post-training quantizer on the float ONNX (QDQ format,
  per-channel, uint8 activations / int8 weights, MinMax calibration on 256 training inputs).

Reported: file size, latency at batch 1 and 32 (onnxruntime CPU, ``--threads`` intra-op threads, default
graph optimisation), each as a ratio to float; agreement of argmax with the fake-quant torch model; the
integer kernels in onnxruntime's optimised graph. Latencies are medians over ``--rounds`` rounds; each round
runs every variant ``--calls`` times in a shuffled order (interleaved, so machine load hits all alike).

Usage: ``python benchmarks/torch_quant_onnx.py [--rounds 60] [--calls 20] [--threads 2]``
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import tempfile
import time
import warnings

import numpy as np
import torch
from torch import nn

from compressor.torch import QAT_Quantizer

INTEGER_OPS = {"QLinearConv", "ConvInteger", "QLinearMatMul", "MatMulInteger", "QGemm", "MatMulIntegerToFloat"}


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.conv3 = nn.Conv2d(64, 64, 3, padding=1)
        self.pool = nn.MaxPool2d(2)
        self.relu = nn.ReLU()
        self.flat = nn.Flatten()
        self.fc1 = nn.Linear(64 * 4 * 4, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.conv1(x)))
        x = self.pool(self.relu(self.conv2(x)))
        x = self.pool(self.relu(self.conv3(x)))
        return self.fc2(self.relu(self.fc1(self.flat(x))))


def data(g: torch.Generator, proto: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.randint(0, 10, (n,), generator=g)
    return proto[y] + 0.8 * torch.randn(n, 3, 32, 32, generator=g), y


def build(tmp: str) -> tuple[dict[str, str], nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = CNN()
    types = ["weight", "input", "output"]
    q = QAT_Quantizer(model, [{"op_types": ["Conv2d", "Linear"], "quant_types": types, "quant_bits": 8,
                               "quant_dtype": {"weight": "int", "input": "uint", "output": "uint"},
                               "quant_scheme": {"weight": "per_channel_symmetric", "input": "per_tensor_affine",
                                                "output": "per_tensor_affine"}}])
    opt = torch.optim.Adam(model.parameters(), lr=2e-3)
    q.hook_optimizer(opt)
    g = torch.Generator().manual_seed(1)
    proto = torch.randn(10, 3, 32, 32, generator=g)
    model.train()
    for _ in range(40):
        x, y = data(g, proto, 32)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    model.eval()
    paths = {name: os.path.join(tmp, f"{name}.onnx") for name in ("float", "ours-int8", "ort-quantize_static")}
    q.export_model(os.path.join(tmp, "m.pt"), onnx_path=paths["ours-int8"], input_shape=(1, 3, 32, 32))

    float_model = CNN()  # the same float weights, no quantization
    q._unwrap_model()
    try:
        float_model.load_state_dict(copy.deepcopy(model.state_dict()))
    finally:
        q._wrap_model()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(float_model.eval(), (torch.randn(1, 3, 32, 32),), paths["float"], dynamo=False,
                          input_names=["input"], dynamic_axes={"input": {0: "batch"}})

    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    calib, _ = data(g, proto, 256)

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.it = iter([{"input": calib[i:i + 32].numpy()} for i in range(0, 256, 32)])

        def get_next(self):  # noqa: ANN201
            return next(self.it, None)

    pre = os.path.join(tmp, "float-pre.onnx")
    quant_pre_process(paths["float"], pre)
    quantize_static(pre, paths["ort-quantize_static"], Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    x_eval, _ = data(g, proto, 256)
    return paths, model, x_eval


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import onnx
    import onnxruntime as ort

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        paths, model, x_eval = build(tmp)
        sessions, kernels = {}, {}
        for name, path in paths.items():
            so = ort.SessionOptions()
            so.intra_op_num_threads = args.threads
            so.inter_op_num_threads = 1
            so.optimized_model_filepath = os.path.join(tmp, f"{name}-opt.onnx")
            so.log_severity_level = 3
            sessions[name] = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
            ops = [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]
            kernels[name] = sorted({op for op in ops if op in INTEGER_OPS}) or ["float only"]
        sizes = {name: os.path.getsize(p) for name, p in paths.items()}
        with torch.no_grad():
            want = model(x_eval).numpy().argmax(1)
        agree = {}
        for name, sess in sessions.items():
            got = np.concatenate([sess.run(None, {"input": x_eval[i:i + 32].numpy()})[0] for i in range(0, 256, 32)])
            agree[name] = float((got.argmax(1) == want).mean())

        times: dict[tuple[str, int], list[float]] = {(n, b): [] for n in sessions for b in (1, 32)}
        feeds = {b: {"input": x_eval[:b].numpy()} for b in (1, 32)}
        order = list(times)
        rng = random.Random(0)
        for key in order:  # warm-up
            for _ in range(3):
                sessions[key[0]].run(None, feeds[key[1]])
        for _ in range(args.rounds):
            rng.shuffle(order)
            for name, b in order:
                sess, feed = sessions[name], feeds[b]
                t0 = time.perf_counter()
                for _ in range(args.calls):
                    sess.run(None, feed)
                times[(name, b)].append((time.perf_counter() - t0) / args.calls)

    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"onnxruntime {ort.__version__}, {args.threads} threads, {args.rounds} rounds x {args.calls} calls, "
          f"medians (interleaved)")
    print("| variant | file KB | size vs float | batch 1 ms | vs float | batch 32 ms | vs float | "
          "argmax = fake-quant torch | integer kernels |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in sessions:
        print(f"| {name} | {sizes[name] / 1024:.1f} | {sizes[name] / sizes['float']:.2f}x | "
              f"{med[(name, 1)] * 1e3:.3f} | {med[(name, 1)] / med[('float', 1)]:.2f}x | "
              f"{med[(name, 32)] * 1e3:.2f} | {med[(name, 32)] / med[('float', 32)]:.2f}x | "
              f"{agree[name] * 100:.1f}% | {', '.join(kernels[name])} |")


if __name__ == "__main__":
    main()
