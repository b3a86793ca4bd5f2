"""The benchmark suite: every side-by-side measurement in one run, written to ``benchmarks/RESULTS.md``.

    python -m benchmarks [--device cuda] [--quick] [--only torch_prune tf_prune ...] [--out PATH]

It runs, each in its own process so frameworks and thread settings do not leak between them:

* the per-backend scripts ``benchmarks/torch_prune.py`` (mask overhead of a train step and of inference
  vs dense and ``torch.nn.utils.prune``; level-mask time vs the NNI rule), ``torch_quant.py`` (QAT step
  vs torch.ao FakeQuantize), ``tf_prune.py`` (Keras ``fit`` step pruned vs dense, tfmot when installable)
  and ``tf_quant.py``; each interleaves its variants and prints its own table, which is copied verbatim;
  ``--device`` is passed to the scripts that accept it, ``--quick`` passes fewer rounds;
* import time of ``compressor.torch`` / ``compressor.tf`` against ``import torch`` / ``import
  tensorflow`` alone (fresh interpreters, interleaved, median with min/max);
* ``oneshot_llm.py``: one-shot compression (SparseGPT, Wanda, GPTQ, AWQ, RTN) of the trained byte-level
  Llama, wall time and peak memory vs llmcompressor 0.14 (in its own venv, skipped when absent);
* mask memory: bytes of our bool masks vs the weights, vs float32 masks (NNI's) and vs
  ``torch.nn.utils.prune`` (which keeps ``weight_orig`` and a float mask per weight), measured on the
  state_dict / the mask variables of a pruned model on each backend.

A missing framework or script is reported as skipped, not as a failure. Ratios are against a baseline
measured in the same run, never absolute targets.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SCRIPTS: dict[str, str] = {  # script -> framework it needs
    "torch_prune": "torch",
    "torch_quant": "torch",
    "torch_speedup": "torch",
    "torch_quant_onnx": "torch",
    "torch_int8_latency": "torch",
    "tf_prune": "tensorflow",
    "tf_quant": "tensorflow",
    "tf_speedup": "tensorflow",
    "tf_int8_latency": "tensorflow",
    "lowbit_tf": "tensorflow",
    "torch_semi_structured": "torch",
    "torch_compile": "torch",
    "lowbit_torch": "torch",
    "packing": "numpy",
    "oneshot_llm": "torch",
}
#: scripts that measure something only a CUDA GPU has: skipped unless --device cuda
CUDA_ONLY = {"torch_semi_structured"}
ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": "0", "PYTHONHASHSEED": "0"}


@dataclass
class Stat:
    """One measured quantity: samples -> median / min / max, optionally relative to a baseline."""

    name: str
    samples: list[float]
    unit: str
    baseline: Stat | None = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    def cells(self, scale: float = 1.0, digits: int = 1) -> list[str]:
        ratio = f"{self.median / self.baseline.median:.2f}x" if self.baseline else "-"
        return [self.name, f"{self.median * scale:.{digits}f}", f"{min(self.samples) * scale:.{digits}f}",
                f"{max(self.samples) * scale:.{digits}f}", self.unit, ratio, self.note]


@dataclass
class ScriptRun:
    name: str
    command: list[str]
    status: str  # 'ok', 'failed (rc N)', 'skipped: why', 'timeout'
    seconds: float = 0.0
    output: str = ""


@dataclass
class Report:
    machine: dict[str, str]
    args: dict[str, object]
    scripts: list[ScriptRun] = field(default_factory=list)
    imports: list[Stat] = field(default_factory=list)
    memory: list[list[str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------ machine
def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _mem_gib() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "?"


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    code = f"import {module} as m; print(m.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **ENV})
    return out.stdout.strip() or "?"


def machine(device: str) -> dict[str, str]:
    """What the numbers were measured on."""
    info = {
        "cpu": _cpu_model(),
        "cores (os.cpu_count)": str(os.cpu_count()),
        "affinity (usable cores)": str(len(os.sched_getaffinity(0))) if hasattr(os, "sched_getaffinity") else "?",
        "memory": _mem_gib(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "torch": _version("torch"),
        "tensorflow": _version("tensorflow"),
        "keras": _version("keras"),
        "device": device,
        "load average at start": " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "?",
    }
    if device.startswith("cuda") and importlib.util.find_spec("torch") is not None:
        code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no CUDA device')"
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        info["gpu"] = out.stdout.strip() or out.stderr.strip()[-200:]
    return info


# ------------------------------------------------------------------------------------------ scripts
def run_script(name: str, device: str, quick: bool, timeout: float) -> ScriptRun:
    """Run ``benchmarks/<name>.py`` in a fresh interpreter and capture its table."""
    path = HERE / f"{name}.py"
    framework = SCRIPTS.get(name)
    if not path.is_file():
        return ScriptRun(name, [], "skipped: script not written yet")
    if framework and importlib.util.find_spec(framework) is None:
        return ScriptRun(name, [], f"skipped: {framework} not installed")
    if name in CUDA_ONLY and not device.startswith("cuda"):
        return ScriptRun(name, [], "skipped: runs only with --device cuda")
    source = path.read_text()
    cmd = [sys.executable, str(path.relative_to(ROOT))]
    note = ""
    if "--device" in source:
        cmd += ["--device", device]
    elif device != "cpu":
        note = f" (no --device option: ran on {framework}'s default device, not necessarily {device})"
    if quick and "--rounds" in source:
        cmd += ["--rounds", "3"]
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout,
                             env={**os.environ, **ENV, "PYTHONPATH": str(ROOT)})
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return ScriptRun(name, cmd, f"timeout after {timeout:.0f} s{note}", time.perf_counter() - t0, text)
    seconds = time.perf_counter() - t0
    if out.returncode != 0:
        tail = "\n".join(out.stderr.strip().splitlines()[-15:])
        return ScriptRun(name, cmd, f"failed (rc {out.returncode}){note}", seconds, (out.stdout + "\n" + tail).strip())
    return ScriptRun(name, cmd, f"ok{note}", seconds, out.stdout.strip())


# ------------------------------------------------------------------------------------------ import time
_IMPORT_CODE = "import time; t = time.perf_counter(); import {mod}; print(time.perf_counter() - t)"


def _import_seconds(module: str) -> float:
    out = subprocess.run([sys.executable, "-c", _IMPORT_CODE.format(mod=module)], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, **ENV}, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"import {module} failed: {out.stderr.strip()[-300:]}")
    return float(out.stdout.strip().splitlines()[-1])


def import_times(reps: int) -> list[Stat]:
    """Wall time of importing each backend vs its framework alone, fresh interpreters, interleaved."""
    pairs = [("compressor", None)]
    if importlib.util.find_spec("torch") is not None:
        pairs.append(("compressor.torch", "torch"))
    if importlib.util.find_spec("tensorflow") is not None:
        pairs.append(("compressor.tf", "tensorflow"))
    samples: dict[str, list[float]] = {m: [] for pair in pairs for m in pair if m}
    for _ in range(reps):
        for pair in pairs:
            for m in pair:
                if m:
                    samples[m].append(_import_seconds(m))
    stats = []
    for ours, framework in pairs:
        base = Stat(f"import {framework}", samples[framework], "ms") if framework else None
        if base is not None:
            stats.append(base)
        note = "core only: numpy, yaml, pluggy" if framework is None else f"includes import {framework}"
        stats.append(Stat(f"import {ours}", samples[ours], "ms", base, note))
    return stats


# ------------------------------------------------------------------------------------------ mask memory
_TORCH_MEMORY = r"""
import copy, io, json, sys, torch
from torch import nn
import torch.nn.utils.prune as tprune
from compressor.torch import LevelPruner
dev = torch.device(sys.argv[1])
torch.manual_seed(0)
def build():
    return nn.Sequential(nn.Conv2d(3, 32, 3), nn.ReLU(), nn.Conv2d(32, 64, 3), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Flatten(), nn.Linear(64 * 14 * 14, 128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
def sd_bytes(m):
    return sum(t.numel() * t.element_size() for t in m.state_dict().values())
def file_bytes(m):
    b = io.BytesIO(); torch.save(m.state_dict(), b); return b.tell()
dense = build()
weights = sum(m.weight.numel() for m in dense.modules() if isinstance(m, (nn.Conv2d, nn.Linear)))
if dev.type == "cuda":
    torch.cuda.synchronize(); before = torch.cuda.memory_allocated()
ours = copy.deepcopy(dense)
before_ours = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
opt = torch.optim.SGD(ours.parameters(), lr=0.0)
pruner = LevelPruner(ours, [{"sparsity": 0.7, "op_types": ["default"]}], opt)
ours = pruner.compress()
gpu_ours = torch.cuda.memory_allocated() - before_ours if dev.type == "cuda" else None
ours(torch.zeros(1, 3, 32, 32, device=dev)).sum().backward()
opt.step()  # the first re-mask after a step builds the runtime multiplier cache where it is used
opt.zero_grad()
cache = sum(e[1].numel() * e[1].element_size() for w in pruner.get_modules_wrapper() for e in w._mul_cache
            if e is not None)
tp = copy.deepcopy(dense)
before_tp = torch.cuda.memory_allocated() if dev.type == "cuda" else 0
for m in tp.modules():
    if isinstance(m, (nn.Conv2d, nn.Linear)):
        tprune.l1_unstructured(m, "weight", amount=0.7)
gpu_tp = torch.cuda.memory_allocated() - before_tp if dev.type == "cuda" else None
print(json.dumps({"weights": weights, "dense_sd": sd_bytes(dense), "ours_sd": sd_bytes(ours),
                  "tp_sd": sd_bytes(tp), "dense_file": file_bytes(dense), "ours_file": file_bytes(ours),
                  "tp_file": file_bytes(tp), "gpu_ours": gpu_ours, "gpu_tp": gpu_tp, "cache": cache}))
"""

_TF_MEMORY = r"""
import json, numpy as np, keras, tensorflow as tf
from compressor.tf import LevelPruner
keras.utils.set_random_seed(0)
L = keras.layers
m = keras.Sequential([keras.Input((32, 32, 3)), L.Conv2D(32, 3), L.ReLU(), L.Conv2D(64, 3), L.ReLU(),
                      L.MaxPooling2D(2), L.Flatten(), L.Dense(128), L.ReLU(), L.Dense(10)])
weights = sum(int(np.prod(l.kernel.shape)) for l in m.layers if hasattr(l, "kernel"))
dense_bytes = sum(int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size for v in m.weights)
pruner = LevelPruner(m, [{"sparsity": 0.7, "op_types": ["default"]}])
pruner.compress()
mask_bytes = 0
for w in pruner.get_modules_wrapper():
    for name in ("weight_mask", "bias_mask"):
        v = getattr(w, name, None)
        if v is not None:
            mask_bytes += int(np.prod(v.shape)) * tf.as_dtype(v.dtype).size
print(json.dumps({"weights": weights, "dense": dense_bytes, "masks": mask_bytes}))
"""


def _run_json(code: str, args: Sequence[str] = ()) -> dict:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=ROOT,
                         env={**os.environ, **ENV, "PYTHONPATH": str(ROOT)}, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-500:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def _kb(n: float) -> str:
    return f"{n / 1024:,.1f} KiB"


def mask_memory(device: str) -> tuple[list[list[str]], list[str]]:
    """Rows: backend, what, bytes, relative to the weights; plus notes for what could not run."""
    rows: list[list[str]] = []
    notes: list[str] = []
    if importlib.util.find_spec("torch") is not None:
        try:
            r = _run_json(_TORCH_MEMORY, [device])
            w4 = 4 * r["weights"]
            rows += [
                ["torch", "weights (float32) of the pruned layers", _kb(w4), "1.00x"],
                ["torch", "ours: bool masks (state_dict growth)", _kb(r["ours_sd"] - r["dense_sd"]),
                 f"{(r['ours_sd'] - r['dense_sd']) / w4:.2f}x"],
                ["torch", f"ours: runtime multiplier cache after a step on {device} (not saved; CPU only by "
                 f"default, `multiplier_cache=False` drops it)", _kb(r["cache"]), f"{r['cache'] / w4:.2f}x"],
                ["torch", "NNI-style float32 masks (computed: 4 B per weight)", _kb(w4), "1.00x"],
                ["torch", "torch.nn.utils.prune: weight_orig + float mask (state_dict growth)",
                 _kb(r["tp_sd"] - r["dense_sd"]), f"{(r['tp_sd'] - r['dense_sd']) / w4:.2f}x"],
                ["torch", "checkpoint file: dense / ours / torch.nn.utils.prune",
                 f"{_kb(r['dense_file'])} / {_kb(r['ours_file'])} / {_kb(r['tp_file'])}",
                 f"1.00x / {r['ours_file'] / r['dense_file']:.2f}x / {r['tp_file'] / r['dense_file']:.2f}x"],
            ]
            if r.get("gpu_ours") is not None:
                rows.append(["torch", f"{device} memory allocated by wrapping: ours / torch.nn.utils.prune",
                             f"{_kb(r['gpu_ours'])} / {_kb(r['gpu_tp'])}",
                             f"{r['gpu_ours'] / w4:.2f}x / {r['gpu_tp'] / w4:.2f}x"])
        except Exception as e:  # noqa: BLE001 - reported, the suite goes on
            notes.append(f"torch mask memory failed: {str(e).splitlines()[-1] if str(e) else e!r}")
    if importlib.util.find_spec("tensorflow") is not None:
        try:
            r = _run_json(_TF_MEMORY)
            w4 = 4 * r["weights"]
            rows += [
                ["tf", "weights (float32) of the pruned layers", _kb(w4), "1.00x"],
                ["tf", "ours: bool mask variables", _kb(r["masks"]), f"{r['masks'] / w4:.2f}x"],
                ["tf", "tfmot-style float32 mask variable per weight (computed)", _kb(w4), "1.00x"],
            ]
        except Exception as e:  # noqa: BLE001
            notes.append(f"tf mask memory failed: {str(e).splitlines()[-1] if str(e) else e!r}")
    return rows, notes


# ------------------------------------------------------------------------------------------ report
def _md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def render(report: Report) -> str:
    out = ["# Benchmark results", "",
           f"Generated by `{' '.join(['python -m benchmarks', *report.args.get('argv', [])])}` on "
           f"{_dt.datetime.now():%Y-%m-%d %H:%M}.",
           "All ratios are against a baseline measured in the same run (interleaved rounds, medians); "
           "timings on a shared machine vary, compare ratios, not absolute times.", "",
           "## Machine", "", _md_table(["", ""], [[k, v] for k, v in report.machine.items()]), ""]
    for s in report.scripts:
        out += [f"## {s.name}", ""]
        if s.command:
            out.append(f"`{' '.join(Path(c).name if c == sys.executable else c for c in s.command)}` "
                       f"- {s.status}, {s.seconds:.0f} s")
        else:
            out.append(s.status)
        if s.output:
            out += ["", "```", s.output, "```"]
        out.append("")
    if report.imports:
        out += ["## Import time (fresh interpreter each, interleaved)", "",
                _md_table(["import", "median", "min", "max", "unit", "vs framework alone", "note"],
                          [s.cells(scale=1e3, digits=0) for s in report.imports]), ""]
    if report.memory:
        out += ["## Mask memory (CNN for 32x32x3 inputs: 2 conv + 2 dense layers, 1.6 M weights, LevelPruner 70 %)", "",
                _md_table(["backend", "what", "bytes", "vs float32 weights"], report.memory), ""]
    if report.notes:
        out += ["## Notes", ""] + [f"- {n}" for n in report.notes] + [""]
    return "\n".join(out)


def check_device(parser: argparse.ArgumentParser, device: str) -> None:
    """Refuse ``--device`` values no script can run on, before anything is measured."""
    if device == "cpu":
        return
    if not re.fullmatch(r"cuda(:[0-9]+)?", device):
        parser.error(f"--device {device!r}: allowed: cpu, cuda, cuda:N")
    if importlib.util.find_spec("torch") is None:
        parser.error(f"--device {device}: the CUDA runs are PyTorch's and torch is not installed")
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    count = int(out.stdout.strip() or 0)
    index = int(device.partition(":")[2] or 0)
    if index >= count:
        parser.error(f"--device {device}: torch sees {count} CUDA device(s) on this machine; run without --device "
                     f"(CPU)")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda; passed to the scripts that take it")
    p.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run; numbers are noisier)")
    p.add_argument("--only", nargs="+", metavar="NAME",
                   help=f"run only these parts: {', '.join([*SCRIPTS, 'imports', 'memory'])}")
    p.add_argument("--import-reps", type=int, default=5)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per script")
    p.add_argument("--out", default=str(HERE / "RESULTS.md"), help="markdown file to write ('-' = stdout only)")
    args = p.parse_args(argv)
    parts = args.only or [*SCRIPTS, "imports", "memory"]
    unknown = [x for x in parts if x not in SCRIPTS and x not in ("imports", "memory")]
    if unknown:
        p.error(f"unknown part(s) {unknown}")

    check_device(p, args.device)

    report = Report(machine(args.device), {"argv": argv})
    for name in SCRIPTS:
        if name in parts:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            report.scripts.append(run_script(name, args.device, args.quick, args.timeout))
            print(f"  {report.scripts[-1].status}", file=sys.stderr, flush=True)
    if "imports" in parts:
        print("measuring import times ...", file=sys.stderr, flush=True)
        report.imports = import_times(2 if args.quick else args.import_reps)
    if "memory" in parts:
        print("measuring mask memory ...", file=sys.stderr, flush=True)
        report.memory, notes = mask_memory(args.device)
        report.notes += notes
    text = render(report)
    if args.out != "-":
        Path(args.out).write_text(text + "\n")
        print(f"wrote {args.out}", file=sys.stderr)
    print(text)
    failed = [s.name for s in report.scripts if s.status.startswith(("failed", "timeout"))]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
