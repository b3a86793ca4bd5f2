"""The PyTorch benchmark scripts refuse a CUDA device this machine does not have, with a clear message
(exit status 2) and before measuring anything; ``python -m benchmarks`` does the same up front."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
MISSING = f"cuda:{torch.cuda.device_count()}"  # one past the last visible device: never there


@pytest.mark.parametrize("script", ["benchmarks/torch_prune.py", "benchmarks/torch_quant.py"])
def test_script_refuses_missing_cuda_device(script):
    out = subprocess.run([sys.executable, script, "--device", MISSING], cwd=ROOT, capture_output=True, text=True,
                         timeout=1800)
    assert out.returncode == 2, out.stderr[-500:]
    assert f"--device {MISSING}:" in out.stderr
    assert "run with --device cpu" in out.stderr or "CUDA device(s) visible" in out.stderr
    assert "Traceback" not in out.stderr


def test_suite_refuses_missing_cuda_device():
    out = subprocess.run([sys.executable, "-m", "benchmarks", "--device", MISSING, "--out", "-"], cwd=ROOT,
                         capture_output=True, text=True, timeout=1800)
    assert out.returncode == 2
    assert f"torch sees {torch.cuda.device_count()} CUDA device(s)" in out.stderr
    assert "running" not in out.stderr
