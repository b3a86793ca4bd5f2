#!/usr/bin/env bash
# Set up .venv with both backends and run the demo (main job). Extra arguments go to `compressor demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/compressor ]; then
    "$PY" -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    # torch is pinned in the extra so pip takes the local CPU wheel (PIP_FIND_LINKS), not a CUDA build.
    .venv/bin/python -m pip install -q -e ".[all,demo]"
fi
export TF_CPP_MIN_LOG_LEVEL=2 TF_ENABLE_ONEDNN_OPTS=0
exec .venv/bin/compressor demo "$@"
