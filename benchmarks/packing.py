"""Compressed model files: sizes per codec and pack / unpack time (numpy only, no framework needed).

    python benchmarks/packing.py [--rounds N] [--from DIR] [--skip-10m]

Models (float32):

* **LeNet-300-100** and **LeNet-5** pruned to the per-layer kept fractions of Han et al. 2015 and weight
  shared with the bits of Deep Compression (6 / 8 conv + 5 fc). By default the weights are SYNTHETIC:
  PyTorch's default initialisation (uniform +-1/sqrt(fan_in)), magnitude-pruned (core ``level_mask``) and
  k-means shared (core ``share_weights``) without training, so the positions are uniformly random; with
  ``--from DIR`` the TRAINED files of ``examples/reproduce_deep_compression.py --save-dir DIR`` are used
  instead (``DIR/<backend>/<model>-pruned.cmpk`` and ``-final.cmpk``).
* a **10 M-parameter MLP** (2048-2048-2048-1024, normal weights): dense, 90 % unstructured (level), 2:4,
  and 90 % + 5-bit shared.

Columns: the dense float32 file (``np.savez``), the masked dense file (the same with the zeros in), the
masked dense file zip-deflated (``np.savez_compressed``, a generic baseline), then our compressed file
(:mod:`compressor.core.cmpk`) with each single codec and with ``auto`` (smallest per stream), the rate
dense / auto, and the median wall time of ``pack`` (auto) and ``unpack`` over ``--rounds`` runs.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from compressor.core.cmpk import CODECS, pack_bytes, unpack, unpack_bytes  # noqa: E402
from compressor.core.ops import NumpyOps  # noqa: E402
from compressor.core.pruning import level_mask, nm_mask  # noqa: E402
from compressor.core.weight_sharing import share_weights  # noqa: E402

OPS = NumpyOps()
#: (name, weight shape in [out, in, k...] layout, Han 2015 kept fraction, Deep Compression weight bits)
LENET300 = [("fc1", (300, 784), 0.08, 6), ("fc2", (100, 300), 0.09, 6), ("fc3", (10, 100), 0.26, 6)]
LENET5 = [("conv1", (20, 1, 5, 5), 0.66, 8), ("conv2", (50, 20, 5, 5), 0.12, 8), ("fc1", (500, 800), 0.08, 5),
          ("fc2", (10, 500), 0.19, 5)]
BIG = [("fc1", (2048, 2048)), ("fc2", (2048, 2048)), ("fc3", (1024, 2048))]


def synthetic(layers: list, seed: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(pruned weights, pruned + shared weights) of a paper model with torch-like random initialisation."""
    rng = np.random.default_rng(seed)
    pruned, shared = {}, {}
    for name, shape, kept, bits in layers:
        fan_in = int(np.prod(shape[1:]))
        bound = 1 / math.sqrt(fan_in)
        w = rng.uniform(-bound, bound, shape).astype(np.float32)
        b = rng.uniform(-bound, bound, shape[0]).astype(np.float32)
        w = np.where(level_mask(OPS, w, round(1 - kept, 6)), w, np.float32(0))
        pruned[f"{name}.weight"], pruned[f"{name}.bias"] = w, b
        shared[f"{name}.weight"], shared[f"{name}.bias"] = share_weights(w, bits)[0], b
    return pruned, shared


def big_variants(seed: int) -> dict[str, dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    dense = {}
    for name, shape in BIG:
        dense[f"{name}.weight"] = (rng.standard_normal(shape) * 0.02).astype(np.float32)
        dense[f"{name}.bias"] = (rng.standard_normal(shape[0]) * 0.02).astype(np.float32)
    level, nm, shared = {}, {}, {}
    for k, v in dense.items():
        if v.ndim == 1:
            level[k] = nm[k] = shared[k] = v
            continue
        level[k] = np.where(level_mask(OPS, v, 0.9), v, np.float32(0))
        nm[k] = np.where(nm_mask(OPS, v, 2, 4), v, np.float32(0))
        shared[k] = share_weights(level[k], 5, iterations=20)[0]
    return {"dense": dense, "90 % level": level, "2:4": nm, "90 % + 5-bit shared": shared}


def npz_bytes(arrays: dict[str, np.ndarray], compressed: bool) -> int:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.tell()


def timed(fn: Callable[[], object], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def row(model: str, variant: str, arrays: dict[str, np.ndarray], dense: dict[str, np.ndarray], rounds: int) -> list[str]:
    sizes = {c: len(pack_bytes(arrays, c)[0]) for c in CODECS}
    packed: list[bytes] = []
    t_pack = timed(lambda: packed.append(pack_bytes(arrays, "auto")[0]), rounds)
    data = packed[-1]
    t_unpack = timed(lambda: unpack_bytes(data), rounds)
    out, _ = unpack_bytes(data)
    assert all(out[k].tobytes() == v.tobytes() for k, v in arrays.items()), "round trip is not bit-exact"
    n = sum(v.size for v in arrays.values())
    base = npz_bytes(dense, False)
    kb = lambda b: f"{b / 1000:,.1f}"  # noqa: E731
    return [model, variant, f"{n / 1e6:.2f} M", kb(base), kb(npz_bytes(arrays, False)), kb(npz_bytes(arrays, True)),
            *[kb(sizes[c]) for c in CODECS], kb(len(data)), f"{base / len(data):.1f}x", f"{t_pack:.2f}",
            f"{t_unpack:.3f}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--from", dest="source", metavar="DIR", help="trained files of reproduce_deep_compression --save-dir")
    p.add_argument("--skip-10m", action="store_true")
    args = p.parse_args(argv)
    rows = []
    for model, layers in (("LeNet-300-100", LENET300), ("LeNet-5", LENET5)):
        key = "lenet300" if layers is LENET300 else "lenet5"
        found = False
        if args.source:
            for backend in ("torch", "tf"):
                d = Path(args.source) / backend
                if (d / f"{key}-final.cmpk").is_file():
                    pruned, final = unpack(d / f"{key}-pruned.cmpk"), unpack(d / f"{key}-final.cmpk")
                    dense = {k: np.ones_like(v) for k, v in pruned.items()}  # same shapes: the dense file size
                    rows.append(row(f"{model} (trained, {backend})", "pruned", pruned, dense, args.rounds))
                    rows.append(row(f"{model} (trained, {backend})", "pruned + shared", final, dense, args.rounds))
                    found = True
        if not found:
            pruned, final = synthetic(layers, 0)
            dense = {k: np.ones_like(v) for k, v in pruned.items()}
            rows.append(row(f"{model} (synthetic)", "pruned", pruned, dense, args.rounds))
            rows.append(row(f"{model} (synthetic)", "pruned + shared", final, dense, args.rounds))
    if not args.skip_10m:
        variants = big_variants(0)
        for name, arrays in variants.items():
            rows.append(row("MLP 10.5 M", name, arrays, variants["dense"], 1))
    header = ["model", "variant", "params", "dense KB", "masked dense KB", "masked dense zip KB",
              *[f"{c} KB" for c in CODECS], "auto KB", "dense / auto", "pack s", "unpack s"]
    print(f"numpy {np.__version__}; {os.cpu_count()} CPUs; times: median of {args.rounds} runs (10 M model: "
          f"one run), wall clock, one thread")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(r) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
