#!/usr/bin/env bash
# The GPU check: one run that proves the CUDA paths of the torch backend on a machine with an NVIDIA GPU, in
# about 10 minutes, each step under its own time limit so that one hang cannot eat the budget:
#   1. the torch tests that skip on a CPU for want of CUDA, run and passing with the GPU visible;
#   2. no host sync inside a training step of every pruner / quantizer (sync debug mode + profiler trace);
#   3. one-shot SparseGPT 50 % / GPTQ w4 g128 / AWQ w4 on a tiny Llama on the GPU vs the same run on the CPU;
#   4. packed int4 / int8 layers and 2:4 semi-structured vs dense bf16 on a 4096 x 4096 layer, M = 1, 16, 256;
#   5. `python -m benchmarks --device cuda` rows and level masks of 1e8 / 1e9 weights (goal: 1e9 under 1 s).
# Results: $OUT (default ./gpu-check-out): one JSON per step, summary.json, summary.txt, logs.txt. Exit status
# non-zero when the set-up or any check failed; the later steps run and write their results all the same.
#
# GPU_CHECK_DRY=1: the dry run on a CPU (tiny sizes; CI runs it through tests/test_gpu_check.py).
# Python: $GPU_CHECK_PYTHON, else the first of .venv-gpu-check/bin/python, python3, python whose torch sees a
# GPU (dry run: whose torch imports); else a fresh .venv-gpu-check with torch $GPU_CHECK_TORCH_VERSION
# (default 2.13.0, the default index's CUDA build) and the project's test extras. Wheels in $GPU_CHECK_WHEELS
# (default .whl) fill in missing packages without a registry. Time limits (s): GPU_CHECK_T_SETUP (240, only
# when a venv is made), GPU_CHECK_T1 (150), GPU_CHECK_T2 (75), GPU_CHECK_T3 (120), GPU_CHECK_T4 (60),
# GPU_CHECK_T5 (120): at most 525 s of steps, inside a device machine's 600 s per command.
# GPU_CHECK_STEPS="1 3" runs only those steps. More settings: scripts/gpu_check/README.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$(pwd)
GPU_CHECK_T0=$(date +%s)
export GPU_CHECK_T0
OUT=${OUT:-./gpu-check-out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd) || exit 2
export OUT
rm -f "$OUT"/step[1-5]_*.json "$OUT"/summary.json "$OUT"/summary.txt "$OUT"/logs.txt
WORK=$(mktemp -d -t gpu-check.XXXXXX) || exit 2
trap 'rm -rf "$WORK"' EXIT
export GPU_CHECK_STEPS=${GPU_CHECK_STEPS:-1 2 3 4 5}
case "${GPU_CHECK_DRY:-0}" in 1|true|yes) DRY=1 ;; *) DRY=0 ;; esac
export PYTHONUNBUFFERED=1
# the dry run's numbers mean nothing; one intra-op thread keeps it fast on a small, shared CPU
[ $DRY = 1 ] && export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
HERE=scripts/gpu_check

log() { echo "[gpu_check $(($(date +%s) - GPU_CHECK_T0)) s] $*" | tee -a "$WORK/setup.log" >&2; }
# probe PYTHON: prints "torch gpu deps" as 0 / 1 each (torch imports, it sees a GPU, pytest + transformers are there)
probe() {
    "$1" -c "
import importlib.util as u
try:
    import torch
    t, g = 1, int(torch.cuda.is_available())
except Exception:
    t, g = 0, 0
print(t, g, int(all(u.find_spec(m) is not None for m in ('pytest', 'transformers'))))" 2>/dev/null || echo 0 0 0
}
sees_gpu() { [ "$(probe "$1" | cut -d' ' -f2)" = 1 ]; }
has_test_deps() { "$1" -c "import importlib.util as u, sys; sys.exit(0 if all(u.find_spec(m) for m in ('pytest', 'transformers')) else 1)" >/dev/null 2>&1; }

# ---------------------------------------------------------------------------------------------- python
make_venv() {  # a fresh venv from the registry; prints nothing on stdout
    local base=${1:-python3} venv=.venv-gpu-check links=()
    [ -d "$WHEELS" ] && links=(--find-links "$WHEELS")
    log "creating $venv with torch ${GPU_CHECK_TORCH_VERSION:-2.13.0} (limit ${GPU_CHECK_T_SETUP:-240} s)"
    timeout -k 10 "${GPU_CHECK_T_SETUP:-240}" bash -c '
        set -e
        "$0" -m venv "$1"
        "$1"/bin/python -m pip install -q --upgrade pip
        # the default index: on Linux its torch wheel is the CUDA build (a local CPU wheel must not win)
        PIP_FIND_LINKS= "$1"/bin/python -m pip install --timeout 30 --retries 2 "${@:3}" "torch==$2"
        v=$("$1"/bin/python -c "import torch; print(torch.__version__.split(\"+\")[0])")
        echo "torch==$v" >"$1"/constraints.txt
        "$1"/bin/python -m pip install --timeout 30 --retries 2 "${@:3}" -c "$1"/constraints.txt -e ".[test,hf,onnx]"
    ' "$base" "$venv" "${GPU_CHECK_TORCH_VERSION:-2.13.0}" ${links[@]+"${links[@]}"} >>"$WORK/setup.log" 2>&1
}

WHEELS=${GPU_CHECK_WHEELS:-.whl}
PY=""
HOW=""
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
    PY=$GPU_CHECK_PYTHON HOW="GPU_CHECK_PYTHON"
elif [ $DRY = 1 ]; then
    for c in .tox/torch/bin/python python3 python; do
        if command -v "$c" >/dev/null 2>&1 && [ "$(probe "$c" | cut -d' ' -f1,3)" = "1 1" ]; then
            PY=$c HOW="found $c"
            break
        fi
    done
else
    for c in .venv-gpu-check/bin/python python3 python; do
        if command -v "$c" >/dev/null 2>&1 && sees_gpu "$c"; then
            PY=$c HOW="found $c (its torch sees the GPU)"
            break
        fi
    done
    if [ -z "$PY" ]; then
        if make_venv python3 && sees_gpu .venv-gpu-check/bin/python; then
            PY=.venv-gpu-check/bin/python HOW="fresh .venv-gpu-check"
        else
            log "no Python whose torch sees a GPU, and the venv could not be made (see setup.log)"
        fi
    fi
fi
if [ -z "$PY" ]; then
    PY=$(command -v python3 || command -v python || echo python3) HOW="fallback $PY (no GPU torch)"
fi
PY=$(command -v "$PY" || echo "$PY")
# packages missing from that Python (e.g. transformers) from carried wheels, without a registry
SITE=""
if ! has_test_deps "$PY" && compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="$WORK/site"
    log "installing $(ls "$WHEELS"/*.whl | wc -l) wheels from $WHEELS into a temporary site folder"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$WHEELS"/*.whl >>"$WORK/setup.log" 2>&1 \
        || log "installing the wheels failed"
    HOW="$HOW + wheels from $WHEELS"
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
export GPU_CHECK_SETUP_HOW=$HOW
log "python: $PY ($HOW)"
"$PY" "$HERE/env_info.py" "$WORK/setup.json" >>"$WORK/setup.log" 2>&1
read -r P_TORCH P_GPU P_DEPS <<<"$(probe "$PY")"
if [ "$P_TORCH" != 1 ]; then
    echo "torch does not import in $PY" >"$WORK/setup.status"
elif [ $DRY = 0 ] && [ "$P_GPU" != 1 ]; then
    echo "torch in $PY sees no CUDA device" >"$WORK/setup.status"
elif [ "$P_DEPS" != 1 ]; then
    echo "pytest or transformers missing in $PY (carry wheels in $WHEELS)" >"$WORK/setup.status"
else
    echo ok >"$WORK/setup.status"
fi
log "set-up: $(cat "$WORK/setup.status")"

# ---------------------------------------------------------------------------------------------- steps
run_step() {  # KEY NAME LIMIT_S
    local key=$1 name=$2 limit=$3 rc
    case " $GPU_CHECK_STEPS " in *" $key "*) ;; *) log "$name: not in GPU_CHECK_STEPS"; return 0 ;; esac
    log "$name (limit $limit s)"
    GPU_CHECK_LIMIT_S=$limit timeout -k 10 "$limit" "$PY" "$HERE/$name.py" 2>&1 | tee "$WORK/$name.log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -ne 0 ]; then
        "$PY" "$HERE/common.py" stub "$name" "$rc" "$limit" "$WORK/$name.log" 2>>"$WORK/setup.log" \
            || python3 "$HERE/common.py" stub "$name" "$rc" "$limit" "$WORK/$name.log"
    fi
    log "$name: exit status $rc"
}

run_step 1 step1_cuda_tests "${GPU_CHECK_T1:-150}"
run_step 2 step2_no_sync "${GPU_CHECK_T2:-75}"
run_step 3 step3_oneshot "${GPU_CHECK_T3:-120}"
run_step 4 step4_kernels "${GPU_CHECK_T4:-60}"
run_step 5 step5_benchmarks "${GPU_CHECK_T5:-120}"

SUMMARY_PY=$PY
"$PY" -c pass >/dev/null 2>&1 || SUMMARY_PY=python3
"$SUMMARY_PY" "$HERE/summary.py" "$WORK" >"$WORK/summary.out" 2>&1
rc=$?
cat "$WORK/summary.out"
exit $rc
