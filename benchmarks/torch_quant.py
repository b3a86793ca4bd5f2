"""QAT train-step time: compressor's QAT_Quantizer vs torch.ao ``prepare_qat``, both relative to dense.

One small CNN, the same quantization points in both (8-bit weights + outputs of every Conv2d/Linear),
the same data. Variants are timed in interleaved rounds (each round runs every variant for ``--steps``
steps, in a shuffled order), and the medians over rounds are compared, so drifting machine load hits all
of them alike; keep rounds short (default one step) on a shared machine.

* ``ao-FakeQuantize``: ``torch.ao.quantization.default_qat_qconfig`` (FakeQuantize + MovingAverageMinMax
  observers; weights per-tensor symmetric int8, activations per-tensor affine uint8), vs ours with the
  same schemes;
* ``ao-fused``: ``get_default_qat_qconfig('x86')`` (FusedMovingAvgObsFakeQuantize; weights per-channel
  symmetric), vs ours with per-channel symmetric weights.

``--cpu-time``: one intra-op thread and the thread's CPU time instead of wall time: the work done, robust
against other processes on a shared machine (with 2 threads, waits at parallel-region barriers while
a worker is descheduled dominate wall time there).

Usage: ``python benchmarks/torch_quant.py [--device cuda] [--cpu-time] [--rounds 150] [--steps 1] [--batch 32]``
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
import warnings

import torch
from torch import nn

try:
    from benchmarks._device import torch_device
except ModuleNotFoundError:  # run as a file (python benchmarks/<name>.py): its folder is on sys.path
    from _device import torch_device
from compressor.torch import QAT_Quantizer


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3)
        self.relu1 = nn.ReLU()
        self.conv2 = nn.Conv2d(16, 32, 3)
        self.relu2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.flat = nn.Flatten()
        self.fc1 = nn.Linear(32 * 12 * 12, 64)
        self.relu3 = nn.ReLU()
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu2(self.conv2(self.relu1(self.conv1(x)))))
        return self.fc2(self.relu3(self.fc1(self.flat(x))))


def ours(base: nn.Module, per_channel: bool) -> nn.Module:
    model = copy.deepcopy(base)
    config = [{
        "op_types": ["Conv2d", "Linear"], "quant_types": ["weight", "output"], "quant_bits": 8,
        "quant_dtype": {"weight": "int", "output": "uint"},
        "quant_scheme": {"weight": "per_channel_symmetric" if per_channel else "per_tensor_symmetric",
                         "output": "per_tensor_affine"},
    }]
    return QAT_Quantizer(model, config).compress()


def torch_ao(base: nn.Module, fused: bool) -> nn.Module:
    import torch.ao.quantization as tq

    model = copy.deepcopy(base).train()
    qconfig = tq.get_default_qat_qconfig("x86") if fused else tq.default_qat_qconfig
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            m.qconfig = qconfig  # same quantization points as ours: weight + output of Conv2d/Linear
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # deprecation notices of eager-mode torch.ao
        return tq.prepare_qat(model, inplace=False)


def time_steps(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor, steps: int,
               clock=time.perf_counter) -> float:
    loss_fn = nn.CrossEntropyLoss()
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    sync()
    t0 = clock()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()
    sync()
    return (clock() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=150)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cpu-time", action="store_true", help="1 thread, thread CPU time instead of wall time")
    args = ap.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        if args.device != "cpu":
            ap.error("--cpu-time is for --device cpu")
        args.threads, clock = 1, time.thread_time
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dev = torch_device(ap, args.device)
    base = SmallCNN().to(dev)
    x = torch.randn(args.batch, 1, 28, 28, device=dev)
    y = torch.randint(0, 10, (args.batch,), device=dev)

    variants = {
        "dense": copy.deepcopy(base),
        "ours (per-tensor w)": ours(base, per_channel=False),
        "ao-FakeQuantize": torch_ao(base, fused=False),
        "ours (per-channel w)": ours(base, per_channel=True),
        "ao-fused (x86)": torch_ao(base, fused=True),
    }
    opts = {k: torch.optim.SGD(m.parameters(), lr=1e-3, momentum=0.9) for k, m in variants.items()}
    for k, m in variants.items():  # warm-up (also seeds observers)
        time_steps(m, opts[k], x, y, 3)
    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for k in order:
            times[k].append(time_steps(variants[k], opts[k], x, y, args.steps, clock))
    med = {k: statistics.median(v) for k, v in times.items()}
    what = "thread CPU time" if args.cpu_time else "wall time"
    print(f"device={dev} threads={args.threads} batch={args.batch} rounds={args.rounds} steps/round={args.steps} ({what})")
    for k, v in med.items():
        print(f"  {k:22s} {v * 1e3:8.3f} ms/step   x{v / med['dense']:.3f} dense")
    print(f"ours/ao (per-tensor weights, vs FakeQuantize):  {med['ours (per-tensor w)'] / med['ao-FakeQuantize']:.3f}")
    print(f"ours/ao (per-channel weights, vs fused x86):    {med['ours (per-channel w)'] / med['ao-fused (x86)']:.3f}")


if __name__ == "__main__":
    main()
