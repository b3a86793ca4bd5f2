"""Checks of torch files we did not write, after ``torch.load`` (the zip / pickle checks before it live in
:mod:`compressor.core.archives`, which imports no torch)."""

from __future__ import annotations

from typing import Any

import torch

from ..core.archives import TORCH_TENSOR_BASE, TORCH_TENSOR_RATIO, ArchiveError

__all__ = ["check_torch_object"]


def check_torch_object(obj: Any, file_bytes: int) -> None:
    """After ``torch.load``: every tensor in ``obj`` is a dense (strided) one, and together they hold at most
    TORCH_TENSOR_BASE + TORCH_TENSOR_RATIO x ``file_bytes`` (views count once each)."""
    cap = TORCH_TENSOR_BASE + TORCH_TENSOR_RATIO * int(file_bytes)
    total, stack, seen = 0, [obj], set()
    while stack:  # iterative: a deeply nested pickle must not exhaust the recursion limit
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            if x.layout != torch.strided or x.is_quantized or x.is_nested or x.is_meta:
                raise ArchiveError(f"it holds a {x.layout} / quantized / nested / meta tensor; only dense ones are read")
            total += x.numel() * x.element_size()
            if total > cap:
                raise ArchiveError(f"its tensors hold more than {cap:,} bytes ({TORCH_TENSOR_BASE:,} + "
                                   f"{TORCH_TENSOR_RATIO}x the {file_bytes:,}-byte file: views that overlap)")
        elif isinstance(x, (dict, list, tuple, set)) and id(x) not in seen:
            seen.add(id(x))
            stack.extend(x.values() if isinstance(x, dict) else x)
