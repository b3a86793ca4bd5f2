"""Shared pieces of the GPU check steps: settings from the environment, the step record written as JSON, timing.

Only the standard library is imported at module level, so ``python scripts/gpu_check/common.py stub ...`` (used
by ``scripts/gpu_check.sh`` when a step died before writing its file) runs with any Python.

Environment (all optional):

* ``OUT``: folder of the JSON files and the readable summary (default ``./gpu-check-out``);
* ``GPU_CHECK_DRY=1``: the CPU dry run (tiny sizes, device ``cpu``);
* ``GPU_CHECK_DEVICE``: the device of a real run (default ``cuda``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STEPS = {
    "1": "step1_cuda_tests",
    "2": "step2_no_sync",
    "3": "step3_oneshot",
    "4": "step4_kernels",
    "5": "step5_benchmarks",
}
#: keys every step file has (the test of the dry run checks them)
STEP_KEYS = ("step", "title", "ok", "dry", "device", "seconds", "checks", "results", "lines", "error")


def out_dir() -> Path:
    d = Path(os.environ.get("OUT") or "gpu-check-out")
    d.mkdir(parents=True, exist_ok=True)
    return d


def dry() -> bool:
    return os.environ.get("GPU_CHECK_DRY", "").lower() in ("1", "true", "yes")


def env_float(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    return float(raw) if raw.strip() else default


def env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    return int(raw) if raw.strip() else default


def short_error(e: BaseException, frames: int = 6) -> str:
    """The exception and the last ``frames`` frames of its traceback (where a sync was asked for, say)."""
    tb = traceback.extract_tb(e.__traceback__)[-frames:]
    where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(tb))
    text = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return f"{text} [at {where}]" if where else text


class Step:
    """One step's record: named checks (each passes or fails), free-form results and readable lines; written to
    ``$OUT/<name>.json`` by :meth:`write`, also when the step's body raised (then ``ok`` is false)."""

    def __init__(self, name: str, title: str) -> None:
        self.name, self.title = name, title
        self.t0 = time.perf_counter()
        self.checks: list[dict[str, Any]] = []
        self.results: dict[str, Any] = {}
        self.lines: list[str] = []
        self.error: str | None = None
        self.device = "cpu" if dry() else os.environ.get("GPU_CHECK_DEVICE", "cuda")
        self.path: Path | None = None  # where write() writes; default $OUT/<name>.json

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        mark = "ok  " if ok else "FAIL"
        self.say(f"[{mark}] {name}" + (f": {detail}" if detail not in ("", None) else ""))
        self.write()  # a step killed at its time limit still leaves what it had checked
        return bool(ok)

    def say(self, line: str) -> None:
        self.lines.append(line)
        print(line, flush=True)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.checks) and all(c["ok"] for c in self.checks)

    def record(self) -> dict[str, Any]:
        return {"step": self.name, "title": self.title, "ok": self.ok, "dry": dry(), "device": self.device,
                "seconds": round(time.perf_counter() - self.t0, 2), "checks": self.checks, "results": self.results,
                "lines": self.lines, "error": self.error}

    def write(self) -> Path:
        path = self.path or out_dir() / f"{self.name}.json"
        path.write_text(json.dumps(self.record(), indent=1, default=str) + "\n")
        return path

    def merge(self, record: dict[str, Any], prefix: str = "") -> None:
        """Take over the checks, results and lines of another step's record (a part run in a subprocess)."""
        self.results.update(record.get("results", {}))
        self.lines += [prefix + line for line in record.get("lines", [])]
        self.checks += record.get("checks", [])
        if record.get("error"):
            self.checks.append({"name": f"{prefix}part finished", "ok": False, "detail": record["error"]})
        self.write()

    def guard(self, what: str) -> _Guard:
        """``with step.guard('name'):`` a failure inside is a failed check named ``what`` and the step goes on."""
        return _Guard(self, what)


class _Guard:
    def __init__(self, step: Step, what: str) -> None:
        self.step, self.what = step, what

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, et: Any, e: BaseException | None, tb: Any) -> bool:
        if e is None or not isinstance(e, Exception):
            return False
        self.step.check(self.what, False, short_error(e))
        return True


def run_step(name: str, title: str, body: Callable[[Step], None]) -> int:
    """Run ``body(step)``, write the step's file whatever happens; exit status 0 when every check passed."""
    step = Step(name, title)
    step.say(f"== {name}: {title} ({'dry run, ' if dry() else ''}device {step.device})")
    try:
        if not dry() and step.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise RuntimeError(f"no CUDA device visible to torch {torch.__version__} "
                                   f"(CUDA build: {torch.version.cuda}); nothing on the GPU can be checked")
        body(step)
    except Exception as e:  # noqa: BLE001 - written into the step's file, the script goes on with the next step
        step.error = short_error(e, frames=10)
        step.say(f"[FAIL] step error: {step.error}")
    path = step.write()
    step.say(f"== {name}: {'ok' if step.ok else 'FAILED'} in {step.record()['seconds']:.1f} s -> {path}")
    return 0 if step.ok else 1


# ------------------------------------------------------------------------------------------ timing
def sync(device: Any) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def no_host_sync(device: Any) -> Iterator[None]:
    """On CUDA: any host-device synchronisation inside the block raises (torch's sync debug mode). On the CPU it
    only runs the block (there is no host / device boundary to cross)."""
    import torch

    if torch.device(device).type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def time_calls(fn: Callable[[], Any], device: Any, calls: int) -> float:
    """Seconds per call of ``fn``, ``calls`` calls back to back: CUDA events on a GPU, the wall clock on the CPU."""
    import torch

    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / calls
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


# ------------------------------------------------------------------------------------------ stub files
def write_stub(name: str, rc: int, limit: str, log: str) -> None:
    """The step's file when its process wrote none, or exited non-zero after writing one that says ok."""
    path = out_dir() / f"{name}.json"
    tail = ""
    try:
        tail = "\n".join(Path(log).read_text(errors="replace").splitlines()[-30:])
    except OSError:
        pass
    why = (f"timed out after {limit} s (GPU_CHECK_T{name[4]})" if rc in (124, 137)
           else f"exited with status {rc} without a result")
    record: dict[str, Any] = {}
    if path.is_file():
        try:
            record = json.loads(path.read_text())
        except ValueError:
            record = {}
    if record and rc == 1 and record.get("ok") is False:
        return  # the step finished and wrote its own failing record: keep it
    if record:  # a partial record (the step was killed) or one that says ok with a failing exit status
        record["ok"] = False
        record["error"] = "; ".join(e for e in (record.get("error"), f"{why} (the record holds what it had done)")
                                    if e)
    else:
        record = {"step": name, "title": name, "ok": False, "dry": dry(), "device": "?", "seconds": None,
                  "checks": [], "results": {}, "lines": [], "error": why}
    record["log_tail"] = tail
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")


if __name__ == "__main__":
    if len(sys.argv) == 6 and sys.argv[1] == "stub":
        write_stub(sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5])
    else:
        sys.exit("usage: common.py stub NAME RC LIMIT_S LOGFILE")
