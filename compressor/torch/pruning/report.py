"""Per-layer sparsity report of a pruner: data (list of dicts) and a text table (``str()``)."""

from __future__ import annotations

from typing import Any

import torch

from ...core.report import SparsityReport, build_report, report_row

__all__ = ["SparsityReport", "sparsity_report"]


def _count(mask: torch.Tensor | None) -> tuple[int, int]:
    if mask is None:
        return 0, 0
    return mask.numel(), mask.numel() - int(mask.count_nonzero())


def sparsity_report(pruner: Any) -> SparsityReport:
    """Report of ``pruner``'s wrapped layers; reads masks back to the host (not for the training loop).

    A row's ``params``/``pruned``/``sparsity`` are those of the weight; ``bias_pruned`` counts pruned
    bias entries (filter and BatchNorm pruners mask the bias with its channel). The whole-model total
    counts every parameter, biases included.
    """
    rows = []
    for w in pruner.get_modules_wrapper():
        n, p = _count(w.weight_mask)
        _, pb = _count(w.bias_mask)
        rows.append(report_row(w.name, w.type, w.weight.shape, n, p, pb))
    return build_report(rows, sum(p.numel() for p in pruner.bound_model.parameters()))
