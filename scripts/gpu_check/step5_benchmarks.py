"""Step 5: the benchmark rows that take a device, and level masks of 1e8 and 1e9 weights.

1. Level mask (core ``level_mask`` through ``compressor.torch.ops``, 70 % sparsity) of a float32 weight of 1e8
   and 1e9 entries on the device: median of 3 timed calls (CUDA events) after one warm-up, and the number
   pruned must be ``floor(0.7 n)``. Goal: 1e9 under ``GPU_CHECK_LEVEL_GOAL_S`` (default 1 s) on an H200-class GPU.
   In a subprocess limited to ``GPU_CHECK_LEVEL_LIMIT_S`` (default 45 s), so that it cannot take the suite's time.
2. ``python -m benchmarks --device cuda --only torch_prune torch_quant torch_semi_structured memory`` (the
   suite's rows that run on a device: mask overhead of a train / inference step vs dense and
   ``torch.nn.utils.prune``, level mask vs NNI's rule, QAT step vs dense and torch.ao, 2:4 vs dense fp16, mask
   memory), in the time left; its markdown is kept in the step's file and the rows are parsed into numbers.
   ``GPU_CHECK_BENCH_ARGS`` adds arguments (e.g. ``--quick``), ``GPU_CHECK_BENCH_PARTS`` replaces the parts.

Dry run: weights of 1e5 and 1e6 entries on the CPU (no goal), ``python -m benchmarks --device cpu --quick
--only memory``, and one small round of ``benchmarks/torch_prune.py``'s model table and of
``benchmarks/torch_quant.py`` in this process (their full runs take minutes on a CPU), so every parser runs.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import ROOT, Step, dry, env_float, median, run_step, short_error, sync, time_calls  # noqa: E402

SPARSITY = 0.7
PRUNE_ROW = re.compile(r"^(\S+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+-[\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+-[\d.]+)\s*$")
PRUNE_MODEL = re.compile(r"^(\S+), batch (\S+), (\d+)% sparsity")
LEVEL_ROW = re.compile(r"^(ours \(kthvalue\)|NNI topk rule)\s+([\d.]+) ms\s+([\d.]+)x")
QUANT_ROW = re.compile(r"^\s+(.+?)\s+([\d.]+) ms/step\s+x([\d.]+) dense")


# ------------------------------------------------------------------------------------------ level masks
def level_masks(step: Step, device: torch.device) -> None:
    from compressor.core.pruning import level_mask
    from compressor.torch.ops import ops

    shapes = {"1e5": (1000, 100), "1e6": (1000, 1000)} if dry() else {"1e8": (10_000, 10_000),
                                                                      "1e9": (100_000, 10_000)}
    goal = env_float("GPU_CHECK_LEVEL_GOAL_S", 1.0)
    rows: dict[str, Any] = {}
    for label, shape in shapes.items():
        with step.guard(f"level mask of {label} weights on {device.type}"):
            g = torch.Generator(device=device).manual_seed(0)
            w = torch.randn(*shape, device=device, generator=g)
            n = w.numel()
            sync(device)
            first = time_calls(lambda w=w: level_mask(ops, w, SPARSITY), device, 1)
            times = [time_calls(lambda w=w: level_mask(ops, w, SPARSITY), device, 1) for _ in range(3)]
            mask = level_mask(ops, w, SPARSITY)
            pruned = int((~mask).sum())
            want = int(n * SPARSITY)
            peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
            rows[label] = {"numel": n, "first_call_s": round(first, 4), "median_s": round(median(times), 4),
                           "times_s": [round(t, 4) for t in times], "pruned": pruned, "expected": want,
                           "peak_gib": round(peak, 2) if peak is not None else None}
            step.check(f"level mask of {label} weights prunes floor({SPARSITY} n)", pruned == want,
                       f"{pruned} of {n} (want {want}); median {median(times) * 1e3:.1f} ms, first call "
                       f"{first * 1e3:.1f} ms" + (f", peak {peak:.1f} GiB" if peak is not None else ""))
            if label == "1e9":
                step.check(f"level mask of 1e9 weights under {goal:g} s", median(times) < goal,
                           f"{median(times):.3f} s")
            del w, mask
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    step.results["level_mask"] = rows


# ------------------------------------------------------------------------------------------ the suite
def parse(text: str) -> dict[str, Any]:
    """Numbers out of the suite's markdown / a script's output (what is not found is simply absent)."""
    out: dict[str, Any] = {"mask_overhead": {}, "level_mask_4096": {}, "qat_step": {}, "memory": []}
    model = None
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = PRUNE_MODEL.match(line)
        if m:
            model = m.group(1)
            continue
        m = PRUNE_ROW.match(line)
        if m and model:
            out["mask_overhead"].setdefault(model, {})[m.group(1)] = {
                "train_ms": float(m.group(2)), "train_vs_dense": float(m.group(3)),
                "infer_ms": float(m.group(5)), "infer_vs_dense": float(m.group(6))}
            continue
        m = LEVEL_ROW.match(line)
        if m:
            out["level_mask_4096"][m.group(1)] = {"ms": float(m.group(2)), "vs_ours": float(m.group(3))}
            continue
        m = QUANT_ROW.match(line)
        if m:
            out["qat_step"][m.group(1).strip()] = {"ms": float(m.group(2)), "vs_dense": float(m.group(3))}
            continue
        if section.startswith("Mask memory") and line.startswith("| torch"):
            out["memory"].append([c.strip() for c in line.strip("|").split("|")])
        elif section == "torch_semi_structured" and line.startswith("| ") and "---" not in line:
            out.setdefault("semi_structured", []).append([c.strip() for c in line.strip("|").split("|")])
    return out


def run(cmd: list[str], limit: float) -> tuple[int | None, str, float]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    t0 = time.perf_counter()
    try:
        out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
        return out.returncode, out.stdout + ("\n" + out.stderr[-3000:] if out.returncode else ""), time.perf_counter() - t0
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return None, text, time.perf_counter() - t0


def suite(step: Step, device: torch.device, deadline: float) -> None:
    default_parts = "memory" if dry() else "torch_prune torch_quant torch_semi_structured memory"
    parts = shlex.split(os.environ.get("GPU_CHECK_BENCH_PARTS", default_parts))
    extra = shlex.split(os.environ.get("GPU_CHECK_BENCH_ARGS", "--quick" if dry() else ""))
    with tempfile.TemporaryDirectory() as tmp:
        md = Path(tmp) / "bench.md"
        left = deadline - time.perf_counter()
        cmd = [sys.executable, "-m", "benchmarks", "--device", str(device), "--only", *parts, *extra,
               "--timeout", str(int(max(10, left - 5))), "--out", str(md)]
        step.say(f"$ {' '.join(shlex.quote(c) for c in cmd)}  (limit {left:.0f} s)")
        rc, text, seconds = run(cmd, max(10.0, left))
        markdown = md.read_text() if md.is_file() else text
    step.results["suite"] = {"command": cmd[1:], "exit_status": rc, "seconds": round(seconds, 1),
                             "markdown": markdown[-20000:]}
    rows = parse(markdown)
    if dry():  # the suite's torch_prune / torch_quant take minutes on a CPU: one small round of each, in process
        import contextlib
        import io

        sys.path.insert(0, str(ROOT))
        from benchmarks import torch_quant
        from benchmarks.torch_prune import MODELS, bench_model

        buf = io.StringIO()
        with step.guard("benchmarks.torch_prune / torch_quant (one small round) run"), contextlib.redirect_stdout(buf):
            for name in MODELS:
                bench_model(name, device, 1, 1)
            argv, sys.argv = sys.argv, ["torch_quant.py", "--rounds", "1", "--batch", "4", "--threads", "1"]
            try:
                torch_quant.main()
            finally:
                sys.argv = argv
        for k, v in parse(buf.getvalue()).items():
            if v and not rows.get(k):
                rows[k] = v
    step.results["rows"] = rows
    failed = [line for line in markdown.splitlines() if re.search(r" - (failed|timeout)", line)]
    step.check(f"python -m benchmarks --device {device} finished", rc == 0,
               f"{seconds:.0f} s" if rc == 0 else (f"exit {rc}: {failed or text[-400:]}" if rc is not None
                                                   else f"killed after {seconds:.0f} s"))
    expected = {"mask_overhead": "torch_prune", "level_mask_4096": "torch_prune", "qat_step": "torch_quant",
                "semi_structured": "torch_semi_structured", "memory": "memory"}
    ran = set(parts) | ({"torch_prune", "torch_quant"} if dry() else set())
    want = [k for k, part in expected.items() if part in ran and not (dry() and k == "level_mask_4096")]
    missing = [k for k in want if not rows.get(k)]
    step.check("rows parsed: " + ", ".join(want), not missing, f"missing {missing}" if missing else "")
    for model, variants in rows.get("mask_overhead", {}).items():
        step.say(f"{model}: " + ", ".join(f"{k} train x{v['train_vs_dense']:.2f} infer x{v['infer_vs_dense']:.2f}"
                                          for k, v in variants.items()))
    if rows.get("qat_step"):
        step.say("QAT step: " + ", ".join(f"{k} {v['ms']:.2f} ms (x{v['vs_dense']:.2f})"
                                          for k, v in rows["qat_step"].items()))


def level_part(step: Step, limit: float) -> None:
    """The level masks in a subprocess with its own time limit: a pathological selection on 1e9 weights cannot
    take the suite's time."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "level.json"
        rc, text, seconds = run([sys.executable, __file__, "level", str(path)], limit)
        print(text, flush=True)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = {}
    if rc is None:
        record["error"] = f"killed after {seconds:.0f} s (GPU_CHECK_LEVEL_LIMIT_S)"
    elif rc != 0 and not record.get("checks"):
        record["error"] = f"exit status {rc}: {text.strip()[-300:]}"
    step.merge(record)


def body(step: Step) -> None:
    device = torch.device(step.device)
    deadline = time.perf_counter() + env_float("GPU_CHECK_LIMIT_S", 120.0) - 10.0
    level_part(step, env_float("GPU_CHECK_LEVEL_LIMIT_S", 45.0))
    suite(step, device, deadline)


def level_main(path: str) -> int:
    part = Step("step5_level", "level masks")
    part.path = Path(path)
    try:
        level_masks(part, torch.device(part.device))
    except Exception as e:  # noqa: BLE001 - recorded
        part.error = short_error(e)
    part.write()
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "level":
        raise SystemExit(level_main(sys.argv[2]))
    raise SystemExit(run_step("step5_benchmarks", "benchmark rows on the device; level masks of 1e8 / 1e9 weights",
                              body))
