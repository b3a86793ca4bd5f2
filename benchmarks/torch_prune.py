"""Cost of pruning masks on PyTorch: ours vs dense vs torch.nn.utils.prune, and level-mask speed.

Prints, in one run with interleaved repeats (medians):
* train-step and inference time of two small CNNs at 70 % sparsity: dense / ours (LevelPruner, optimizer
  hooked) / torch.nn.utils.prune (l1_unstructured), as ratios to dense;
* time to compute a level mask of a 4096x4096 weight: ours (core ``level_mask``: kthvalue + exact
  tie count) vs NNI's rule (``topk(k, largest=False).values.max()`` then ``>``);
* extra bytes per pruned weight kept by each approach.

``ours`` re-masks after each optimizer step with a cached copy of the mask in the weight's dtype (the
default on CPU); ``ours-nocache`` (``PrunerModuleWrapper.multiplier_cache = False``) multiplies by the bool
mask's bytes instead: 4 bytes per weight less memory, a slower re-mask.

    python benchmarks/torch_prune.py [--device cuda] [--repeats 101] [--iters 2] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.utils.prune as tprune
from torch import nn

try:
    from benchmarks._device import torch_device
except ModuleNotFoundError:  # run as a file (python benchmarks/<name>.py): its folder is on sys.path
    from _device import torch_device
from compressor.core.pruning import level_mask
from compressor.torch.ops import ops
from compressor.torch.pruning import LevelPruner

SPARSITY = 0.7


def cifar_cnn() -> nn.Module:
    """3 conv + 2 linear on 3x32x32 (compute-heavy for its 280 k weights)."""
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
        nn.Linear(32 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, 10),
    )


def mnist_cnn() -> nn.Module:
    """The shape of NNI's MNIST example (2 conv + 2 linear, 430 k weights, mostly in fc1): weight-heavy,
    so per-weight costs (masking) weigh most here."""
    return nn.Sequential(
        nn.Conv2d(1, 20, 5), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(20, 50, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
        nn.Linear(4 * 4 * 50, 500), nn.ReLU(), nn.Linear(500, 10),
    )


MODELS = {"cifar-cnn": (cifar_cnn, (16, 3, 32, 32)), "mnist-cnn": (mnist_cnn, (64, 1, 28, 28))}


def variants(make, device):
    def fresh():
        torch.manual_seed(0)
        return make().to(device)

    out = {}
    model = fresh()
    out["dense"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    model = fresh()  # the same dense model again: its ratio to "dense" is the noise floor of this run
    out["dense-copy"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))

    model = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    LevelPruner(model, [{"sparsity": SPARSITY, "op_types": ["Conv2d", "Linear"]}], opt).compress()
    out["ours"] = (model, opt)

    model = fresh()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    pruner = LevelPruner(model, [{"sparsity": SPARSITY, "op_types": ["Conv2d", "Linear"]}], opt)
    for wrapper in pruner.get_modules_wrapper():
        wrapper.multiplier_cache = False  # re-mask with the bool mask's bytes: 4 bytes/weight less memory
    pruner.compress()
    out["ours-nocache"] = (model, opt)

    model = fresh()
    for m in model.modules():
        if isinstance(m, (nn.Conv2d, nn.Linear)):
            tprune.l1_unstructured(m, "weight", amount=SPARSITY)
    out["torch.prune"] = (model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9))
    return out


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, n, device):
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


def bench_model(name, device, repeats, iters):
    make, shape = MODELS[name]
    vs = variants(make, device)
    x = torch.randn(*shape, device=device)
    y = torch.randint(0, 10, (shape[0],), device=device)
    loss_fn = nn.CrossEntropyLoss()

    def train(model, opt):
        def f():
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()
        return f

    def infer(model):
        def f():
            with torch.no_grad():
                model(x)
        return f

    for model, opt in vs.values():  # warm-up
        timed(train(model, opt), 3, device)
        timed(infer(model.eval()), 3, device)
        model.train()
    res = {k: {"train": [], "infer": []} for k in vs}
    names = list(vs)
    for r in range(repeats):
        for variant in names[r % len(names):] + names[:r % len(names)]:  # rotate the order: no position bias
            model, opt = vs[variant]
            model.train()
            res[variant]["train"].append(timed(train(model, opt), iters, device))
            model.eval()
            res[variant]["infer"].append(timed(infer(model), iters, device))
    med = {k: {m: statistics.median(v) for m, v in d.items()} for k, d in res.items()}
    # paired: the ratio to the dense run of the SAME round (rounds are ~0.1 s apart, so slow drifts of a
    # shared machine cancel), then the median over rounds, with the 25th-75th percentile of those ratios
    paired = {k: {m: sorted(a / b for a, b in zip(v, res["dense"][m])) for m, v in d.items()} for k, d in res.items()}
    print(f"\n{name}, batch {'x'.join(map(str, shape))}, {SPARSITY:.0%} sparsity, "
          f"{repeats} interleaved rounds x {iters} iters")
    print(f"{'variant':<13} {'train ms':>9} {'ratio':>6} {'IQR':>11}  {'infer ms':>9} {'ratio':>6} {'IQR':>11}")
    for k, d in med.items():
        cells = []
        for m in ("train", "infer"):
            r = paired[k][m]
            q1, q2, q3 = r[len(r) // 4], statistics.median(r), r[(3 * len(r)) // 4]
            cells.append(f"{d[m] * 1e3:9.3f} {q2:6.3f} {q1:5.3f}-{q3:5.3f}")
        print(f"{k:<13} {cells[0]}  {cells[1]}")
    ours = vs["ours"][0]
    w = ours[0].module.weight  # the first layer is a wrapped Conv2d in both models
    assert bool((w[~ours[0].weight_mask] == 0).all()), "ours: pruned weights must stay zero while training"



def nni_rule(w, s):
    k = int(w.numel() * s)
    a = w.abs()
    thr = torch.topk(a.view(-1), k, largest=False).values.max()
    return a > thr


def bench_level(device, repeats):
    g = torch.Generator(device="cpu").manual_seed(0)
    w = torch.randn(4096, 4096, generator=g).to(device)
    fns = {"ours (kthvalue)": lambda: level_mask(ops, w, SPARSITY), "NNI topk rule": lambda: nni_rule(w, SPARSITY)}
    for f in fns.values():
        timed(f, 1, device)
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            times[k].append(timed(f, 1, device))
    base = statistics.median(times["ours (kthvalue)"])
    print(f"\nlevel mask of a 4096x4096 weight at {SPARSITY:.0%}, median of {repeats}")
    for k, v in times.items():
        m = statistics.median(v)
        print(f"{k:<16} {m * 1e3:9.1f} ms  {m / base:5.2f}x")
    ties = torch.ones(4, 4, device=device)
    print(f"ties (16 equal weights, sparsity 5/16): ours prunes {int((~level_mask(ops, ties, 5 / 16)).sum())}, "
          f"NNI rule prunes {int((~nni_rule(ties, 5 / 16)).sum())}")


def bench_bytes():
    print("\nextra bytes per prunable weight (float32 weights)")
    seq = nn.Sequential(nn.Linear(256, 256, bias=False))
    opt = torch.optim.SGD(seq.parameters(), lr=0.01)
    LevelPruner(seq, [{"sparsity": SPARSITY, "op_types": ["Linear"]}], opt).compress()
    seq(torch.randn(2, 256)).sum().backward()
    opt.step()  # the re-mask after the step builds the multiplier cache
    stored = seq[0].weight_mask.element_size()
    cache = seq[0]._mul_cache[0][1].element_size()
    print(f"ours (CPU)   {stored + cache:>3}  (bool mask buffer, {stored} byte saved in checkpoints, + {cache} bytes "
          f"runtime multiplier cache; weight pruned in place)")
    print(f"ours (CUDA)  {stored:>3}  (bool mask only: no multiplier cache on accelerators by default)")
    print(f"ours-nocache {stored:>3}  (multiplier_cache = False: bool mask only)")
    m = nn.Linear(256, 256, bias=False)
    tprune.l1_unstructured(m, "weight", amount=SPARSITY)
    per = (m.weight_mask.element_size() + m.weight_orig.element_size() + m.weight.element_size()) - 4
    print(f"torch.prune  {per:>3}  (float mask + weight_orig + recomputed weight)")
    print("NNI 1.x        4  (float32 mask)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=101)
    ap.add_argument("--iters", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch_device(ap, args.device)
    print(f"torch {torch.__version__}, device {device}, {torch.get_num_threads()} threads")
    print("ratio = median over rounds of (variant time / dense time in the same round); IQR = 25th-75th "
          "percentile of those ratios; dense-copy = a second identical dense model (the noise floor)")
    for name in MODELS:
        bench_model(name, device, args.repeats, args.iters)
    bench_level(device, max(5, args.repeats // 2))
    bench_bytes()


if __name__ == "__main__":
    main()
