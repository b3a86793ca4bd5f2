"""Step 1: the torch tests that skip on a CPU for want of a CUDA device, run with the GPU visible.

pytest collects the torch suite (``-m "torch and not tf"``) and :mod:`cuda_tests_plugin` keeps only the tests
with a CUDA ``skipif`` mark, so exactly those run (the rest of the suite is CPU-tested in CI). On the GPU every
one of them must pass (a skip there is a failure: it did not run). Dry run: the same selection on the CPU, where
each of them must skip, with a reason naming CUDA; the list is what the GPU run will run.

Settings: ``GPU_CHECK_TEST_TIMEOUT`` (seconds per test, default 120, when pytest-timeout is installed),
``GPU_CHECK_PYTEST_ARGS`` (more pytest arguments, e.g. ``-x``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Step, dry, env_float, env_int, run_step  # noqa: E402

HERE = Path(__file__).resolve().parent
CUDA_SKIP_IN_SOURCE = re.compile(r"skipif\([^\n]*cuda", re.IGNORECASE)


def pytest_command(results: Path) -> tuple[list[str], dict[str, str]]:
    cmd = [sys.executable, "-m", "pytest", "tests", "-m", "torch and not tf", "-p", "cuda_tests_plugin",
           "-p", "no:cacheprovider", "--continue-on-collection-errors", "-q", "-rfEs"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(env_int("GPU_CHECK_TEST_TIMEOUT", 120))]
    cmd += shlex.split(os.environ.get("GPU_CHECK_PYTEST_ARGS", ""))
    env = dict(os.environ)
    # the backend tests of this run are torch's: neither CI's "every backend is required" nor a TensorFlow test
    env.pop("CI", None)
    env["COMPRESSOR_REQUIRE_BACKENDS"] = "torch"
    env["GPU_CHECK_RESULTS"] = str(results)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if dry():
        env["CUDA_VISIBLE_DEVICES"] = ""  # a dry run on a GPU machine still checks the CPU skips
    return cmd, env


def body(step: Step) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results.json"
        cmd, env = pytest_command(results)
        limit = max(30.0, env_float("GPU_CHECK_LIMIT_S", 150.0) - 15.0)
        step.say(f"$ {' '.join(shlex.quote(c) for c in cmd)}  (limit {limit:.0f} s)")
        t0 = time.perf_counter()
        try:
            out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
            rc, text = out.returncode, out.stdout + out.stderr
        except subprocess.TimeoutExpired as e:
            rc = None
            text = (e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""))
        seconds = time.perf_counter() - t0
        tail = text.strip().splitlines()[-40:]
        print("\n".join(tail), flush=True)
        data = json.loads(results.read_text()) if results.is_file() else {}
    selected: dict[str, str] = data.get("selected", {})
    outcomes: dict[str, dict] = data.get("outcomes", {})
    files = sorted({n.split("::")[0] for n in selected})
    step.results.update({
        "pytest_exit_status": rc, "pytest_seconds": round(seconds, 1), "count": len(selected),
        "tests": sorted(selected), "files": files, "outcomes": outcomes,
        "collect_errors": data.get("collect_errors", []), "pytest_tail": tail[-15:],
    })
    if rc is None:
        step.check("pytest finished in time", False, f"killed after {limit:.0f} s (GPU_CHECK_T1); the outcomes "
                                                     f"so far are in results.outcomes")
    step.check("CUDA tests found", len(selected) >= env_int("GPU_CHECK_MIN_CUDA_TESTS", 1),
               f"{len(selected)} tests in {len(files)} files")
    # a collection error in a file that has CUDA tests hides them; one elsewhere (a package missing on this
    # machine for a CPU-only test module) is only reported
    hidden = []
    for err in data.get("collect_errors", []):
        path = ROOT / err.split(":", 1)[0].split("::")[0]
        if path.is_file() and CUDA_SKIP_IN_SOURCE.search(path.read_text(errors="replace")):
            hidden.append(err)
    step.check("no collection error in a file with CUDA tests", not hidden, hidden or "")
    by = {}
    for n in selected:
        by.setdefault(outcomes.get(n, {}).get("outcome", "not run"), []).append(n)
    step.results["counts"] = {k: len(v) for k, v in by.items()}
    step.say("outcomes: " + ", ".join(f"{k} {len(v)}" for k, v in sorted(by.items())))
    if dry():
        bad = [f"{n}: {outcomes.get(n, {}).get('outcome', 'not run')} "
               f"{outcomes.get(n, {}).get('reason', '')[:120]}" for n in selected
               if outcomes.get(n, {}).get("outcome") != "skipped"
               or not re.search(r"cuda|gpu", outcomes[n].get("reason", ""), re.IGNORECASE)]
        step.check("every selected test skips on the CPU for want of CUDA", not bad, bad[:10] or "")
    else:
        bad = [f"{n}: {outcomes.get(n, {}).get('outcome', 'not run')} {outcomes.get(n, {}).get('reason', '')[:200]}"
               for n in selected if outcomes.get(n, {}).get("outcome") != "passed"]
        step.check("every CUDA test runs and passes", not bad, bad[:20] or f"{len(selected)} passed")
        slow = sorted(((v["seconds"], k) for k, v in outcomes.items()), reverse=True)[:5]
        step.results["slowest"] = [f"{s:.1f} s {k}" for s, k in slow]


if __name__ == "__main__":
    raise SystemExit(run_step("step1_cuda_tests", "the tests that skip on a CPU for want of CUDA", body))
