#!/usr/bin/env bash
# Run the whole test matrix (core, torch, tf, parity, docs) from a fresh machine: bootstraps tox + tox-uv in
# .venv-tox, then runs tox. Extra arguments go to tox (e.g. `scripts/test.sh -e core`).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv-tox/bin/tox ]; then
    "$PY" -m venv .venv-tox
    .venv-tox/bin/python -m pip install -q --upgrade pip
    .venv-tox/bin/python -m pip install -q "tox>=4" tox-uv
fi
# uv does not read pip's settings: forward the local wheel folder (the CPU torch wheel) to it.
if [ -n "${PIP_FIND_LINKS:-}" ] && [ -z "${UV_FIND_LINKS:-}" ]; then
    export UV_FIND_LINKS="$PIP_FIND_LINKS"
fi
export UV_COMPILE_BYTECODE=1
# uv (installed with tox-uv) on PATH, for scripts/install_keras_hub.py when an env has no pip
export PATH="$PWD/.venv-tox/bin:$PATH"
exec .venv-tox/bin/tox "$@"
