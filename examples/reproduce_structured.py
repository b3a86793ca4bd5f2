"""Structured (filter / neuron) pruning plus speedup of LeNet-5 on MNIST, both backends.

A dense LeNet-5 (the Han et al. 2015 reproduction's model and dense recipe) is pruned in one shot by a
dependency-aware filter pruner: half the filters of conv1 and conv2 and half the neurons of fc1 go
(fc2, the classifier, keeps its 10 outputs). The masked model is fine-tuned (masks held after every
optimizer step), then ``speedup_model`` removes the pruned channels for real: conv1 20 -> 10, conv2
50 -> 25 filters (and input channels), fc1 800 -> 400 inputs and 500 -> 250 outputs, fc2 500 -> 250
inputs. The SPED-UP plain model is what is evaluated, counted (``count_flops_params``), saved (torch
``state_dict`` / ``.keras``) and timed (inference of the whole test set, median of interleaved rounds).

Target (issue 14): >= 2x fewer MACs and >= 3x fewer parameters than dense, test error <= dense + 0.15 pp.

    python -m examples.reproduce_structured [--criterion l1|l2|fpgm] [--sparsity 0.5] [--seeds N]
                                            [--backend torch|tf|all] [--data-dir DIR] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from examples.common import (
    BACKEND_LABEL,
    Train,
    add_common_args,
    backends_of,
    compile_for,
    dense_baseline,
    err,
    md_table,
    run_backends,
    save_json,
    train,
)

MODEL = "lenet5"
LAYERS = ["conv1", "conv2", "fc1"]  # pruned: filters of the convs, output neurons of fc1 (not fc2)
ALL_LAYERS = ["conv1", "conv2", "fc1", "fc2"]
TOLERANCE = 0.0015  # error may rise by at most 0.15 pp over our dense error
MIN_MACS_RATIO = 2.0
MIN_PARAMS_RATIO = 3.0
PRUNERS = {"l1": "L1FilterPruner", "l2": "L2FilterPruner", "fpgm": "FPGMPruner"}


@dataclass(frozen=True)
class Recipe:
    dense: Train
    finetune: Train  # after the one-shot filter pruning, with the masks held


RECIPES = {
    # dense: the Han LeNet-5 reproduction's recipe (12 epochs, Adam 1e-3, decay 0.8 per epoch); the
    # fine-tuning restarts at the dense learning rate (the pruned network has to move away from the dense
    # minimum; see the Han / AGP recipe studies in RESULTS.md)
    False: Recipe(Train(12, 1e-3, decay=0.8), Train(8, 1e-3, decay=0.75)),
    True: Recipe(Train(2, 2e-3, 64), Train(1, 5e-4, 64)),  # pipeline check only
}


def struct_config(sparsity: float) -> list[dict[str, Any]]:
    return [{"sparsity": sparsity, "op_names": list(LAYERS)}]


def expected_widths(sparsity: float) -> dict[str, int]:
    """Output channels / neurons left per layer: each pruned layer keeps ``n - floor(n * sparsity)``."""
    dense = {"conv1": 20, "conv2": 50, "fc1": 500}
    out = {k: n - int(np.floor(n * sparsity + 1e-9)) for k, n in dense.items()}
    out["fc2"] = 10
    return out


def layer_widths(h: Any, model: Any) -> dict[str, tuple[int, int]]:
    """Layer -> (inputs, outputs) of each conv / dense layer of a plain model."""
    if h.name == "torch":
        mods = dict(model.named_modules())
        out = {}
        for k in ALL_LAYERS:
            m = mods[k]
            out[k] = (m.in_channels, m.out_channels) if hasattr(m, "out_channels") else (m.in_features, m.out_features)
        return out
    out = {}
    for k in ALL_LAYERS:
        kernel = model.get_layer(k).kernel
        out[k] = (int(kernel.shape[-2]), int(kernel.shape[-1]))
    return out


def count(h: Any, model: Any, ds: Any) -> tuple[int, int]:
    """(MACs per sample, parameters) by the backend's ``count_flops_params``."""
    if h.name == "torch":
        macs, params, _ = h.backend.count_flops_params(model, h.to_input(ds.x_test[:1]))
    else:
        macs, params, _ = h.backend.count_flops_params(model)
    return int(macs), int(params)


def save_and_reload(h: Any, model: Any, directory: str, name: str) -> tuple[int, Any]:
    """Save ``model`` (torch ``state_dict`` / ``.keras``); its file size in bytes and the model read back."""
    if h.name == "torch":
        path = os.path.join(directory, f"{name}.pt")
        h.torch.save(model.state_dict(), path)
        clone = copy.deepcopy(model)
        clone.load_state_dict(h.torch.load(path, weights_only=True))
        return os.path.getsize(path), clone
    path = os.path.join(directory, f"{name}.keras")
    # a fresh uncompiled model with the same weights: the file holds the weights only (Keras 3's
    # clone_model, and so h.copy, compiles the clone with the original's optimizer, whose Adam moments
    # would triple the file)
    plain = type(model).from_config(model.get_config())
    plain.set_weights(model.get_weights())
    plain.save(path)
    return os.path.getsize(path), h.keras.models.load_model(path, compile=False)


def inference_times(h: Any, models: list[Any], x: np.ndarray, rounds: int, batch_size: int = 1000) -> list[list[float]]:
    """Seconds to run each model over ``x`` (batches of ``batch_size``, no gradients), interleaved model by
    model for ``rounds`` rounds after one discarded warm-up round."""
    if h.name == "torch":
        torch = h.torch
        xt = h.to_input(x)

        def runner(m: Any) -> Any:
            m.eval()

            def run() -> None:
                with torch.no_grad():
                    for i in range(0, len(xt), batch_size):
                        m(xt[i:i + batch_size])
            return run
    else:
        tf = h.tf
        xt = tf.constant(h.to_input(x))

        def runner(m: Any) -> Any:
            fn = tf.function(lambda b: m(b, training=False))

            def run() -> None:
                for i in range(0, len(x), batch_size):
                    fn(xt[i:i + batch_size]).numpy()
            return run
    runs = [runner(m) for m in models]
    times: list[list[float]] = [[] for _ in models]
    for r in range(rounds + 1):
        for i, run in enumerate(runs):
            t0 = time.perf_counter()
            run()
            if r:
                times[i].append(time.perf_counter() - t0)
    return times


def run_structured(h: Any, dense: Any, ds: Any, recipe: Recipe, sparsity: float, criterion: str, seed: int,
                   progress: Any, infer_rounds: int = 5) -> dict[str, Any]:
    """Prune a copy of ``dense``, fine-tune with the masks, speed up, and measure the sped-up model."""
    model = h.copy(dense)
    opt = compile_for(h, model, recipe.finetune)
    cls = getattr(h.backend, PRUNERS[criterion])
    if h.name == "torch":
        pruner = cls(model, struct_config(sparsity), opt, dependency_aware=True, dummy_input=h.to_input(ds.x_test[:2]))
    else:
        pruner = cls(model, struct_config(sparsity), opt, dependency_aware=True)
    model = pruner.compress()
    acc_pruned = h.evaluate(model, ds.x_test, ds.y_test)  # one-shot, before fine-tuning
    train(h, model, ds, recipe.finetune, seed + 1, optimizer=opt, compressor=pruner, desc="fine-tune", progress=progress)
    acc_masked = h.evaluate(model, ds.x_test, ds.y_test)
    if h.name == "torch":
        small = h.backend.speedup_model(pruner, h.to_input(ds.x_test[:2]))
    else:
        small = h.backend.speedup_model(pruner)
    acc = h.evaluate(small, ds.x_test, ds.y_test)

    macs_d, params_d = count(h, dense, ds)
    macs_s, params_s = count(h, small, ds)
    with tempfile.TemporaryDirectory() as tmp:
        bytes_d, _ = save_and_reload(h, dense, tmp, "dense")
        bytes_s, reloaded = save_and_reload(h, small, tmp, "structured")
        acc_reloaded = h.evaluate(reloaded, ds.x_test, ds.y_test)
    t_d, t_s = inference_times(h, [dense, small], ds.x_test, infer_rounds)
    return {
        "acc": acc, "acc_masked": acc_masked, "acc_one_shot": acc_pruned, "acc_reloaded": acc_reloaded,
        "widths_dense": layer_widths(h, dense), "widths": layer_widths(h, small),
        "macs_dense": macs_d, "macs": macs_s, "params_dense": params_d, "params": params_s,
        "file_bytes_dense": bytes_d, "file_bytes": bytes_s,
        "infer_dense_s": statistics.median(t_d), "infer_s": statistics.median(t_s),
        "infer_dense_all_s": t_d, "infer_all_s": t_s,
        "macs_ratio": macs_d / macs_s, "params_ratio": params_d / params_s, "file_ratio": bytes_d / bytes_s,
        "latency_ratio": statistics.median(t_d) / statistics.median(t_s),
    }


def delta_pp(r: dict[str, Any]) -> float:
    """Structured error minus dense error, in percentage points."""
    return 100.0 * (r["dense_acc"] - r["acc"])


def met(r: dict[str, Any]) -> bool:
    return ((1 - r["acc"]) <= (1 - r["dense_acc"]) + TOLERANCE + 1e-12 and r["macs_ratio"] >= MIN_MACS_RATIO
            and r["params_ratio"] >= MIN_PARAMS_RATIO)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--seeds", type=int, default=1, help="run seeds SEED .. SEED + N - 1 (a dense model per seed)")
    p.add_argument("--criterion", choices=sorted(PRUNERS), default="l1", help="filter ranking (default l1)")
    p.add_argument("--sparsity", type=float, default=0.5, help="fraction of filters / neurons removed per layer")
    p.add_argument("--infer-rounds", type=int, default=5, help="timed inference rounds per model (median)")
    args = p.parse_args(argv)
    progress = False if args.no_progress else None
    recipe = RECIPES[args.quick]
    seeds = list(range(args.seed, args.seed + args.seeds))
    partial: dict[str, Any] = {}

    def one_backend(h: Any, ds: Any) -> dict[str, Any]:
        per_seed: dict[str, Any] = {}
        for seed in seeds:
            t0 = time.perf_counter()
            dense = dense_baseline(h, MODEL, ds, recipe.dense, seed, progress)
            dense_acc = h.evaluate(dense, ds.x_test, ds.y_test)
            print(f"[{h.name}] seed {seed}: dense error {err(dense_acc)}", flush=True)
            r = run_structured(h, dense, ds, recipe, args.sparsity, args.criterion, seed, progress, args.infer_rounds)
            r["dense_acc"] = dense_acc
            r["seconds"] = round(time.perf_counter() - t0, 1)
            per_seed[str(seed)] = r
            print(f"[{h.name}] seed {seed}: structured error {err(r['acc'])} ({delta_pp(r):+.2f} pp; one-shot "
                  f"{err(r['acc_one_shot'])}, masked {err(r['acc_masked'])}, reloaded {err(r['acc_reloaded'])}), "
                  f"MACs {r['macs_dense']} -> {r['macs']} ({r['macs_ratio']:.2f}x), params {r['params_dense']} -> "
                  f"{r['params']} ({r['params_ratio']:.2f}x), file {r['file_bytes_dense']} -> {r['file_bytes']} B, "
                  f"inference {1e3 * r['infer_dense_s']:.1f} -> {1e3 * r['infer_s']:.1f} ms, {r['seconds']:.0f} s",
                  flush=True)
            partial[h.name] = {"seeds": per_seed}
            if args.json:  # after every seed, so a long run that is stopped keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "results": partial, "partial": True},
                                                      indent=2, default=float))
        return {"seeds": per_seed}

    results = run_backends(args, one_backend)
    print()
    print(report(results, backends_of(args)))
    save_json(args.json, results, args, {"recipe": recipe, "sparsity": args.sparsity, "criterion": args.criterion,
                                         "layers": LAYERS})
    return 0


def _mean(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(r[key] for r in runs)


def report(results: dict[str, Any], backends: list[str]) -> str:
    """One markdown table per backend (a row per seed, then mean and range), and the channels kept."""
    out = []
    header = ["seed", "dense error", "structured error", "delta", "MACs", "params", "file size", "inference",
              "target met"]
    for b in backends:
        runs = results[b]["seeds"]
        rows = []
        for seed, r in runs.items():
            rows.append([seed, err(r["dense_acc"]), err(r["acc"]), f"{delta_pp(r):+.2f} pp",
                         f"{r['macs_ratio']:.2f}x fewer", f"{r['params_ratio']:.2f}x fewer",
                         f"{r['file_ratio']:.2f}x smaller", f"{r['latency_ratio']:.2f}x faster",
                         "yes" if met(r) else "no"])
        if len(runs) > 1:
            rs = list(runs.values())
            deltas = [delta_pp(r) for r in rs]
            rows.append(["mean", f"{100 * (1 - _mean(rs, 'dense_acc')):.2f} %", f"{100 * (1 - _mean(rs, 'acc')):.2f} %",
                         f"{statistics.mean(deltas):+.2f} pp (range {min(deltas):+.2f} .. {max(deltas):+.2f}, "
                         f"sd {statistics.stdev(deltas):.2f})",
                         f"{_mean(rs, 'macs_ratio'):.2f}x", f"{_mean(rs, 'params_ratio'):.2f}x", f"{_mean(rs, 'file_ratio'):.2f}x",
                         f"{_mean(rs, 'latency_ratio'):.2f}x", f"{sum(met(r) for r in rs)}/{len(rs)} seeds"])
        out += [f"{BACKEND_LABEL[b]}:", "", md_table(header, rows), ""]
        first = next(iter(runs.values()))
        chans = ", ".join(f"{k} {first['widths_dense'][k][1]} -> {first['widths'][k][1]}" for k in ALL_LAYERS)
        out += [f"channels / neurons kept ({BACKEND_LABEL[b]}): {chans}; MACs {first['macs_dense']:,} -> "
                f"{first['macs']:,}, params {first['params_dense']:,} -> {first['params']:,}, file "
                f"{first['file_bytes_dense']:,} -> {first['file_bytes']:,} B", ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
