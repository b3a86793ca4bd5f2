"""Automated gradual pruning (Zhu & Gupta 2017) of LeNet-300-100 to 95 % sparsity on MNIST, both backends.

A dense LeNet-300-100 is fine-tuned while ``AGPPruner`` (level criterion) raises each layer's sparsity
from 0 to its final value along the cubic schedule ``s_f + (s_i - s_f)(1 - t)^3`` over ``ramp`` epochs,
then keeps training with the final masks. Target (issue 7): 95 % sparsity overall, test error <= dense
error + 0.3 pp. The paper has no LeNet-300-100 row; its claim is that gradual pruning keeps accuracy at
high sparsity.

By default the 95 % is spread as fc1 95.74 %, fc2 90 %, fc3 70 % (95.0 % of all weights): the output
layer has only 1000 weights, and at a uniform 95 % it keeps 5 per class (``--uniform`` runs that
variant; it costs several points of accuracy, see RESULTS.md).

    python -m examples.reproduce_agp [--uniform] [--sparsity 0.95] [--backend torch|tf|all] [--data-dir DIR] [--quick]
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

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

LAYERS = ["fc1", "fc2", "fc3"]
SIZES = {"fc1": 784 * 300, "fc2": 300 * 100, "fc3": 100 * 10}
#: per-layer final sparsities giving 95.0 % of all LeNet-300-100 weights
PER_LAYER_95 = {"fc1": 0.9574, "fc2": 0.90, "fc3": 0.70}
TOLERANCE = 0.003


@dataclass(frozen=True)
class Recipe:
    dense: Train
    finetune: Train  # the whole AGP phase
    ramp: int  # AGP end_epoch: the final sparsity is reached at epoch ramp - 1


RECIPES = {
    # 40 epochs at the dense learning rate, sparsity ramped over the first 20. Over seeds 0-2 starting
    # at 5e-4 instead ended +0.25..+0.32 pp over dense on average, at 1e-3 +0.12..+0.14 pp; see RESULTS.md
    False: Recipe(Train(20, 1e-3, decay=0.85), Train(40, 1e-3, decay=0.92), ramp=20),
    True: Recipe(Train(3, 2e-3, 64), Train(3, 2e-4, 64), ramp=2),  # pipeline check only
}


def agp_config(sparsity: float | dict[str, float], ramp: int) -> list[dict[str, Any]]:
    """One entry for all layers (a number) or one per layer (a dict layer -> final sparsity)."""
    common = {"initial_sparsity": 0.0, "start_epoch": 0, "end_epoch": ramp, "frequency": 1}
    if isinstance(sparsity, dict):
        return [{**common, "final_sparsity": s, "op_names": [layer]} for layer, s in sparsity.items()]
    return [{**common, "final_sparsity": sparsity, "op_types": ["default"]}]


def overall_sparsity(sparsity: float | dict[str, float]) -> float:
    if not isinstance(sparsity, dict):
        return sparsity
    return sum(SIZES[k] * s for k, s in sparsity.items()) / sum(SIZES[k] for k in sparsity)


def run_agp(h: Any, dense: Any, ds: Any, recipe: Recipe, sparsity: float | dict[str, float], seed: int,
            progress: Any) -> dict[str, Any]:
    model = h.copy(dense)
    opt = compile_for(h, model, recipe.finetune)
    pruner = h.backend.AGPPruner(model, agp_config(sparsity, recipe.ramp), opt)
    model = pruner.compress()
    train(h, model, ds, recipe.finetune, seed + 1, optimizer=opt, compressor=pruner, desc="AGP", progress=progress)
    acc = h.evaluate(model, ds.x_test, ds.y_test)
    acc_exported = h.evaluate(reload_exported(h, pruner, "lenet300", ds), ds.x_test, ds.y_test)
    overall, per = kept_fractions(export_weights(h, pruner, model), LAYERS)
    return {"acc": acc, "acc_exported": acc_exported, "kept": overall, "kept_per_layer": per}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--sparsity", type=float, default=0.95, help="with --uniform: every layer's final sparsity")
    p.add_argument("--uniform", action="store_true", help="the same sparsity for every layer")
    args = p.parse_args(argv)
    progress = False if args.no_progress else None
    recipe = RECIPES[args.quick]
    if args.uniform:
        target: float | dict[str, float] = args.sparsity
    elif args.sparsity == 0.95:
        target = PER_LAYER_95
    else:
        p.error("a --sparsity other than 0.95 needs --uniform (the per-layer split is for 95 %)")

    def one_backend(h: Any, ds: Any) -> dict[str, Any]:
        dense = dense_baseline(h, "lenet300", ds, recipe.dense, args.seed, progress)
        dense_acc = h.evaluate(dense, ds.x_test, ds.y_test)
        print(f"[{h.name}] dense error {err(dense_acc)}", flush=True)
        r = run_agp(h, dense, ds, recipe, target, args.seed, progress)
        print(f"[{h.name}] AGP {overall_sparsity(target):.1%}: error {err(r['acc'])}, kept {pct(r['kept'])}", flush=True)
        return {"dense_acc": dense_acc, "agp": r}

    results = run_backends(args, one_backend)
    print()
    print(report(results, backends_of(args), overall_sparsity(target), "uniform" if args.uniform else "per layer"))
    save_json(args.json, results, args, {"recipe": recipe, "final_sparsity": target})
    return 0


def report(results: dict[str, Any], backends: list[str], sparsity: float, split: str = "per layer") -> str:
    header = ["model", "sparsity", "paper", *[BACKEND_LABEL[b] for b in backends], "target (<= dense + 0.3 pp) met"]
    cells, met = [], []
    for b in backends:
        r, d = results[b]["agp"], results[b]["dense_acc"]
        cells.append(f"{err(d)} -> {err(r['acc'])}, {pct(1 - r['kept'])} sparse "
                     f"({', '.join(f'{k} {pct(1 - v)}' for k, v in r['kept_per_layer'].items())})")
        met.append(f"{b}: {'yes' if (1 - r['acc']) <= (1 - d) + TOLERANCE + 1e-12 else 'no'}")
    row = ["LeNet-300-100", f"{pct(sparsity)} ({split})", "no MNIST row (claim: accuracy kept at high sparsity)",
           *cells, ", ".join(met)]
    return md_table(header, [row])


if __name__ == "__main__":
    raise SystemExit(main())
