"""Per-layer sparsity report of a TF pruner: data (list of dicts) and a text table (``str()``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from ...core.report import SparsityReport, build_report, flops_summary, report_row

__all__ = ["SparsityReport", "flops_after_speedup", "sparsity_report"]


def _count(mask: Any) -> tuple[int, int]:
    if mask is None:
        return 0, 0
    m = np.asarray(mask.numpy())
    return int(m.size), int(m.size - np.count_nonzero(m))


def flops_after_speedup(pruner: Any, strict: bool = False) -> dict[str, Any]:
    """MACs (per sample) and parameters of the pruner's model dense and after :func:`speedup_model` (which
    builds a NEW model: the pruner and its model are untouched), as a
    :func:`~compressor.core.report.flops_summary` dict. ``strict=False``: channels the speedup cannot
    remove stay (the summary's notes say which)."""
    from ..speedup import speedup_model

    _, rep = speedup_model(pruner, strict=strict, return_report=True)
    return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)


def sparsity_report(pruner: Any, flops: bool = False, strict: bool = False) -> SparsityReport:
    """Report of ``pruner``'s wrapped (built) layers; reads masks back to the host (not for the training
    loop). The whole-model total counts every trainable weight.

    ``flops=True`` adds ``report.flops`` (printed under the table): MACs and parameters of the dense model
    and of a sped-up copy (:func:`flops_after_speedup`)."""
    rows = []
    for w in pruner.get_modules_wrapper():
        if not w.ready:
            continue
        n, p = _count(w.weight_mask)
        _, pb = _count(w.bias_mask)
        rows.append(report_row(w.name, w.type, [int(d) for d in w.weight.shape], n, p, pb))
    summary = flops_after_speedup(pruner, strict) if flops else None
    return build_report(rows, sum(int(np.prod(v.shape)) for v in pruner.model.trainable_variables), summary)
