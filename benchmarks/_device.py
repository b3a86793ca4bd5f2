"""``--device`` for the PyTorch benchmark scripts: refuse a device this machine cannot run on with a
clear message, before anything is measured."""

from __future__ import annotations

import argparse

import torch


def torch_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError as e:
        parser.error(f"--device {name!r} is not a torch device ({e}); allowed: cpu, cuda, cuda:N")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device {name!r}: allowed: cpu, cuda, cuda:N")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            parser.error(f"--device {name}: torch sees no CUDA device (torch {torch.__version__}, {build}); "
                         f"run with --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            parser.error(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s) visible")
    return device
