"""Quantization-aware training on MNIST with both backends: QAT int8, DoReFa 4-bit weights, BNN.

From one dense LeNet-300-100 per backend, each quantizer fine-tunes a copy:

* ``qat``: ``QAT_Quantizer``, int8 weights and layer outputs (Jacob et al. 2018); target <= dense + 0.1 pp;
* ``dorefa``: ``DoReFaQuantizer``, 4-bit weights (Zhou et al. 2016); target <= dense + 0.5 pp;
* ``bnn``: ``BNNQuantizer``, binary (+-1) weights everywhere, float activations; ``bnn_act``: also
  binary outputs of fc1 and fc2 (Courbariaux/Hubara et al. 2016). Reported only: the paper's 0.96 %
  error is a 3x4096 MLP with batch norm before every sign; LeNet-300-100 has no normalisation, so its
  +-1 pre-activations are far outside |x| <= 1 where the hard-tanh STE passes gradient.

    python -m examples.reproduce_quant [--methods qat dorefa bnn] [--backend torch|tf|all] [--quick]
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
    md_table,
    run_backends,
    save_json,
    train,
)

METHODS: dict[str, dict[str, Any]] = {
    "qat": {"class": "QAT_Quantizer", "tolerance": 0.001, "paper": "no MNIST row; target <= dense + 0.1 pp",
            "config": [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["default"]},
                       {"quant_types": ["input", "weight", "output"], "quant_bits": 8, "op_names": ["fc1"]}]},
    "dorefa": {"class": "DoReFaQuantizer", "tolerance": 0.005, "paper": "no MNIST row; target <= dense + 0.5 pp",
               "config": [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["default"]}]},
    "bnn": {"class": "BNNQuantizer", "tolerance": None, "paper": "0.96 % (3x4096 MLP + BN; report only)",
            "config": [{"quant_types": ["weight"], "quant_bits": 1, "op_types": ["default"]}]},
    "bnn_act": {"class": "BNNQuantizer", "tolerance": None, "paper": "(binary activations too; report only)",
                "config": [{"quant_types": ["weight"], "quant_bits": 1, "op_types": ["default"]},
                           {"quant_types": ["weight", "output"], "quant_bits": 1, "op_names": ["fc1", "fc2"]}]},
}


@dataclass(frozen=True)
class Recipe:
    dense: Train
    finetune: dict[str, Train]


RECIPES = {
    False: Recipe(Train(20, 1e-3, decay=0.85), {"qat": Train(3, 1e-4), "dorefa": Train(5, 1e-4, decay=0.8),
                                                "bnn": Train(10, 1e-3, decay=0.8), "bnn_act": Train(10, 1e-3, decay=0.8)}),
    True: Recipe(Train(3, 2e-3, 64), {m: Train(1, 2e-4, 64) for m in METHODS}),  # pipeline check only
}


def run_method(h: Any, method: str, dense: Any, ds: Any, phase: Train, seed: int, progress: Any) -> dict[str, Any]:
    spec = METHODS[method]
    model = h.copy(dense)
    opt = compile_for(h, model, phase)
    quantizer = getattr(h.backend, spec["class"])(model, spec["config"], opt)
    model = quantizer.compress()
    train(h, model, ds, phase, seed + 1, optimizer=opt, compressor=quantizer, desc=method, progress=progress)
    return {"acc": h.evaluate(model, ds.x_test, ds.y_test)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p)
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=["qat", "dorefa", "bnn"])
    args = p.parse_args(argv)
    progress = False if args.no_progress else None
    recipe = RECIPES[args.quick]

    def one_backend(h: Any, ds: Any) -> dict[str, Any]:
        dense = dense_baseline(h, "lenet300", ds, recipe.dense, args.seed, progress)
        res: dict[str, Any] = {"dense_acc": h.evaluate(dense, ds.x_test, ds.y_test)}
        print(f"[{h.name}] dense error {err(res['dense_acc'])}", flush=True)
        for m in args.methods:
            res[m] = run_method(h, m, dense, ds, recipe.finetune[m], args.seed, progress)
            print(f"[{h.name}] {m}: error {err(res[m]['acc'])}", flush=True)
        return res

    results = run_backends(args, one_backend)
    print()
    print(report(results, backends_of(args), args.methods))
    save_json(args.json, results, args, {"dense": recipe.dense, **recipe.finetune})
    return 0


def report(results: dict[str, Any], backends: list[str], methods: list[str]) -> str:
    header = ["model", "method", "paper / target", *[BACKEND_LABEL[b] for b in backends], "target met"]
    rows = []
    for m in methods:
        tol = METHODS[m]["tolerance"]
        cells, met = [], []
        for b in backends:
            d, a = results[b]["dense_acc"], results[b][m]["acc"]
            cells.append(f"{err(d)} -> {err(a)}")
            if tol is not None:
                met.append(f"{b}: {'yes' if (1 - a) <= (1 - d) + tol + 1e-12 else 'no'}")
        rows.append(["LeNet-300-100", m, METHODS[m]["paper"], *cells, ", ".join(met) or "report only"])
    return md_table(header, rows)


if __name__ == "__main__":
    raise SystemExit(main())
