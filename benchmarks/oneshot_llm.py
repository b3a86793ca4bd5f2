"""One-shot compression cost (issue 25): wall time and peak memory of ours vs llmcompressor 0.14.

For each method (SparseGPT 50 %, Wanda 50 %, GPTQ w4 g128, AWQ w4 g128, RTN w4 g128) on

* ``trained``: the byte-level Llama of examples/llm_common.py (4 layers, width 256, FFN 768, 3.5 M
  parameters), its trained weights from ``--weights`` (default ``$COMPRESSOR_LLM_WEIGHTS``, else
  ``llama-bytes-seed0-steps260.pt`` in ``$COMPRESSOR_LLM_CACHE`` or ``out/llm`` under the repository root, where
  ``python -m examples.reproduce_llm`` caches it; never retrained here), and
* ``large`` (``--models trained,large``): a random-weight Llama about 10x larger (10 layers, width 512,
  FFN 1536, 8 heads, 34 M parameters),

with the same 128 calibration windows of 256 bytes (examples/llm_common.calibration_windows, seed 0; a
random model gets the same bytes), the decoder's Linear layers compressed and ``lm_head`` left out, each
run happens in a FRESH interpreter with one intra-op thread (``torch.set_num_threads(1)``) on both sides:

* ``ours``: ``compressor.torch`` (``WandaPruner`` / ``SparseGPTPruner`` / ``GptqQuantizer`` /
  ``AwqQuantizer`` / ``RtnQuantizer``), calibration data as 128 batches of one window (``--batch N``
  for batches of N);
* ``llmcompressor``: ``llmcompressor.oneshot`` with the matching modifier, in its own environment
  (``--llmc-python``, default ``$LLMCOMPRESSOR_PYTHON``, else ``.venv-llmc/bin/python`` under the repository root,
  made as examples/anchors/llmcompressor_rows.py says; the column is skipped with a message when it is absent),
  fed the same windows as a DataLoader of batch 1 (as examples/anchors/llmcompressor_rows.py).

Measured per run: the wall time of the compression call only (model and data loaded before; the compressor's
construction included), the process's CPU time over that call (user + system: robust against other load on
a shared machine), and the peak extra memory: the process's peak RSS (``VmHWM``, reset with ``/proc/self/clear_refs`` once the model and
data are loaded, where the kernel allows) minus its RSS at that point. It is set against the model's weight
bytes and against ``one block's calibration activations``: ``samples x seq x hidden x 4 bytes x 2`` (a
block's cached inputs and the outputs that become the next block's inputs, float32): the memory a
block-by-block (sequential) calibration cannot avoid. ``kept``: the RSS growth still there after the call
(the compressed model's own state: masks, integer codes, scales).

    python benchmarks/oneshot_llm.py [--models trained[,large]] [--methods sparsegpt50,wanda50,...]
        [--sides ours,llmc] [--repeat 1] [--batch 1] [--forward-dtype model|float64|auto] [--weights PATH]
        [--llmc-python PATH]

Prints a markdown table (``python -m benchmarks --only oneshot_llm`` runs the default: the trained model).
The workers (``--worker ours|llmc``) import only torch / transformers / numpy and their own library.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SEQ = 256
TRAINED = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
           "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
LARGE = {**TRAINED, "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 10,
         "num_attention_heads": 8, "num_key_value_heads": 8}
METHODS = ("sparsegpt50", "wanda50", "gptq_w4g128", "awq_w4g128", "rtn_w4g128", "awq_w4g128_full", "awq_w4g128_noclip")
#: methods whose llmcompressor run would repeat another row's (its AWQ: no clipping, the grid scored on every sample)
OURS_ONLY = {"awq_w4g128_full", "awq_w4g128_noclip"}
#: relative to the repository root unless the environment says otherwise (never an absolute machine path)
DEFAULT_WEIGHTS = os.environ.get(
    "COMPRESSOR_LLM_WEIGHTS",
    str(Path(os.environ.get("COMPRESSOR_LLM_CACHE", ROOT / "out" / "llm")) / "llama-bytes-seed0-steps260.pt"))
DEFAULT_LLMC = os.environ.get("LLMCOMPRESSOR_PYTHON", str(ROOT / ".venv-llmc" / "bin" / "python"))
ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONHASHSEED": "0"}


# ------------------------------------------------------------------------------------------------ workers
def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _load(workdir: Path):
    import numpy as np
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**json.loads((workdir / "config.json").read_text()))
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg)
    model.load_state_dict(torch.load(workdir / "state.pt", weights_only=True))
    return model.eval(), np.load(workdir / "calib.npy")


def _ours(method: str, model, calib, batch: int, forward_dtype: str = "model"):
    import torch

    import compressor.torch as ct

    data = [torch.from_numpy(calib[i:i + batch]) for i in range(0, len(calib), batch)]
    base = {"op_types": ["default"]}
    cls, cfg = {
        "sparsegpt50": ("SparseGPTPruner", {"sparsity": 0.5}),
        "wanda50": ("WandaPruner", {"sparsity": 0.5}),
        "gptq_w4g128": ("GptqQuantizer", {"quant_bits": 4, "group_size": 128}),
        "awq_w4g128": ("AwqQuantizer", {"quant_bits": 4, "group_size": 128}),
        "awq_w4g128_full": ("AwqQuantizer", {"quant_bits": 4, "group_size": 128, "search_samples": None}),
        "awq_w4g128_noclip": ("AwqQuantizer", {"quant_bits": 4, "group_size": 128, "search_samples": None,
                                               "apply_clip": False}),
        "rtn_w4g128": ("RtnQuantizer", {"quant_bits": 4, "group_size": 128}),
    }[method]

    def run() -> None:
        c = getattr(ct, cls)(model, [{**cfg, **base}])
        if cls == "RtnQuantizer":
            c.calibrate()
        else:
            c.calibrate(data, progress=False, forward_dtype=forward_dtype)
    return run


def _llmc(method: str, model, calib, batch: int):
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.obcq import SparseGPTModifier
    from llmcompressor.modifiers.pruning import WandaPruningModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    if not torch.cuda.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations (pin_memory), which a CPU-only torch refuses
        # ("Cannot access accelerator device"): on CPU pinning has nothing to do, so it is the identity here
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    ignore, targets = ["lm_head"], ["Linear"]
    recipe = {
        "sparsegpt50": lambda: SparseGPTModifier(sparsity=0.5, mask_structure="0:0", targets=targets, ignore=ignore),
        "wanda50": lambda: WandaPruningModifier(sparsity=0.5, mask_structure="0:0", targets=targets, ignore=ignore),
        "gptq_w4g128": lambda: GPTQModifier(scheme="W4A16", targets=targets, ignore=ignore),
        "awq_w4g128": lambda: AWQModifier(scheme="W4A16", targets=targets, ignore=ignore),
        "rtn_w4g128": lambda: QuantizationModifier(scheme="W4A16", targets=targets, ignore=ignore),
    }[method]()
    rows = [{"input_ids": torch.from_numpy(c), "attention_mask": torch.ones(len(c), dtype=torch.long)} for c in calib]
    ds = torch.utils.data.DataLoader(rows, batch_size=1)

    class NoText:  # the batches are token ids already: no tokenizer
        pass

    def run() -> None:
        oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(calib), processor=NoText(),
                max_seq_length=SEQ, pad_to_max_length=False)
    return run


def worker(side: str, method: str, workdir: Path, batch: int, forward_dtype: str = "model") -> None:
    import torch

    torch.set_num_threads(1)
    model, calib = _load(workdir)
    if side == "llmc":  # llmcompressor reads the config back from name_or_path: a local checkpoint
        from transformers import LlamaForCausalLM

        d = Path(workdir) / "llmc-checkpoint"
        if not d.is_dir():
            model.save_pretrained(d)
        model = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager").eval()
        run = _llmc(method, model, calib, batch)
    else:
        run = _ours(method, model, calib, batch, forward_dtype)
    import gc

    gc.collect()
    base = _rss_kib("VmRSS")
    reset = _reset_peak()
    if not reset:
        base = _rss_kib("VmHWM")  # the peak so far: what the run adds above it is what is reported
    import resource

    u0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    run()
    sec = time.perf_counter() - t0
    u1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = _rss_kib("VmHWM")
    gc.collect()
    end = _rss_kib("VmRSS")  # what stays: the compressed model's own state (masks, codes, scales)
    cpu = (u1.ru_utime - u0.ru_utime) + (u1.ru_stime - u0.ru_stime)
    print(json.dumps({"seconds": sec, "cpu_seconds": cpu, "base_kib": base, "peak_kib": peak, "end_kib": end, "reset": reset,
                      "threads": torch.get_num_threads()}), flush=True)


# ------------------------------------------------------------------------------------------------ parent
class _Skip(Exception):
    """A model that cannot be measured here (its weights are missing): reported, not a failure."""


def _prepare(name: str, weights: str, root: Path) -> tuple[Path, dict]:
    import numpy as np
    import torch

    sys.path.insert(0, str(ROOT))
    from transformers import LlamaConfig, LlamaForCausalLM

    from examples.llm_common import calibration_windows, corpus

    d = root / name
    d.mkdir()
    cfg = TRAINED if name == "trained" else LARGE
    (d / "config.json").write_text(json.dumps(cfg))
    if name == "trained":
        if not Path(weights).is_file():
            raise _Skip(f"trained weights {weights} not found: run examples/reproduce_llm.py once (it trains and "
                        f"caches them) and pass --weights PATH (or COMPRESSOR_LLM_WEIGHTS)")
        shutil.copy(weights, d / "state.pt")
    else:
        torch.manual_seed(0)
        c = LlamaConfig(**cfg)
        c._attn_implementation = "eager"
        torch.save(LlamaForCausalLM(c).state_dict(), d / "state.pt")
    np.save(d / "calib.npy", calibration_windows(corpus(), 128, seed=0))
    state = torch.load(d / "state.pt", weights_only=True)
    params = sum(t.numel() for t in state.values())
    linear = sum(t.numel() for k, t in state.items() if k.startswith("model.layers.") and t.dim() == 2)
    info = {"params": params, "weight_bytes": 4 * params, "linear_bytes": 4 * linear,
            "block_act_bytes": 128 * SEQ * cfg["hidden_size"] * 4 * 2, "layers": cfg["num_hidden_layers"],
            "hidden": cfg["hidden_size"], "ffn": cfg["intermediate_size"]}
    return d, info


def _spawn(python: str, side: str, method: str, d: Path, batch: int, timeout: float, forward_dtype: str = "model") -> dict:
    cmd = [python, str(Path(__file__).resolve()), "--worker", side, "--method", method, "--dir", str(d),
           "--batch", str(batch), "--forward-dtype", forward_dtype]
    env = {**os.environ, **ENV}
    if side == "ours":
        env["PYTHONPATH"] = str(ROOT)
    else:
        env.pop("PYTHONPATH", None)
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}
    lines = [x for x in out.stdout.splitlines() if x.startswith("{")]
    if out.returncode != 0 or not lines:
        tail = (out.stderr.strip().splitlines() or ["?"])[-1]
        return {"error": f"rc {out.returncode}: {tail[:200]}"}
    return json.loads(lines[-1])


def _cell(runs: list[dict]) -> tuple[float, float, float, float, float] | str:
    """(median wall s, median cpu s, max peak extra KiB, max KiB still held at the end, min peak extra KiB) over
    the successful runs, or the first error. The peak of identical runs spreads by a few MiB (the address-space
    layout the allocator gets: examples/RESULTS.md, issue 25), so several runs show it as a range."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return next((r["error"] for r in runs), "not run")
    peaks = [r["peak_kib"] - r["base_kib"] for r in ok]
    return (statistics.median(r["seconds"] for r in ok), statistics.median(r.get("cpu_seconds", 0.0) for r in ok),
            max(peaks), max(r.get("end_kib", 0) - r["base_kib"] for r in ok), min(peaks))


def _row(method: str, ours: list[dict], llmc: list[dict], info: dict) -> str:
    o, m = _cell(ours), _cell(llmc)
    act, w = info["block_act_bytes"] / 1024, info["weight_bytes"] / 1024

    def sec(c):
        return f"{c[0]:.1f} ({c[1]:.1f})" if isinstance(c, tuple) else c

    def extra(c, base):
        return f"{c[2] / base:.2f}" if isinstance(c, tuple) else "-"
    def peak(c):  # "max (kept)", or "min-max (kept)" over several runs
        if not isinstance(c, tuple):
            return "-"
        lo, hi = round(c[4] / 1024), round(c[2] / 1024)
        return f"{lo}-{hi} ({c[3] / 1024:.0f})" if lo != hi else f"{hi} ({c[3] / 1024:.0f})"
    both = isinstance(o, tuple) and isinstance(m, tuple)
    ratio = f"{o[0] / m[0]:.2f}x ({o[1] / m[1]:.2f}x)" if both else "-"
    cells = [method, sec(o), sec(m), ratio,
             peak(o), peak(m),
             extra(o, w), extra(o, act), extra(m, act),
             f"{(w + o[2]) / (w + act):.2f}" if isinstance(o, tuple) else "-"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="trained", help="comma-separated of trained, large (default trained)")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated of {list(METHODS)}")
    p.add_argument("--sides", default="ours,llmc", help="ours, llmc or both (default)")
    p.add_argument("--repeat", type=int, default=1, help="runs per cell (median time, max memory)")
    p.add_argument("--batch", type=int, default=1, help="calibration windows per batch on our side (default 1)")
    p.add_argument("--forward-dtype", default="model", choices=("auto", "float64", "model"),
                   help="our calibrate(forward_dtype=...): 'model' (default, calibrate's: the model's dtype, as "
                        "llmcompressor), 'float64' (the same result on torch and Keras), 'auto' (float64 on a CPU)")
    p.add_argument("--weights", default=DEFAULT_WEIGHTS)
    p.add_argument("--llmc-python", default=DEFAULT_LLMC)
    p.add_argument("--timeout", type=float, default=1200.0, help="seconds per run")
    p.add_argument("--json", help="also write the raw rows here")
    p.add_argument("--worker", choices=("ours", "llmc"), help=argparse.SUPPRESS)
    p.add_argument("--method", help=argparse.SUPPRESS)
    p.add_argument("--dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.method, Path(a.dir), a.batch, a.forward_dtype)
        return 0
    models = [m for m in a.models.split(",") if m]
    methods = [m for m in a.methods.split(",") if m]
    sides = [s for s in a.sides.split(",") if s]
    bad = [m for m in models if m not in ("trained", "large")] + [m for m in methods if m not in METHODS] + \
          [s for s in sides if s not in ("ours", "llmc")]
    if bad:
        p.error(f"unknown model / method / side {bad}")
    notes = []
    if "llmc" in sides and not Path(a.llmc_python).is_file():
        notes.append(f"llmcompressor column skipped: {a.llmc_python} not found (a venv with llmcompressor==0.14.*, "
                     f"see examples/anchors/llmcompressor_rows.py; --llmc-python PATH)")
        sides = [s for s in sides if s != "llmc"]
    print(f"one thread per run, fresh interpreter per run; ours with forward_dtype={a.forward_dtype!r}; load average at start "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {os.cpu_count()} cores", flush=True)
    raw = []
    root = Path(tempfile.mkdtemp(prefix="oneshot-bench-"))
    try:
        for name in models:
            try:
                d, info = _prepare(name, a.weights, root)
            except _Skip as e:
                print(f"\n{name}: skipped: {e}", flush=True)
                continue
            print(f"\n{name}: {info['layers']} layers, width {info['hidden']}, FFN {info['ffn']}, "
                  f"{info['params'] / 1e6:.1f} M params, weights {info['weight_bytes'] / 2**20:.1f} MiB "
                  f"(decoder Linear {info['linear_bytes'] / 2**20:.1f} MiB); one block's calibration activations "
                  f"(128 x {SEQ} x {info['hidden']} x 4 B x 2) {info['block_act_bytes'] / 2**20:.1f} MiB", flush=True)
            print("| method | ours s (cpu s) | llmcompressor s (cpu s) | ours / llmc wall (cpu) | ours peak extra MiB "
                  "(kept) | llmc peak extra MiB (kept) | ours extra / weights | ours extra / block act | llmc extra / block act "
                  "| ours (weights + extra) / (weights + block act) |")
            print("|---|---|---|---|---|---|---|---|---|---|")
            for method in methods:
                res: dict[str, list[dict]] = {s: [] for s in sides}
                for _ in range(a.repeat):
                    for s in sides:  # interleaved, so load drift hits both sides alike
                        if s == "llmc" and method in OURS_ONLY:
                            continue
                        py = sys.executable if s == "ours" else a.llmc_python
                        r = _spawn(py, s, method, d, a.batch, a.timeout, a.forward_dtype)
                        res[s].append(r)
                        raw.append({"model": name, "method": method, "side": s, **r, **info})
                print(_row(method, res.get("ours", []), res.get("llmc", []), info), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for n in notes:
        print(f"\nnote: {n}")
    if any(not r.get("reset", True) for r in raw if "error" not in r):
        print("\nnote: /proc/self/clear_refs not writable: peak measured above the peak of loading")
    if a.json:
        Path(a.json).write_text(json.dumps(raw, indent=1))
    return 1 if any("error" in r for r in raw) else 0


if __name__ == "__main__":
    raise SystemExit(main())
