"""PyTorch ``state_dict`` files (``.pt`` / ``.pth``) for the report: checked against the caps of
:mod:`compressor.core.archives`, loaded with ``weights_only=True``; one row per ``<layer>.weight`` (a wrapped
model's ``<layer>.module.weight`` too) and its ``<layer>.weight_mask``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ...core.errors import BackendNotAvailable, ModelError

TORCH_SUFFIXES = (".pt", ".pth")


def _torch_load(path: str) -> Any:
    try:
        import torch
    except ImportError:
        raise BackendNotAvailable(f"reading {path!r} needs torch (pip install 'compressor[torch]')") from None
    from ...core.archives import check_torch_archive
    from ...torch.archive_checks import check_torch_object

    try:
        check_torch_archive(path)  # the zip's directory and pickle, against the caps of core.archives
        obj = torch.load(path, map_location="cpu", weights_only=True)
        check_torch_object(obj, os.path.getsize(path))
        return obj
    except Exception as e:  # pickle errors, zip errors, a pickled nn.Module refused by weights_only, the caps
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelError(f"cannot read {path!r} as a torch state_dict ({first[:300]}); save one with "
                         f"torch.save(model.state_dict(), path) or pruner.export_model(path)") from None


def _to_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        try:
            return t.numpy()
        except TypeError:  # dtypes numpy lacks (float8_*, complex32): widened, as bfloat16 is
            import torch

            return (t.to(torch.complex64) if t.is_complex() else t.float()).numpy()
    return np.asarray(t)


def _from_state_dict(sd: dict[str, Any], path: str) -> tuple[list[tuple[str, np.ndarray]], dict[str, np.ndarray]]:
    """Rows ``(layer, weight)`` and masks found inside a state_dict (wrapped models keep them there)."""
    if not all(isinstance(k, str) for k in sd):
        raise ModelError(f"{path!r} is not a state_dict (keys must be parameter names)")
    weights: list[tuple[str, np.ndarray]] = []
    masks: dict[str, np.ndarray] = {}
    for key, value in sd.items():
        if not hasattr(value, "shape"):
            continue
        parts = [p for p in key.split(".") if p != "module"]  # conv1.module.weight -> conv1.weight
        leaf, layer = parts[-1], ".".join(parts[:-1])
        if leaf == "weight" and np.issubdtype(_to_numpy(value).dtype, np.floating):
            weights.append((layer, _to_numpy(value)))
        elif leaf == "weight_mask":
            masks[layer] = _to_numpy(value).astype(bool)
    return weights, masks
