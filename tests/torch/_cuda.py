"""Shared scaffolding of the CUDA no-host-sync tests (pruners and quantizers)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn


def batch_and_step(model: nn.Module, opt: torch.optim.Optimizer, device: str = "cuda",
                   batch: int = 16, classes: int = 5) -> tuple[torch.Tensor, Callable[[], None]]:
    """A random 1x8x8 batch on ``device`` and a closure running one training step of ``model`` on it."""
    x = torch.randn(batch, 1, 8, 8, device=device)
    y = torch.randint(0, classes, (batch,), device=device)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    return x, step


@contextlib.contextmanager
def no_host_sync() -> Iterator[None]:
    """Inside the block any host-device synchronisation raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")
