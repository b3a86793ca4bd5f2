"""Deep Compression (Han et al., ICLR 2016) on MNIST with both backends, and 2:4 sparsity on LeNet-300-100.

Pipeline per model (the paper's Tables 2-3; LeNet-300-100: 1070 KB -> 27 KB, 40x; LeNet-5: 1720 KB -> 44 KB,
39x; both without loss of accuracy):

1. dense training (``examples.reproduce_han2015`` schedules, with decoupled weight decay 0.3);
2. **pruning**: our Han et al. 2015 recipe, ``LevelPruner`` rounds to the per-layer kept fractions (the
   paper's, except fc1 at 6.5 % (LeNet-300-100) / 6 % (LeNet-5) instead of 8 %; ``--paper-fractions``: all the paper's, no weight decay),
   retraining after each round, export + reload between rounds;
3. **trained quantization**: ``WeightSharingQuantizer`` on the reloaded plain model: k-means of each
   layer's kept weights into ``2**bits`` centroids (linear initialisation), then fine-tuning the centroids
   with the summed gradients of their members; bits as in the paper's tables (LeNet-300-100: 6 for every
   layer; LeNet-5: 8 for the convolutions, 5 for the fully connected layers);
4. **coding**: ``export_model(..., compressed_path=...)``: kept values as a codebook + indices, positions
   as a bitmask or relative indices, each stream Huffman / zlib / lzma coded (the smallest kept).

Measured: the compression rate = dense float32 file bytes / compressed file bytes, both on disk (the dense
file is the backend's weights file: a torch ``state_dict`` ``.pt``; a Keras ``.weights.h5``), also against
the raw float32 bytes (4 x parameters, what the paper's 1070 KB counts), and the test error of the model
LOADED FROM THE COMPRESSED FILE into a fresh instance of the model class (``load_compressed``), next to the
dense error. Also the file size with each single codec, and the size after pruning alone (no sharing).

``--nm``: LeNet-300-100 pruned to 2:4 (``sparse_pattern: '2:4'`` on every layer) from the dense model and
retrained; error vs dense (issue 18, item 4).

    python -m examples.reproduce_deep_compression [--models lenet300 lenet5] [--nm] [--backend torch|tf|all]
                                                 [--paper-fractions] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from compressor.core.cmpk import CODECS, packed_sizes, unpack
from examples.common import (
    BACKEND_LABEL,
    Train,
    add_common_args,
    backends_of,
    build,
    compile_for,
    dense_baseline,
    err,
    md_table,
    pct,
    reload_exported,
    run_backends,
    save_json,
    train,
)
from examples.reproduce_han2015 import PAPER as HAN
from examples.reproduce_han2015 import RECIPES as HAN_RECIPES
from examples.reproduce_han2015 import level_round_config

#: the paper's Tables 2-3: dense size (float32 weights), compressed size, rate; weight bits per layer
PAPER: dict[str, dict[str, Any]] = {
    "lenet300": {"title": "LeNet-300-100", "dense_kb": 1070, "compressed_kb": 27, "rate": 40,
                 "error": "1.64 % -> 1.58 %", "bits": {"fc1": 6, "fc2": 6, "fc3": 6}},
    "lenet5": {"title": "LeNet-5", "dense_kb": 1720, "compressed_kb": 44, "rate": 39,
               "error": "0.80 % -> 0.74 %", "bits": {"conv1": 8, "conv2": 8, "fc1": 5, "fc2": 5}},
}
TOLERANCE = 0.001  # error may rise by at most 0.1 pp over our dense error


@dataclass(frozen=True)
class Recipe:
    dense: Train
    rounds: int
    retrain: Train  # per pruning round
    share: Train  # centroid fine-tuning
    nm: Train  # 2:4 retraining
    kept: dict[str, float] | None = None  # per-layer kept fractions; None: the paper's (reproduce_han2015.PAPER)


def _with_decay(t: Train, weight_decay: float) -> Train:
    return replace(t, weight_decay=weight_decay)


#: the recipes at the paper's per-layer kept fractions (``--paper-fractions``): 36-37x, below the paper's
#: 40x / 39x, because our coding of those weights costs ~10.3 bits per kept weight where the paper's implies
#: ~9.9 (see RESULTS.md); pruning: the Han recipe of reproduce_han2015 (LeNet-300-100 as there; LeNet-5
#: shortened to fit a shared 2-core CPU); centroid fine-tuning: Adam at a small rate (Adam is scale-free, so
#: summed and averaged member gradients give the same step)
PAPER_FRACTION_RECIPES: dict[tuple[str, bool], Recipe] = {
    ("lenet300", False): Recipe(HAN_RECIPES[("lenet300", False)].dense, 3, HAN_RECIPES[("lenet300", False)].retrain,
                                share=Train(3, 1e-4, decay=0.7), nm=Train(8, 1e-3, decay=0.8)),
    ("lenet5", False): Recipe(Train(6, 1e-3, decay=0.8), 3, Train(4, 5e-4, decay=0.75),
                              share=Train(2, 5e-5, decay=0.7), nm=Train(4, 5e-4, decay=0.8)),
    ("lenet300", True): Recipe(Train(3, 2e-3, 64), 2, Train(1, 2e-4, 64), share=Train(1, 1e-4, 64),
                               nm=Train(1, 5e-4, 64)),
    ("lenet5", True): Recipe(Train(2, 2e-3, 64), 2, Train(1, 2e-4, 64), share=Train(1, 1e-4, 64),
                             nm=Train(1, 5e-4, 64)),
}
#: the default recipes, which reach the paper's rates: the same schedules plus decoupled weight decay 0.3
#: (AdamW on torch, Adam(weight_decay) on Keras; the paper trained with Caffe's L2 weight decay) in dense
#: training and retraining, and the largest layer (fc1, 88 % / 94 % of the weights) pruned to 6.5 % kept on
#: LeNet-300-100 and 6 % on LeNet-5 instead of the paper's 8 % (the others at the paper's fractions; at 6 %
#: LeNet-300-100 met the error bound on only 5 of 6 seed x backend runs, see RESULTS.md)
WEIGHT_DECAY = 0.3
FC1_KEPT = {"lenet300": 0.065, "lenet5": 0.06}
RECIPES: dict[tuple[str, bool], Recipe] = {
    key: replace(r, dense=_with_decay(r.dense, WEIGHT_DECAY), retrain=_with_decay(r.retrain, WEIGHT_DECAY),
                 kept=dict(HAN[key[0]]["kept"], fc1=FC1_KEPT[key[0]]))
    for key, r in PAPER_FRACTION_RECIPES.items()
}


def dense_file_bytes(h: Any, model: Any, ds: Any, directory: str, name: str) -> int:
    """Bytes of the backend's dense weights file: torch ``state_dict`` (.pt), Keras ``.weights.h5`` (of an
    uncompiled copy: a compiled model's weights file also holds the optimizer's slots)."""
    if h.name == "torch":
        path = os.path.join(directory, f"{name}-dense.pt")
        h.torch.save(model.state_dict(), path)
    else:
        path = os.path.join(directory, f"{name}-dense.weights.h5")
        plain = build(h, name, ds)
        plain.set_weights(model.get_weights())
        plain.save_weights(path)
    return os.path.getsize(path)


def load_fresh(h: Any, name: str, ds: Any, path: str) -> Any:
    """A new instance of the model class with the compressed file's weights (``load_compressed``)."""
    model = build(h, name, ds)
    return h.backend.load_compressed(model, path)


def params(weights: dict[str, np.ndarray]) -> int:
    return int(sum(a.size for a in weights.values() if a.dtype.kind == "f"))


def deep_compression(h: Any, name: str, dense: Any, ds: Any, recipe: Recipe, seed: int, progress: Any,
                     tmp: str) -> dict[str, Any]:
    kept, bits = recipe.kept or HAN[name]["kept"], PAPER[name]["bits"]
    model, pruner = h.copy(dense), None
    for r in range(1, recipe.rounds + 1):  # 2. pruning (Han 2015 rounds)
        if pruner is not None:
            model = reload_exported(h, pruner, name, ds)
        opt = compile_for(h, model, recipe.retrain)
        pruner = h.backend.LevelPruner(model, level_round_config(kept, r, recipe.rounds), opt)
        model = pruner.compress()
        train(h, model, ds, recipe.retrain, seed + r, optimizer=opt, compressor=pruner,
              desc=f"{name} prune round {r}", progress=progress)
    pruned_cmpk = os.path.join(tmp, f"{name}-pruned.cmpk")
    model_file = os.path.join(tmp, f"{name}-pruned.{'pt' if h.name == 'torch' else 'keras'}")
    pruner.export_model(model_file, compressed_path=pruned_cmpk)
    pruned_acc = h.evaluate(load_fresh(h, name, ds, pruned_cmpk), ds.x_test, ds.y_test)
    model = reload_exported(h, pruner, name, ds)  # 3. weight sharing on the plain pruned model
    opt = compile_for(h, model, recipe.share)
    config = [{"quant_types": ["weight"], "quant_bits": b, "op_names": [layer]} for layer, b in bits.items()]
    sharer = h.backend.WeightSharingQuantizer(model, config, opt)
    model = sharer.compress()
    shared_acc = h.evaluate(model, ds.x_test, ds.y_test)  # k-means only, before fine-tuning
    train(h, model, ds, recipe.share, seed + 100, optimizer=opt, compressor=sharer, desc=f"{name} share",
          progress=progress)
    final = os.path.join(tmp, f"{name}-final.cmpk")  # 4. coding
    books = sharer.export_model(os.path.join(tmp, f"{name}-final.{'pt' if h.name == 'torch' else 'keras'}"),
                                compressed_path=final)
    loaded = load_fresh(h, name, ds, final)
    weights = unpack(final)
    layer_of = {k: k.rsplit("/" if h.name == "tf" else ".", 1)[0] for k in weights}
    kernels = {k: v for k, v in weights.items() if k.endswith(("weight", "kernel")) and layer_of[k] in bits}
    nonzero = {layer_of[k]: float(np.count_nonzero(v) / v.size) for k, v in kernels.items()}
    distinct = {layer_of[k]: int(np.unique(v[v != 0]).size) for k, v in kernels.items()}
    return {
        "pruned_acc": pruned_acc, "pruned_bytes": os.path.getsize(pruned_cmpk), "kmeans_acc": shared_acc,
        "acc": h.evaluate(loaded, ds.x_test, ds.y_test), "bytes": os.path.getsize(final),
        "codec_bytes": packed_sizes(weights, ("auto", *CODECS)), "params": params(weights),
        "kept_per_layer": nonzero, "centroids_per_layer": distinct,
        "codebook_sizes": {k: int(v.size) for k, v in books.items()},
    }


def two_of_four(h: Any, dense: Any, ds: Any, recipe: Recipe, seed: int, progress: Any, tmp: str) -> dict[str, Any]:
    model = h.copy(dense)
    opt = compile_for(h, model, recipe.nm)
    pruner = h.backend.LevelPruner(model, [{"sparse_pattern": "2:4", "op_names": ["fc1", "fc2", "fc3"]}], opt)
    model = pruner.compress()
    one_shot = h.evaluate(model, ds.x_test, ds.y_test)
    train(h, model, ds, recipe.nm, seed + 200, optimizer=opt, compressor=pruner, desc="lenet300 2:4",
          progress=progress)
    path = os.path.join(tmp, "lenet300-2of4.cmpk")
    pruner.export_model(os.path.join(tmp, f"lenet300-2of4.{'pt' if h.name == 'torch' else 'keras'}"),
                        compressed_path=path)
    weights = unpack(path)
    kernels = [v for k, v in weights.items() if k.endswith(("weight", "kernel"))]
    ok = all(((np.moveaxis(k if h.name == "torch" else k.T, 1, -1).reshape(-1, 4) != 0).sum(1) <= 2).all()
             for k in kernels)
    return {"one_shot_acc": one_shot, "acc": h.evaluate(model, ds.x_test, ds.y_test), "is_2of4": bool(ok),
            "kept": float(sum(np.count_nonzero(k) for k in kernels) / sum(k.size for k in kernels)),
            "bytes": os.path.getsize(path)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--models", nargs="*", choices=sorted(PAPER), default=["lenet300", "lenet5"])
    p.add_argument("--nm", action="store_true", help="also LeNet-300-100 at 2:4 sparsity")
    p.add_argument("--paper-fractions", action="store_true",
                   help="prune to the paper's per-layer kept fractions, no weight decay (36-37x; default: fc1 at "
                        "6.5 %% / 6 %% kept and weight decay, which reach the paper's rates)")
    p.add_argument("--save-dir", metavar="DIR",
                   help="keep the dense, pruned and compressed files in DIR/<backend>/ (default: a temporary folder)")
    args = p.parse_args(argv)
    recipes = PAPER_FRACTION_RECIPES if args.paper_fractions else RECIPES
    progress = False if args.no_progress else None

    def one_backend(h: Any, ds: Any) -> dict[str, Any]:
        res: dict[str, Any] = {}
        names = list(args.models) + (["lenet300"] if args.nm and "lenet300" not in args.models else [])
        with tempfile.TemporaryDirectory() as scratch:
            tmp = os.path.join(args.save_dir, h.name) if args.save_dir else scratch
            os.makedirs(tmp, exist_ok=True)
            for name in names:
                recipe = recipes[(name, args.quick)]
                dense = dense_baseline(h, name, ds, recipe.dense, args.seed, progress)
                r: dict[str, Any] = {"dense_acc": h.evaluate(dense, ds.x_test, ds.y_test),
                                     "dense_bytes": dense_file_bytes(h, dense, ds, tmp, name)}
                print(f"[{h.name}] {name} dense error {err(r['dense_acc'])}, file {r['dense_bytes']:,} bytes", flush=True)
                if name in args.models:
                    r["deep"] = deep_compression(h, name, dense, ds, recipe, args.seed, progress, tmp)
                    d = r["deep"]
                    print(f"[{h.name}] {name} deep compression: error {err(d['acc'])}, {d['bytes']:,} bytes "
                          f"({r['dense_bytes'] / d['bytes']:.1f}x; raw float32 {4 * d['params'] / d['bytes']:.1f}x); "
                          f"pruned only {d['pruned_bytes']:,} bytes, error {err(d['pruned_acc'])}", flush=True)
                if args.nm and name == "lenet300":
                    r["nm"] = two_of_four(h, dense, ds, recipe, args.seed, progress, tmp)
                    print(f"[{h.name}] lenet300 2:4: error {err(r['nm']['acc'])} (one-shot {err(r['nm']['one_shot_acc'])})",
                          flush=True)
                res[name] = r
        return res

    results = run_backends(args, one_backend)
    print()
    print(report(results, args.models, args.nm, backends_of(args)))
    save_json(args.json, results, args, {f"{m}": recipes[(m, args.quick)] for m in PAPER})
    return 0


def _kb(n: float) -> str:
    return f"{n / 1000:.1f} KB"


def report(results: dict[str, Any], models: list[str], nm: bool, backends: list[str]) -> str:
    out = []
    if models:
        header = ["model", "by", "dense file", "compressed file", "rate (file)", "rate (raw float32)",
                  "error dense -> compressed", "target (rate >= paper, error <= dense + 0.1 pp)"]
        rows = []
        for name in models:
            paper = PAPER[name]
            rows.append([paper["title"], "paper", f"{paper['dense_kb']} KB", f"{paper['compressed_kb']} KB",
                         f"{paper['rate']}x", f"{paper['rate']}x", paper["error"], "-"])
            for b in backends:
                r = results[b][name]
                d = r["deep"]
                rate, raw = r["dense_bytes"] / d["bytes"], 4 * d["params"] / d["bytes"]
                miss = []
                if rate < paper["rate"]:
                    miss.append(f"rate {rate:.1f}x < {paper['rate']}x")
                if (1 - d["acc"]) > (1 - r["dense_acc"]) + TOLERANCE + 1e-12:
                    miss.append(f"+{100 * (r['dense_acc'] - d['acc']):.2f} pp")
                rows.append([paper["title"], BACKEND_LABEL[b], _kb(r["dense_bytes"]), _kb(d["bytes"]), f"{rate:.1f}x",
                             f"{raw:.1f}x", f"{err(r['dense_acc'])} -> {err(d['acc'])}",
                             "yes" if not miss else "no (" + ", ".join(miss) + ")"])
        out += [md_table(header, rows), ""]
        header = ["model", "by", "after pruning (+ coding)", "+ k-means (before fine-tuning)", "+ fine-tuning",
                  *[f"{c} only" for c in CODECS], "auto (per stream)"]
        rows = []
        for name in models:
            for b in backends:
                d = results[b][name]["deep"]
                rows.append([PAPER[name]["title"], BACKEND_LABEL[b],
                             f"{_kb(d['pruned_bytes'])}, {err(d['pruned_acc'])}", err(d["kmeans_acc"]), err(d["acc"]),
                             *[_kb(d["codec_bytes"][c]) for c in CODECS], _kb(d["codec_bytes"]["auto"])])
        out += [md_table(header, rows), ""]
        header = ["model", "by", *["layer kept / centroids"]]
        rows = []
        for name in models:
            for b in backends:
                d = results[b][name]["deep"]
                cells = ", ".join(f"{k} {pct(v)} / {d['centroids_per_layer'][k]}" for k, v in d["kept_per_layer"].items())
                rows.append([PAPER[name]["title"], BACKEND_LABEL[b], cells])
        out += [md_table(header, rows), ""]
    if nm:
        header = ["model", "by", "error dense", "2:4 one-shot", "2:4 retrained", "kept", "every group 2:4",
                  "target (<= dense + 0.1 pp) met"]
        rows = []
        for b in backends:
            r = results[b]["lenet300"]
            n = r["nm"]
            ok = (1 - n["acc"]) <= (1 - r["dense_acc"]) + TOLERANCE + 1e-12
            rows.append(["LeNet-300-100", BACKEND_LABEL[b], err(r["dense_acc"]), err(n["one_shot_acc"]), err(n["acc"]),
                         pct(n["kept"]), "yes" if n["is_2of4"] else "NO",
                         "yes" if ok else f"no (+{100 * (r['dense_acc'] - n['acc']):.2f} pp)"])
        out += [md_table(header, rows), ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
