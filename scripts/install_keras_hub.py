"""Install keras-hub into the running interpreter's environment without tensorflow-text.

keras-hub 0.32 declares ``tensorflow-text``, which pulls the full ``tensorflow`` wheel (GPU build) next to
``tensorflow-cpu``; keras-hub only needs it for its tokenizers, which the tests do not use. So: keras-hub with
``--no-deps``, then its other requirements normally. Works in a pip venv and in a tox-uv venv (no pip there:
uv is used, found on PATH or next to this interpreter).
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys

KERAS_HUB = "keras-hub==0.32.0"
REQUIRES = ["absl-py", "kagglehub", "kagglesdk==0.1.28", "packaging", "regex", "rich", "sentencepiece", "tokenizers"]


def _installer() -> list[str]:
    if importlib.util.find_spec("pip") is not None:
        return [sys.executable, "-m", "pip", "install", "-q"]
    uv = shutil.which("uv")
    if uv is None:
        sys.exit("install_keras_hub: neither pip nor uv is available to install keras-hub")
    return [uv, "pip", "install", "-q", "--python", sys.executable]


def main() -> None:
    if importlib.util.find_spec("keras_hub") is not None:
        return
    cmd = _installer()
    subprocess.run([*cmd, "--no-deps", KERAS_HUB], check=True)
    subprocess.run([*cmd, *REQUIRES], check=True)


if __name__ == "__main__":
    main()
