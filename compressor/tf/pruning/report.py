"""Per-layer sparsity report of a TF pruner: data (list of dicts) and a text table (``str()``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.report import SparsityReport, build_report, report_row

__all__ = ["SparsityReport", "sparsity_report"]


def _count(mask: Any) -> tuple[int, int]:
    if mask is None:
        return 0, 0
    m = np.asarray(mask.numpy())
    return int(m.size), int(m.size - np.count_nonzero(m))


def sparsity_report(pruner: Any) -> SparsityReport:
    """Report of ``pruner``'s wrapped (built) layers; reads masks back to the host (not for the training
    loop). The whole-model total counts every trainable weight."""
    rows = []
    for w in pruner.get_modules_wrapper():
        if not w.ready:
            continue
        n, p = _count(w.weight_mask)
        _, pb = _count(w.bias_mask)
        rows.append(report_row(w.name, w.type, [int(d) for d in w.weight.shape], n, p, pb))
    return build_report(rows, sum(int(np.prod(v.shape)) for v in pruner.model.trainable_variables))
