"""2:4 Linear layers on sparse tensor cores: ``torch.sparse.to_sparse_semi_structured`` (CUDA only).

After N:M pruning (``LevelPruner(model, [{'sparse_pattern': '2:4', 'op_types': ['Linear']}])``), export
(or take the pruner's unwrapped model) and convert::

    model = compressor.torch.to_semi_structured(pruner)      # or a plain model with 2:4 Linear weights
    with torch.no_grad():
        y = model(x.half().cuda())

Every ``nn.Linear`` whose weight keeps at most 2 of every 4 consecutive input weights gets its weight
replaced by a ``SparseSemiStructuredTensor`` (compressed values + 2-bit metadata; the matmul runs on
the GPU's sparse tensor cores, cuSPARSELt or CUTLASS); other layers are left as they are. The model is
cast to ``dtype`` (float16 by default; the sparse kernels take float16 / bfloat16 / int8) and inference
only: the converted weights do not train. Shapes must fit the kernels (PyTorch: both weight dims
multiples of 64 for float16, checked by torch); layers that do not fit are listed in the error.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ..core.errors import ModelError

__all__ = ["is_two_of_four", "to_semi_structured"]


def is_two_of_four(weight: torch.Tensor) -> bool:
    """True when every 4 consecutive weights along the input axis (last dim of a Linear weight) hold at
    most 2 non-zeros (the core N:M mask's groups for a Linear)."""
    if weight.dim() != 2 or weight.shape[1] % 4:
        return False
    return bool(((weight.detach().reshape(weight.shape[0], -1, 4) != 0).sum(-1) <= 2).all())


def to_semi_structured(model: Any, dtype: torch.dtype = torch.float16, layers: list[str] | None = None,
                       inplace: bool = False) -> nn.Module:
    """Convert the 2:4 ``nn.Linear`` layers of ``model`` (a plain module on a CUDA device, or a
    ``TorchPruner`` whose masked model is copied) to semi-structured sparse weights; returns the model.

    ``layers``: the names to convert (default: every Linear whose weight is 2:4). Refuses (ModelError,
    nothing changed) without CUDA, with a model not on CUDA, or when a named layer is not 2:4 or its
    shape does not fit the sparse kernels. ``inplace=False`` converts a deep copy.
    """
    from torch.sparse import to_sparse_semi_structured

    if hasattr(model, "bound_model"):  # a pruner: its masked model without wrappers
        from .pruning.export import unwrapped_model

        model, inplace = unwrapped_model(model.bound_model), True
    if not isinstance(model, nn.Module):
        raise ModelError(f"to_semi_structured: expected an nn.Module or a pruner, got {type(model).__name__}")
    if not torch.cuda.is_available():
        raise ModelError("to_semi_structured: semi-structured sparse kernels need a CUDA GPU (compute capability "
                         ">= 8.0); none is available")
    linears = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    names = [n for n, m in linears.items() if is_two_of_four(m.weight)] if layers is None else list(layers)
    problems = []
    for n in names:
        m = linears.get(n)
        if m is None:
            problems.append(f"{n!r} is not an nn.Linear of the model")
        elif m.weight.device.type != "cuda":
            problems.append(f"{n!r} is on {m.weight.device}, not CUDA (call model.cuda() first)")
        elif not is_two_of_four(m.weight):
            problems.append(f"{n!r} is not 2:4 sparse (prune it with sparse_pattern: '2:4')")
    if not names:
        problems.append("no Linear layer has a 2:4 weight")
    if problems:
        raise ModelError("to_semi_structured: " + "; ".join(problems))
    target = model if inplace else copy.deepcopy(model)
    target = target.to(dtype)
    converted = {}
    for n in names:
        layer = target.get_submodule(n)
        try:
            converted[n] = to_sparse_semi_structured(layer.weight.detach())
        except (RuntimeError, ValueError) as e:
            raise ModelError(f"to_semi_structured: layer {n!r} (weight {tuple(layer.weight.shape)}) does not fit the "
                             f"sparse kernels: {str(e).splitlines()[0]}") from None
    for n, w in converted.items():  # all converted: now swap them in
        target.get_submodule(n).weight = nn.Parameter(w, requires_grad=False)
    return target
