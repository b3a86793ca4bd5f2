"""Per-layer sparsity report of a pruner, from plain host numbers: data (list of dicts) and a text table.

The backends count each wrapper's masks on the host and hand the counts to :func:`build_report`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["SparsityReport", "build_report", "flops_summary", "format_flops", "report_row"]


class SparsityReport(list):
    """Rows ``{'layer', 'type', 'shape', 'params', 'pruned', 'sparsity', 'bias_pruned'}`` of the wrapped layers.

    ``total`` sums the wrapped layers; ``model_total`` counts every parameter of the model (torch: all
    parameters; tf: all trainable weights), what "the model is X % sparse" means. Masks do not make the
    model smaller or faster by themselves: only structured (filter/channel) pruning can, after the layers
    are physically shrunk.

    ``flops``: None, or (when the report was asked for MACs: ``sparsity_report(pruner, dummy_input=x)`` on
    torch, ``sparsity_report(pruner, flops=True)`` on tf) the dict of :func:`flops_summary`: MACs (per
    sample) and parameters of the dense model and of a sped-up copy, i.e. what the pruned channels really
    save once removed.
    """

    def __init__(self, rows: list[dict[str, Any]], total: dict[str, Any], model_total: dict[str, Any],
                 flops: dict[str, Any] | None = None) -> None:
        super().__init__(rows)
        self.total = total
        self.model_total = model_total
        self.flops = flops

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
        if self.flops is not None:
            lines.append(format_flops(self.flops))
        return "\n".join(lines)


def report_row(layer: str, layer_type: str, shape: Sequence[int], params: int, pruned: int,
               bias_pruned: int) -> dict[str, Any]:
    """One layer's row: its weight's ``params`` / ``pruned`` counts and sparsity, and pruned bias entries."""
    return {"layer": layer, "type": layer_type, "shape": tuple(shape), "params": params, "pruned": pruned,
            "sparsity": pruned / params if params else 0.0, "bias_pruned": bias_pruned}


def build_report(rows: list[dict[str, Any]], model_params: int, flops: dict[str, Any] | None = None) -> SparsityReport:
    """The report of ``rows`` (see :func:`report_row`) for a model of ``model_params`` parameters.

    The whole-model total counts pruned weights and pruned bias entries against every parameter.
    """
    tn, tp = sum(r["params"] for r in rows), sum(r["pruned"] for r in rows)
    total = {"params": tn, "pruned": tp, "sparsity": tp / tn if tn else 0.0}
    mp = tp + sum(r["bias_pruned"] for r in rows)
    model_total = {"params": model_params, "pruned": mp, "sparsity": mp / model_params if model_params else 0.0}
    return SparsityReport(rows, total, model_total, flops)


def flops_summary(macs_dense: int, params_dense: int, macs_after: int, params_after: int,
                  notes: Sequence[str] = ()) -> dict[str, Any]:
    """``{'macs_dense', 'params_dense', 'macs_after', 'params_after', 'macs_ratio', 'params_ratio', 'notes'}``:
    MACs (multiply-accumulates per sample) and parameters before and after speedup; ratios are after / dense."""
    return {"macs_dense": int(macs_dense), "params_dense": int(params_dense), "macs_after": int(macs_after),
            "params_after": int(params_after), "macs_ratio": macs_after / macs_dense if macs_dense else 1.0,
            "params_ratio": params_after / params_dense if params_dense else 1.0, "notes": list(notes)}


def format_flops(f: dict[str, Any]) -> str:
    """Two aligned lines (dense, after speedup) of a :func:`flops_summary`, plus its notes."""
    rows = [("dense", f"{f['params_dense']:,}", f"{f['macs_dense']:,}", "", ""),
            ("after speedup", f"{f['params_after']:,}", f"{f['macs_after']:,}", f"({f['params_ratio']:.2%})",
             f"({f['macs_ratio']:.2%})")]
    wp = max(len(r[1]) for r in rows)
    wm = max(len(r[2]) for r in rows)
    wr = max(len(r[3]) for r in rows)
    out = [f"{label:<13}  params {p:>{wp}} {pr:<{wr}}  MACs/sample {m:>{wm}} {mr}".rstrip()
           for label, p, m, pr, mr in rows]
    out += [f"note: {n}" for n in f.get("notes", ())]
    return "\n".join(out)
