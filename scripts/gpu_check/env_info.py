"""What the GPU check ran on: Python, torch and its CUDA build, the GPU and its driver, the test packages.

``python env_info.py PATH`` writes the JSON to PATH and prints one line per entry; exit status 0 whatever is
missing (a missing package is recorded as such). The summary puts it at the head of ``summary.json``.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from typing import Any

#: distribution names (read from the installed metadata, not imported: importing them all takes seconds)
PACKAGES = ("torch", "transformers", "numpy", "pytest", "pytest-timeout", "pytest-xdist", "hypothesis", "onnx",
            "onnxruntime", "accelerate", "safetensors", "compressed-tensors")


def version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info() -> dict[str, Any]:
    out: dict[str, Any] = {
        "python": sys.executable, "python_version": platform.python_version(), "platform": platform.platform(),
        "cpus": os.cpu_count(), "how": os.environ.get("GPU_CHECK_SETUP_HOW", "?"),
        "packages": {p: version(p) for p in PACKAGES},
    }
    try:
        import torch

        out["torch"] = torch.__version__
        out["torch_cuda_build"] = torch.version.cuda
        out["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            out["gpu"] = {"name": p.name, "capability": list(torch.cuda.get_device_capability(0)),
                          "memory_gib": round(p.total_memory / 2**30, 1), "count": torch.cuda.device_count(),
                          "cudnn": torch.backends.cudnn.version()}
    except Exception as e:  # noqa: BLE001 - recorded
        out["torch_error"] = f"{type(e).__name__}: {e}"
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                               capture_output=True, text=True, timeout=20)
            out["nvidia_smi"] = r.stdout.strip() or r.stderr.strip()[-200:]
        except (OSError, subprocess.TimeoutExpired) as e:
            out["nvidia_smi"] = f"failed: {e}"
    return out


if __name__ == "__main__":
    data = info()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(data, f, indent=1)
    for k, v in data.items():
        print(f"{k}: {v}")
