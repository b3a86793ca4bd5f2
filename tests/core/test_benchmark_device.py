"""``python -m benchmarks --device X`` refuses devices it cannot run on before measuring anything
(exit status 2, a message naming what is allowed), instead of one traceback per script."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks", *args, "--out", "-"], cwd=ROOT, capture_output=True,
                          text=True, timeout=1800)


@pytest.mark.parametrize("device", ["gpu", "cuda:x", "tpu:0"])
def test_unknown_device_is_refused(device):
    out = run("--device", device)
    assert out.returncode == 2
    assert f"--device {device!r}: allowed: cpu, cuda, cuda:N" in out.stderr
    assert "running" not in out.stderr  # nothing was started
