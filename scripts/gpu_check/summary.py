"""The GPU check's summary: ``summary.json``, ``summary.txt`` and ``logs.txt`` in ``$OUT``, from the step files.

``python summary.py WORKDIR`` (``scripts/gpu_check.sh`` calls it last): WORKDIR holds ``setup.json`` (from
:mod:`env_info`), ``setup.status`` and the step logs. Exit status 1 when the set-up or any step that was asked for
(``GPU_CHECK_STEPS``, default all) failed. Standard library only.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import STEP_KEYS, STEPS, dry, out_dir  # noqa: E402

#: per log in logs.txt, the last this many characters (what comes back from a device machine is limited)
LOG_CHARS = 400_000


def load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def main(work: Path) -> int:
    out = out_dir()
    wanted = os.environ.get("GPU_CHECK_STEPS", "1 2 3 4 5").split()
    setup = load(work / "setup.json") or {}
    status = (work / "setup.status").read_text().strip() if (work / "setup.status").is_file() else "?"
    setup_ok = status == "ok"
    steps: dict[str, Any] = {}
    for key, name in STEPS.items():
        rec = load(out / f"{name}.json")
        if key not in wanted:
            steps[name] = {"ran": False, "ok": None, "why": "not in GPU_CHECK_STEPS"}
            continue
        if rec is None:
            rec = {"step": name, "ok": False, "error": "no result file"}
        missing = [k for k in STEP_KEYS if k not in rec]
        steps[name] = {"ran": True, "ok": bool(rec.get("ok")) and not missing, "title": rec.get("title"),
                       "seconds": rec.get("seconds"), "error": rec.get("error"),
                       "checks_passed": sum(1 for c in rec.get("checks", []) if c.get("ok")),
                       "checks_total": len(rec.get("checks", [])),
                       "failed_checks": [f"{c['name']}: {c.get('detail', '')}"[:400]
                                         for c in rec.get("checks", []) if not c.get("ok")],
                       "lines": rec.get("lines", []), "missing_keys": missing}
    ok = setup_ok and all(s["ok"] for s in steps.values() if s["ran"])
    t0 = float(os.environ.get("GPU_CHECK_T0", "0") or 0)
    total = round(time.time() - t0, 1) if t0 else None
    summary = {"ok": ok, "dry": dry(), "total_seconds": total, "setup_status": status, "setup": setup,
               "steps": {k: {kk: vv for kk, vv in v.items() if kk != "lines"} for k, v in steps.items()}}
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str) + "\n")

    gpu = setup.get("gpu", {})
    text = [f"GPU check: {'PASSED' if ok else 'FAILED'}{' (dry run on the CPU)' if dry() else ''}"
            + (f", {total:.0f} s" if total is not None else ""),
            f"machine: {gpu.get('name', 'no CUDA device')}; driver / nvidia-smi: {setup.get('nvidia_smi', '-')}; "
            f"{setup.get('cpus', '?')} CPUs",
            f"python {setup.get('python_version', '?')} ({setup.get('how', '?')}); torch "
            f"{setup.get('packages', {}).get('torch', '?')} (CUDA build {setup.get('torch_cuda_build')}); transformers "
            f"{setup.get('packages', {}).get('transformers', '?')}",
            f"set-up: {status}", ""]
    for name, s in steps.items():
        if not s["ran"]:
            text.append(f"## {name}: not run ({s['why']})")
            continue
        secs = f"{s['seconds']:.0f} s" if isinstance(s.get("seconds"), (int, float)) else "?"
        text.append(f"## {name}: {'ok' if s['ok'] else 'FAILED'} ({s['checks_passed']}/{s['checks_total']} checks, "
                    f"{secs}) - {s.get('title') or ''}")
        if s.get("error"):
            text.append(f"   error: {s['error']}")
        text += [f"   {line}" for line in s["lines"] if not line.startswith(("== ", "[FAIL] step error: "))]
        text.append("")
    (out / "summary.txt").write_text("\n".join(text) + "\n")

    with open(out / "logs.txt", "w") as f:
        for log in ["setup.log", *[f"{n}.log" for n in STEPS.values()]]:
            p = work / log
            if p.is_file():
                body = p.read_text(errors="replace")
                cut = len(body) > LOG_CHARS
                f.write(f"==================== {log}{' (last part)' if cut else ''}\n{body[-LOG_CHARS:]}\n")
    print("\n".join(text))
    return 0 if ok else 1


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: summary.py WORKDIR")
    raise SystemExit(main(Path(sys.argv[1])))
