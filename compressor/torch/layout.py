"""PyTorch weight layouts <-> the canonical layout core math sees (output channels first).

Most torch layers already store their weight out-first (``Linear [out, in]``, ``ConvNd [out, in, k...]``)
and pass through unchanged. Hugging Face's ``Conv1D`` (GPT-2's projections) is a Linear whose weight is
stored ``[in, out]``: it is transposed, so a 32 -> 96 layer has 96 filters (neurons), 96 per-channel
quantization scales, and N:M groups along its 32 inputs, exactly as the equivalent ``nn.Linear``. Masks
are computed in canonical layout and transposed back before they are stored (the wrapper's
``weight_mask`` always has the weight's own shape). Transposed convolutions keep their layout (their
output channels are axis 1: :func:`out_axis`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .families import is_in_out_linear
from .families import is_in_out_linear as is_hf_conv1d  # noqa: F401  (the name the backend used first)
from .modules import innermost_module

__all__ = ["is_transposed", "to_canonical", "from_canonical", "canonical_shape", "out_axis", "layer_of", "is_grn"]


def layer_of(module: nn.Module) -> nn.Module:
    """The original layer inside compressor wrappers (a wrapper or a layer may be passed)."""
    return innermost_module(module)


def is_transposed(module: nn.Module) -> bool:
    """True when ``module``'s 2-D weight is stored ``[in, out]`` (HF ``Conv1D``)."""
    return is_in_out_linear(layer_of(module))


def is_grn(module: nn.Module) -> bool:
    """Global response normalisation (ConvNeXt V2; HF ``ConvNextV2GRN``): ``weight`` (gamma) and ``bias`` (beta)
    of shape ``[1, 1, 1, C]`` on a channels-last tensor, ``x + gamma * x * N + beta`` with ``N`` the spatial L2
    norm of each channel divided by its mean over the channels. Its channels are the LAST axis of its
    parameters (canonical layout: moved first)."""
    layer = layer_of(module)
    w, b = getattr(layer, "weight", None), getattr(layer, "bias", None)
    return (type(layer).__name__.endswith("GRN") and isinstance(w, torch.Tensor) and isinstance(b, torch.Tensor)
            and w.dim() >= 2 and w.shape == b.shape and all(d == 1 for d in w.shape[:-1]))


def to_canonical(module: nn.Module, x: Any) -> Any:
    """``x`` (the weight, a mask or a gradient of ``module``'s weight) in canonical out-first layout."""
    if is_grn(module) and x.dim() >= 2:
        return x.movedim(-1, 0)
    return x.t() if is_transposed(module) and x.dim() == 2 else x


def from_canonical(module: nn.Module, x: Any) -> Any:
    """Inverse of :func:`to_canonical` (a contiguous tensor in the weight's own layout)."""
    if is_grn(module) and x.dim() >= 2:
        return x.movedim(0, -1).contiguous()
    return x.t().contiguous() if is_transposed(module) and x.dim() == 2 else x


def canonical_shape(module: nn.Module, shape: Any) -> tuple[int, ...]:
    """The shape :func:`to_canonical` gives a tensor of ``shape``."""
    s = tuple(int(d) for d in shape)
    if is_grn(module) and len(s) >= 2:
        return (s[-1], *s[:-1])
    return (s[1], s[0]) if is_transposed(module) and len(s) == 2 else s


def out_axis(module: nn.Module) -> int:
    """Axis of the output channels in ``module.weight`` as stored (1 for transposed convs and HF Conv1D, the
    last for GRN)."""
    layer = layer_of(module)
    if isinstance(layer, nn.modules.conv._ConvNd) and layer.transposed:
        return 1
    if is_grn(layer):
        return layer.weight.dim() - 1
    return 1 if is_in_out_linear(layer) else 0


def in_out_features(module: nn.Module) -> tuple[int, int] | None:
    """``(in, out)`` features of a Linear-like layer (nn.Linear, HF Conv1D), else None."""
    layer = layer_of(module)
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if is_in_out_linear(layer) and isinstance(getattr(layer, "weight", None), torch.Tensor):
        return int(layer.weight.shape[0]), int(layer.weight.shape[1])
    return None
