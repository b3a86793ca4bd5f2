"""Per-layer sparsity report of a TF pruner: data (list of dicts) and a text table (``str()``)."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["SparsityReport", "sparsity_report"]


class SparsityReport(list):
    """Rows ``{'layer', 'type', 'shape', 'params', 'pruned', 'sparsity', 'bias_pruned'}`` of the wrapped layers.

    ``total`` sums the wrapped layers; ``model_total`` counts every trainable weight of the model. Masks
    do not make the model smaller or faster by themselves: only structured (filter/channel) pruning can,
    after the layers are physically shrunk.
    """

    def __init__(self, rows: list[dict[str, Any]], total: dict[str, Any], model_total: dict[str, Any]) -> None:
        super().__init__(rows)
        self.total = total
        self.model_total = model_total

    def __str__(self) -> str:
        head = ("layer", "type", "shape", "params", "pruned", "sparsity")
        body = [(r["layer"], r["type"], "x".join(map(str, r["shape"])), str(r["params"]), str(r["pruned"]),
                 f"{r['sparsity']:.2%}") for r in self]
        for label, t in (("total (pruned weights)", self.total), ("total (whole model)", self.model_total)):
            body.append((label, "", "", str(t["params"]), str(t["pruned"]), f"{t['sparsity']:.2%}"))
        widths = [max(len(h), *(len(row[i]) for row in body)) for i, h in enumerate(head)]
        fmt = "  ".join(f"{{:<{w}}}" if i < 3 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), fmt.format(*("-" * w for w in widths))]
        lines += [fmt.format(*row) for row in body[:-2]]
        lines.append(fmt.format(*("-" * w for w in widths)))
        lines += [fmt.format(*row) for row in body[-2:]]
        return "\n".join(lines)


def _count(mask: Any) -> tuple[int, int]:
    if mask is None:
        return 0, 0
    m = np.asarray(mask.numpy())
    return int(m.size), int(m.size - np.count_nonzero(m))


def sparsity_report(pruner: Any) -> SparsityReport:
    """Report of ``pruner``'s wrapped layers; reads masks back to the host (not for the training loop)."""
    rows = []
    for w in pruner.get_modules_wrapper():
        if not w.ready:
            continue
        n, p = _count(w.weight_mask)
        _, pb = _count(w.bias_mask)
        rows.append({"layer": w.name, "type": w.type, "shape": tuple(int(d) for d in w.weight.shape), "params": n,
                     "pruned": p, "sparsity": p / n if n else 0.0, "bias_pruned": pb})
    tn, tp = sum(r["params"] for r in rows), sum(r["pruned"] for r in rows)
    total = {"params": tn, "pruned": tp, "sparsity": tp / tn if tn else 0.0}
    mn = sum(int(np.prod(v.shape)) for v in pruner.model.trainable_variables)
    mp = tp + sum(r["bias_pruned"] for r in rows)
    model_total = {"params": mn, "pruned": mp, "sparsity": mp / mn if mn else 0.0}
    return SparsityReport(rows, total, model_total)
