"""Han et al. 2015, "Learning both Weights and Connections", Table 1, on MNIST with both backends.

LeNet-300-100 and LeNet-5 are trained dense, then pruned iteratively to the paper's per-layer kept
fractions (LeNet-300-100: fc1 8 %, fc2 9 %, fc3 26 %; LeNet-5: conv1 66 %, conv2 12 %, fc1 8 %, fc2 19 %)
with retraining after each round (the paper retrains at 1/10 of the original learning rate; with Adam
LeNet-300-100 recovers best when each round restarts at 2x the dense learning rate and decays per
epoch, see RECIPES and RESULTS.md), two ways:

* ``level``: ``LevelPruner`` with one config entry per layer; round r of R prunes each layer to
  ``1 - kept ** (r / R)`` (the export of round r is reloaded into a plain model and pruned further);
* ``sensitivity``: ``SensitivityPruner`` (threshold = q * std of the layer's weights), one per round on
  the reloaded export of the previous round; q per layer and round is calibrated on the current weights
  so that round r keeps ``kept ** (r / R)`` (the paper picked q per layer by hand).

Target (issue 7): at ~92 % overall sparsity, test error <= our dense error + 0.1 pp.

    python -m examples.reproduce_han2015 [--models lenet300 lenet5] [--methods level sensitivity]
                                         [--backend torch|tf|all] [--data-dir DIR] [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import numpy as np

from compressor.core.ops import NumpyOps
from compressor.core.pruning import sensitivity_mask
from examples.common import (
    BACKEND_LABEL,
    Train,
    add_common_args,
    backends_of,
    compile_for,
    dense_baseline,
    err,
    export_weights,
    kept_fractions,
    md_table,
    pct,
    reload_exported,
    run_backends,
    save_json,
    train,
)

#: Table 1 of the paper: error before/after, kept fraction per layer and overall
PAPER: dict[str, dict[str, Any]] = {
    "lenet300": {"title": "LeNet-300-100", "dense_error": 0.0164, "pruned_error": 0.0159, "overall_kept": 0.08,
                 "kept": {"fc1": 0.08, "fc2": 0.09, "fc3": 0.26}},
    "lenet5": {"title": "LeNet-5", "dense_error": 0.0080, "pruned_error": 0.0077, "overall_kept": 0.08,
               "kept": {"conv1": 0.66, "conv2": 0.12, "fc1": 0.08, "fc2": 0.19}},
}
TOLERANCE = 0.001  # error may rise by at most 0.1 pp over our dense error
MAX_KEPT = 0.085  # "92 % sparsity": the paper's own per-layer fractions keep 8.2 % (LeNet-300-100) / 8.4 %


@dataclass(frozen=True)
class Recipe:
    dense: Train
    rounds: int
    retrain: Train  # per round (each round restarts the learning rate and its decay)

    def as_dict(self) -> dict[str, Any]:
        return {"dense": self.dense.__dict__, "rounds": self.rounds, "retrain": self.retrain.__dict__}


RECIPES: dict[tuple[str, bool], Recipe] = {
    # Adam with a per-epoch decay; each retraining round restarts at 2x the dense learning rate. Over
    # seeds 0-2 the extra error after pruning fell from +0.13..+0.19 pp (restart at 5e-4) via
    # +0.04..+0.16 pp (1e-3) to -0.02..+0.13 pp (2e-3); the paper's 1/10 (1e-4) left it ~1 pp short.
    # See RESULTS.md.
    ("lenet300", False): Recipe(Train(20, 1e-3, decay=0.85), rounds=3, retrain=Train(15, 2e-3, decay=0.8)),
    ("lenet5", False): Recipe(Train(12, 1e-3, decay=0.8), rounds=3, retrain=Train(8, 5e-4, decay=0.75)),
    # --quick: a pipeline check on 6000 images, not a reproduction
    ("lenet300", True): Recipe(Train(3, 2e-3, 64), rounds=2, retrain=Train(1, 2e-4, 64)),
    ("lenet5", True): Recipe(Train(2, 2e-3, 64), rounds=2, retrain=Train(1, 2e-4, 64)),
}


def level_round_config(kept: dict[str, float], r: int, rounds: int) -> list[dict[str, Any]]:
    """Per-layer LevelPruner config of round ``r`` (1-based): kept fraction ``kept ** (r / rounds)``."""
    return [{"sparsity": round(1.0 - k ** (r / rounds), 6), "op_names": [layer]} for layer, k in kept.items()]


def calibrate_sensitivity(weight: np.ndarray, kept: float, rounds: int) -> float:
    """The q for which ``rounds`` applications of the q * std rule keep ``kept`` of ``weight`` (bisection)."""
    ops = NumpyOps()
    w = weight.astype(np.float64)

    def kept_after(q: float) -> float:
        mask = None
        for _ in range(rounds):
            mask = sensitivity_mask(ops, w, q, mask)
        return float(mask.mean())

    lo, hi = 0.0, 10.0
    for _ in range(50):
        mid = (lo + hi) / 2
        if kept_after(mid) > kept:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def layer_weights(h: Any, model: Any, layers: list[str]) -> dict[str, np.ndarray]:
    """Current weights (any layout) of ``layers`` of a plain model."""
    if h.name == "torch":
        mods = dict(model.named_modules())
        return {k: mods[k].weight.detach().cpu().numpy() for k in layers}
    return {k: np.asarray(model.get_layer(k).kernel) for k in layers}


def run_level(h: Any, name: str, dense: Any, ds: Any, recipe: Recipe, seed: int, progress: Any) -> dict[str, Any]:
    kept = PAPER[name]["kept"]
    model = h.copy(dense)
    pruner = None
    for r in range(1, recipe.rounds + 1):
        if pruner is not None:
            model = reload_exported(h, pruner, name, ds)
        opt = compile_for(h, model, recipe.retrain)
        pruner = h.backend.LevelPruner(model, level_round_config(kept, r, recipe.rounds), opt)
        model = pruner.compress()
        train(h, model, ds, recipe.retrain, seed + r, optimizer=opt, compressor=pruner,
              desc=f"{name} level round {r}", progress=progress)
    return _measure(h, pruner, model, ds, list(kept), name)


def run_sensitivity(h: Any, name: str, dense: Any, ds: Any, recipe: Recipe, seed: int, progress: Any) -> dict[str, Any]:
    kept = PAPER[name]["kept"]
    layers = list(kept)
    model = h.copy(dense)
    pruner = None
    qs = []
    for r in range(1, recipe.rounds + 1):
        if pruner is not None:
            model = reload_exported(h, pruner, name, ds)
        # q per layer for this round, calibrated on the CURRENT (retrained) weights so that the q * std
        # rule keeps kept ** (r / R) of the layer; the paper chose q per layer by hand. A q fixed on the
        # dense weights undershoots the paper's sparsity once retraining has moved the weights.
        weights = layer_weights(h, model, layers)
        q = {k: calibrate_sensitivity(weights[k], kept[k] ** (r / recipe.rounds), 1) for k in layers}
        qs.append(q)
        opt = compile_for(h, model, recipe.retrain)
        pruner = h.backend.SensitivityPruner(model, [{"sensitivity": q[k], "op_names": [k]} for k in layers], opt)
        model = pruner.compress()
        train(h, model, ds, recipe.retrain, seed + r, optimizer=opt, compressor=pruner,
              desc=f"{name} sensitivity round {r}", progress=progress)
    out = _measure(h, pruner, model, ds, layers, name)
    out["sensitivity"] = qs
    return out


def _measure(h: Any, pruner: Any, model: Any, ds: Any, layers: list[str], name: str) -> dict[str, Any]:
    """Accuracy of the compressed model and of its export reloaded into a plain model; kept fractions."""
    acc = h.evaluate(model, ds.x_test, ds.y_test)
    acc_exported = h.evaluate(reload_exported(h, pruner, name, ds), ds.x_test, ds.y_test)
    overall, per = kept_fractions(export_weights(h, pruner, model), layers)
    return {"acc": acc, "acc_exported": acc_exported, "kept": overall, "kept_per_layer": per}


def verdict(dense_acc: float, acc: float, kept: float) -> str:
    """'yes', or 'no' with the reason (error above dense + 0.1 pp, or fewer than ~92 % pruned)."""
    why = []
    if (1 - acc) > (1 - dense_acc) + TOLERANCE + 1e-12:
        why.append(f"+{100 * (dense_acc - acc):.2f} pp")
    if kept > MAX_KEPT:
        why.append(f"{pct(kept)} kept")
    return "yes" if not why else "no (" + ", ".join(why) + ")"


METHODS = {"level": run_level, "sensitivity": run_sensitivity}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--models", nargs="+", choices=sorted(PAPER), default=["lenet300", "lenet5"])
    p.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=["level", "sensitivity"])
    args = p.parse_args(argv)
    progress = False if args.no_progress else None

    def one_backend(h: Any, ds: Any) -> dict[str, Any]:
        res: dict[str, Any] = {}
        for name in args.models:
            recipe = RECIPES[(name, args.quick)]
            dense = dense_baseline(h, name, ds, recipe.dense, args.seed, progress)
            res[name] = {"dense_acc": h.evaluate(dense, ds.x_test, ds.y_test)}
            print(f"[{h.name}] {name} dense error {err(res[name]['dense_acc'])}", flush=True)
            for method in args.methods:
                r = METHODS[method](h, name, dense, ds, recipe, args.seed, progress)
                res[name][method] = r
                print(f"[{h.name}] {name} {method}: error {err(r['acc'])}, kept {pct(r['kept'])} "
                      f"({', '.join(f'{k} {pct(v)}' for k, v in r['kept_per_layer'].items())})", flush=True)
        return res

    results = run_backends(args, one_backend)
    print()
    print(report(results, args.models, args.methods, backends_of(args)))
    save_json(args.json, results, args, {f"{m}": RECIPES[(m, args.quick)].as_dict() for m in args.models})
    return 0


def report(results: dict[str, Any], models: list[str], methods: list[str], backends: list[str]) -> str:
    """Markdown: error dense -> pruned and kept fraction, paper vs each backend; per-layer kept fractions."""
    header = ["model", "method", "paper"] + [BACKEND_LABEL[b] for b in backends] + [
        "target (<= dense + 0.1 pp at ~92 % sparsity) met"]
    rows, layer_rows = [], []
    for name in models:
        paper = PAPER[name]
        paper_cell = (f"{err(1 - paper['dense_error'])} -> {err(1 - paper['pruned_error'])}, "
                      f"{pct(paper['overall_kept'])} kept")
        for method in methods:
            cells, met = [], []
            for b in backends:
                r, dense_acc = results[b][name][method], results[b][name]["dense_acc"]
                cells.append(f"{err(dense_acc)} -> {err(r['acc'])}, {pct(r['kept'])} kept")
                met.append(f"{b}: {verdict(dense_acc, r['acc'], r['kept'])}")
                layer_rows.append([paper["title"], method, BACKEND_LABEL[b]]
                                  + [pct(r["kept_per_layer"][k]) for k in paper["kept"]])
            rows.append([paper["title"], method, paper_cell, *cells, ", ".join(met)])
        layer_rows.append([paper["title"], "-", "paper"] + [pct(v) for v in paper["kept"].values()])
    out = [md_table(header, rows), ""]
    for name in models:
        layers = list(PAPER[name]["kept"])
        sub = [r for r in layer_rows if r[0] == PAPER[name]["title"]]
        out += [md_table(["model", "method", "by"] + [f"{k} kept" for k in layers], sub), ""]
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
