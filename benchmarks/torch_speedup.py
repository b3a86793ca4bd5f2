"""Structured pruning + speedup on PyTorch: smaller and faster for real, next to Torch-Pruning.

For each model and channel sparsity (30 / 50 / 70 %): ours = ``L1FilterPruner(dependency_aware=True)`` on
every Conv2d, ``compress()``, ``speedup_model``; Torch-Pruning (if installed) = ``MagnitudePruner`` with L1
magnitude importance at the same ratio, the classifier ignored. Prints params, MACs (every variant
counted by ``count_flops_params``, so the ratios compare) and measured CPU latency at batch 1 and
32 as ratios to the dense model, interleaved in one run in a shuffled order (median of ``--rounds``), and the time to prune +
speed up. Models: a CIFAR-style ResNet-18 (written here; torchvision is not a dependency) and HF
transformers ResNet / MobileNetV2 from small configs when transformers is installed.

    python benchmarks/torch_speedup.py [--rounds 15] [--threads 2] [--ratios 0.3 0.5 0.7] [--channels-last]
"""

from __future__ import annotations

import argparse
import copy
import math
import random
import statistics
import time

import torch
from torch import nn

import compressor.torch as cth


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNet18(nn.Module):
    """The CIFAR variant (3x3 stem, no max-pool), 11.17 M parameters."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(torch.relu(self.bn1(self.conv1(x))))
        return self.fc(x.mean((2, 3)))


class Logits(nn.Module):
    """HF image classifiers return a ModelOutput: benchmark the logits tensor."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=x).logits


def models() -> dict[str, tuple[nn.Module, tuple[int, ...], list[str]]]:
    """name -> (model, input shape without batch, layers to leave alone)."""
    out = {"resnet18-cifar": (ResNet18(), (3, 32, 32), ["fc"])}
    try:
        import transformers as hf
    except ImportError:
        return out
    cfg = hf.ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10)
    out["hf-resnet"] = (Logits(hf.ResNetForImageClassification(cfg)), (3, 64, 64), ["model.classifier.1"])
    cfg = hf.MobileNetV2Config(image_size=64, depth_multiplier=0.5, num_labels=10)
    out["hf-mobilenetv2"] = (Logits(hf.MobileNetV2ForImageClassification(cfg)), (3, 64, 64), ["model.classifier"])
    return out


def randomize_norms(model: nn.Module) -> None:
    """Fresh BatchNorms are identities; give them statistics as a trained model has."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)


def ours(model: nn.Module, x: torch.Tensor, ratio: float, ignore: list[str]) -> tuple[nn.Module, float]:
    t0 = time.perf_counter()
    config = [{"sparsity": ratio, "op_types": ["Conv2d"]}, {"exclude": True, "op_names": ignore}]
    pruner = cth.L1FilterPruner(model, config, dependency_aware=True, dummy_input=x)
    pruner.compress()
    small = cth.speedup_model(pruner, x)
    return small.eval(), time.perf_counter() - t0


def run_torch_pruning(model: nn.Module, x: torch.Tensor, ratio: float, ignore: list[str],
                      floor: bool = False) -> tuple[nn.Module, float]:
    """Torch-Pruning's MagnitudePruner (L1). It removes round(C * ratio) channels per group; with ``floor`` each
    conv gets the per-layer ratio floor(C * ratio) / C, so it removes exactly the channels ours does (same
    shapes, checked by the caller) and the latencies compare like for like."""
    import torch_pruning as tp

    t0 = time.perf_counter()
    ignored = [m for n, m in model.named_modules() if n in ignore]
    per_layer = None
    if floor:
        per_layer = {m: math.floor(m.out_channels * ratio) / m.out_channels for m in model.modules()
                     if isinstance(m, nn.Conv2d) and m.groups == 1}
    pruner = tp.pruner.MagnitudePruner(model, x, importance=tp.importance.MagnitudeImportance(p=1),
                                       pruning_ratio=ratio, pruning_ratio_dict=per_layer, ignored_layers=ignored)
    pruner.step()
    return model.eval(), time.perf_counter() - t0


def deployed(model: nn.Module, x: torch.Tensor, channels_last: bool) -> tuple[nn.Module, torch.Tensor]:
    """The model and input as they are timed: as built, or in channels-last memory format (oneDNN then needs
    no channel padding to its vector width, which matters for the odd widths pruning leaves)."""
    if not channels_last:
        return model, x
    return model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)


@torch.no_grad()
def latency(model: nn.Module, x: torch.Tensor, iters: int) -> float:
    t0 = time.perf_counter()
    for _ in range(iters):
        model(x)
    return (time.perf_counter() - t0) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ratios", type=float, nargs="+", default=[0.3, 0.5, 0.7])
    p.add_argument("--models", nargs="+", default=None)
    p.add_argument("--channels-last", action="store_true",
                   help="time every variant, the dense baseline included, in channels-last memory format")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    try:
        import torch_pruning  # noqa: F401
        have_tp = True
    except ImportError:
        have_tp = False
    print(f"torch {torch.__version__}, {args.threads} threads, {args.rounds} interleaved rounds, medians; "
          f"ratios = variant / dense of the same round; memory format "
          f"{'channels-last' if args.channels_last else 'as built (contiguous)'}; MACs of every variant by "
          f"count_flops_params")
    # "b32 / MACs": the batch-32 latency ratio over the MACs ratio (1 = time shrinks exactly with the MACs).
    # Torch-Pruning prunes round(C * ratio) channels, we prune floor(C * ratio) (issue 14's rule): the
    # "torch-pruning floor" variant removes our channel counts with Torch-Pruning, so its model has our shapes
    print("| model | sparsity | variant | params | MACs | latency b1 | latency b32 | b32 / MACs | prune+speedup s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (model, shape, ignore) in models().items():
        if args.models and name not in args.models:
            continue
        randomize_norms(model)
        model.eval()
        x1, x32 = torch.randn(1, *shape), torch.randn(32, *shape)
        dmacs, dparams, _ = cth.count_flops_params(model, x1)
        print(f"| {name} | 0 | dense | {dparams / 1e6:.2f} M | {dmacs / 1e6:.1f} M | 1 | 1 | 1 | - |")
        for ratio in args.ratios:
            built: dict[str, tuple[nn.Module, float]] = {"ours": ours(copy.deepcopy(model), x1, ratio, ignore)}
            if have_tp:
                built["torch-pruning"] = run_torch_pruning(copy.deepcopy(model), x1, ratio, ignore)
                built["torch-pruning floor"] = run_torch_pruning(copy.deepcopy(model), x1, ratio, ignore, floor=True)
                same = [p.shape for p in built["ours"][0].state_dict().values()] == \
                    [p.shape for p in built["torch-pruning floor"][0].state_dict().values()]
                if not same:
                    print(f"(torch-pruning floor: shapes differ from ours on {name} at {ratio:.0%})")
            counts = {k: cth.count_flops_params(m, x1)[:2] for k, (m, _s) in built.items()}
            dense, xb1 = deployed(copy.deepcopy(model), x1, args.channels_last)
            xb32 = x32.contiguous(memory_format=torch.channels_last) if args.channels_last else x32
            timed = {k: deployed(m, x1, args.channels_last)[0] for k, (m, _s) in built.items()}
            ratios: dict[str, dict[str, list[float]]] = {k: {"b1": [], "b32": []} for k in timed}
            with torch.inference_mode():
                for v in [dense, *timed.values()]:
                    latency(v, xb32, 2)
                for r in range(args.rounds):
                    # a fresh order every round: whatever runs right after another model pays for its
                    # caches, which alone made identical shapes differ by 5-8 % in a fixed order
                    order = ["dense", *timed]
                    random.Random(r).shuffle(order)
                    t = {k: {"b1": latency(dense if k == "dense" else timed[k], xb1, 20),
                             "b32": latency(dense if k == "dense" else timed[k], xb32, 2)} for k in order}
                    for k in timed:
                        ratios[k]["b1"].append(t[k]["b1"] / t["dense"]["b1"])
                        ratios[k]["b32"].append(t[k]["b32"] / t["dense"]["b32"])
            for k, (_m, secs) in built.items():
                macs, params = counts[k]
                b1, b32 = statistics.median(ratios[k]["b1"]), statistics.median(ratios[k]["b32"])
                print(f"| {name} | {ratio:.0%} | {k} | {params / dparams:.3f}x | {macs / dmacs:.3f}x | "
                      f"{b1:.3f}x | {b32:.3f}x | {b32 / (macs / dmacs):.2f} | {secs:.2f} |", flush=True)

if __name__ == "__main__":
    main()
