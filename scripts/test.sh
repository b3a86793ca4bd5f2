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
# Two envs at a time (TOX_PARALLEL=N for another number, 0 for one after the other with live output): most of
# the torch and tf suites' time is one core's Python, and run one after the other they came close to CI's 30
# minutes on 2 cores. tf (the longest) and torch start first (env_list order); an env's output is printed when
# it fails.
if [ "${TOX_PARALLEL:-2}" != "0" ] && [ "${1:-}" != "-e" ]; then
    exec .venv-tox/bin/tox run-parallel --parallel "${TOX_PARALLEL:-2}" --parallel-no-spinner "$@"
fi
exec .venv-tox/bin/tox "$@"
