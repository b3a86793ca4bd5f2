"""The GPU check script (``scripts/gpu_check.sh``) does not rot: its dry run on the CPU (``GPU_CHECK_DRY=1``) runs
every step's CPU-runnable part, writes the JSON files a GPU run writes, with their keys, and exits 0; a step that
overruns its time limit is killed, recorded as failed, and the script exits non-zero. Step 1's list of CUDA tests
is checked against the test sources: every test under a CUDA ``skipif`` mark is on it, and each skips on the CPU
for want of CUDA.

Runs in the torch tox env (marked ``torch``: the dry run needs torch and transformers)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
STEP_FILES = ["step1_cuda_tests", "step2_no_sync", "step3_oneshot", "step4_kernels", "step5_benchmarks"]
STEP_KEYS = {"step", "title", "ok", "dry", "device", "seconds", "checks", "results", "lines", "error"}


def dry_run(out: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "GPU_CHECK_DRY": "1", "OUT": str(out), "GPU_CHECK_PYTHON": sys.executable, **env}
    return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=full, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def dry(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check-out")
    proc = dry_run(out)
    return proc, out


def load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_dry_run_exits_0_and_writes_every_file(dry):
    proc, out = dry
    summary = (out / "summary.txt").read_text() if (out / "summary.txt").is_file() else "no summary.txt"
    assert proc.returncode == 0, "\n".join(line for line in summary.splitlines()
                                           if "FAIL" in line or "error" in line)[-4000:] + proc.stderr[-2000:]
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"{n}.json" for n in STEP_FILES] + ["summary.json", "summary.txt", "logs.txt"])
    assert len(names) <= 8  # what comes back from a device machine's $OUT: at most 8 files
    assert "GPU check: PASSED (dry run on the CPU)" in (out / "summary.txt").read_text()


def test_step_files_have_the_keys_and_passed(dry):
    _, out = dry
    for name in STEP_FILES:
        rec = load(out, name)
        assert STEP_KEYS <= set(rec), (name, STEP_KEYS - set(rec))
        assert rec["step"] == name and rec["dry"] is True and rec["device"] == "cpu"
        assert rec["ok"] is True and rec["error"] is None, (name, rec["error"], rec["checks"])
        assert rec["checks"] and all(c["ok"] for c in rec["checks"])


def test_summary_json(dry):
    _, out = dry
    s = load(out, "summary")
    assert {"ok", "dry", "total_seconds", "setup_status", "setup", "steps"} <= set(s)
    assert s["ok"] is True and s["dry"] is True and s["setup_status"] == "ok"
    assert sorted(s["steps"]) == STEP_FILES and all(v["ran"] and v["ok"] for v in s["steps"].values())
    assert s["setup"]["torch"].startswith("2.") and s["setup"]["packages"]["transformers"] != "not installed"


def test_steps_cover_what_the_gpu_run_reports(dry):
    _, out = dry
    wrappers = load(out, "step2_no_sync")["results"]["wrappers"]
    for name in ("LevelPruner", "AGPPruner(level)", "L1FilterPruner", "L2FilterPruner", "FPGMPruner",
                 "QAT_Quantizer(w8a8)", "LsqQuantizer", "DoReFaQuantizer"):
        assert name in wrappers and {"sync_debug", "memcpy_dtoh", "host_reads"} <= set(wrappers[name]), name
    oneshot = load(out, "step3_oneshot")["results"]
    assert sorted(oneshot) == ["awq-w4-g128", "gptq-w4-g128", "sparsegpt-50%"]
    for rec in oneshot.values():
        assert {"entries", "differ", "ppl_cpu", "ppl_device", "ppl_rel_diff"} <= set(rec) and rec["entries"] > 0
    table = load(out, "step4_kernels")["results"]["table"]
    for name in ("dense-bf16", "packed-int4-g128", "packed-int8"):
        assert {"M=1", "M=16"} <= set(table[name]) and "vs_dense_bf16" in table[name]["M=1"], name
    bench = load(out, "step5_benchmarks")["results"]
    assert set(bench["level_mask"]) == {"1e5", "1e6"}
    assert bench["rows"]["mask_overhead"] and bench["rows"]["qat_step"] and bench["rows"]["memory"]


# ------------------------------------------------------------------------------------------ the CUDA test list
CUDA_SKIPIF = re.compile(r"skipif\(.*?\b(cuda|gpu)\b", re.IGNORECASE | re.DOTALL)


def cuda_marked_tests() -> dict[str, set[str]]:
    """From the sources alone: file -> names of the test functions under a CUDA ``skipif`` mark (on the function,
    its class, or the module's ``pytestmark``: then every test of the file), in the torch suite (the TensorFlow and
    cross-backend suites are not the GPU check's)."""
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.parts[len(ROOT.parts) + 1] in ("tf", "parity") or path.stem.endswith("_tf"):
            continue
        source = path.read_text()
        tree = ast.parse(source)
        rel = str(path.relative_to(ROOT))

        def marked(nodes, source=source) -> bool:
            return any(CUDA_SKIPIF.search(ast.get_source_segment(source, n) or "") for n in nodes)

        module_mark = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                          and marked([n.value]) for n in tree.body)
        for node in tree.body:
            classes = [node] if isinstance(node, ast.ClassDef) else []
            funcs = [(node, False)] if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
            for c in classes:
                funcs += [(f, marked(c.decorator_list)) for f in c.body
                          if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))]
            for f, class_mark in funcs:
                if f.name.startswith("test") and (module_mark or class_mark or marked(f.decorator_list)):
                    found.setdefault(rel, set()).add(f.name)
    return found


def test_the_cuda_test_list_is_every_test_that_skips_for_want_of_cuda(dry):
    _, out = dry
    res = load(out, "step1_cuda_tests")["results"]
    assert res["count"] >= 30 and res["count"] == len(res["tests"])
    listed: dict[str, set[str]] = {}
    for nodeid in res["tests"]:
        path, _, rest = nodeid.partition("::")
        listed.setdefault(path, set()).add(rest.split("[")[0].split("::")[-1])
    assert listed == cuda_marked_tests()
    for nodeid in res["tests"]:  # each one skipped on this CPU, for want of CUDA
        rec = res["outcomes"][nodeid]
        assert rec["outcome"] == "skipped" and re.search("cuda", rec["reason"], re.IGNORECASE), (nodeid, rec)


def test_a_step_over_its_time_limit_is_killed_recorded_and_fails_the_run(tmp_path):
    proc = dry_run(tmp_path, GPU_CHECK_STEPS="4", GPU_CHECK_T4="1")
    assert proc.returncode != 0
    rec = load(tmp_path, "step4_kernels")
    assert rec["ok"] is False and "timed out after 1 s" in rec["error"]
    s = load(tmp_path, "summary")
    assert s["ok"] is False and s["steps"]["step4_kernels"]["ok"] is False
    assert s["steps"]["step1_cuda_tests"] == {"ran": False, "ok": None, "why": "not in GPU_CHECK_STEPS"}
    assert "step4_kernels: FAILED" in (tmp_path / "summary.txt").read_text()
