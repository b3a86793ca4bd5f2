"""Per-layer sparsity report of a pruner: data (list of dicts) and a text table (``str()``)."""

from __future__ import annotations

from typing import Any

import torch

from ...core.report import SparsityReport, build_report, flops_summary, report_row

__all__ = ["SparsityReport", "flops_after_speedup", "sparsity_report"]


def _count(mask: torch.Tensor | None) -> tuple[int, int]:
    if mask is None:
        return 0, 0
    return mask.numel(), mask.numel() - int(mask.count_nonzero())


def flops_after_speedup(pruner: Any, dummy_input: Any, strict: bool = False) -> dict[str, Any]:
    """MACs (per sample) and parameters of the pruner's model dense and after :func:`speedup_model`, as a
    :func:`~compressor.core.report.flops_summary` dict. The speedup runs on an unwrapped COPY: the
    pruner and its model are left as they were. ``strict=False``: channels the speedup cannot remove
    stay (the summary's notes say which)."""
    from ..speedup import speedup_model, speedup_report

    small = speedup_model(pruner, dummy_input, strict=strict)
    rep = speedup_report(small)
    return flops_summary(rep.macs_before, rep.params_before, rep.macs_after, rep.params_after, rep.notes)


def sparsity_report(pruner: Any, dummy_input: Any = None, strict: bool = False) -> SparsityReport:
    """Report of ``pruner``'s wrapped layers; reads masks back to the host (not for the training loop).

    A row's ``params``/``pruned``/``sparsity`` are those of the weight; ``bias_pruned`` counts pruned
    bias entries (filter and BatchNorm pruners mask the bias with its channel). The whole-model total
    counts every parameter, biases included.

    With ``dummy_input`` (one forward's input, as for ``speedup_model``) the report also carries
    ``report.flops`` (printed under the table): MACs and parameters of the dense model and of a sped-up
    copy (:func:`flops_after_speedup`); the pruner's model is not modified.
    """
    rows = []
    for w in pruner.get_modules_wrapper():
        n, p = _count(w.weight_mask)
        _, pb = _count(w.bias_mask)
        rows.append(report_row(w.name, w.type, w.weight.shape, n, p, pb))
    flops = None if dummy_input is None else flops_after_speedup(pruner, dummy_input, strict)
    return build_report(rows, sum(p.numel() for p in pruner.bound_model.parameters()), flops)
