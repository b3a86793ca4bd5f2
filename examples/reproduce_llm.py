"""One-shot compression of a small language model (issue 25): Wanda, SparseGPT, GPTQ, RTN, AWQ vs magnitude.

Protocol (examples/llm_common.py): a byte-level HF Llama (4 layers, width 256, FFN 768, 3.5 M parameters)
trained here on Vim's help files (``shared/data/text``; every file i % 10 == 7 held out), 260 AdamW steps;
128 calibration windows of 256 bytes from the training files (seed ``s``); the decoder's Linear layers
compressed, ``lm_head`` left out; held-out perplexity over every 256-byte window of the held-out files.

Rows: the method on PyTorch (``compressor.torch``) and on Keras (``compressor.tf``, on a Keras port of the
same model with the same weights, examples/llm_keras.py, when it is there), for each calibration seed; with
``--anchor-python .venv-llmc/bin/python`` (a venv of its own; any path works), llmcompressor 0.14 on the same
weights and the same windows, run in that separate environment by examples/anchors/llmcompressor_rows.py;
backend ``keras_quantize``: Keras 3.15's ``model.quantize`` (int4 g128 / GPTQ / AWQ) on the Keras port,
examples/anchors/keras_quantize_rows.py.

    python -m examples.reproduce_llm [--methods all|a,b] [--seeds 0,1,2] [--backend torch,tf,llmcompressor|all]
        [--anchor-python PATH] [--workdir DIR] [--json PATH (resumable)] [--summary-only]

The trained weights are cached in ``--workdir`` (default ``$COMPRESSOR_LLM_CACHE``, else ``out/llm`` under the
repository root), where the benchmarks of the one-shot methods read them.
"""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from examples.llm_common import (
    CONFIG,
    DEFAULT_CACHE,
    DEFAULT_CORPUS,
    ROOT,
    calibration_windows,
    corpus,
    held_out_windows,
    perplexity_torch,
    trained_llama,
)

DEFAULT = [{"op_types": ["default"]}]
#: name -> list of (compressor class name, config entries); applied in order on one copy of the model
METHODS: dict[str, list[tuple[str, list[dict[str, Any]]]]] = {
    "magnitude50": [("LevelPruner", [{"sparsity": 0.5, "op_types": ["Linear"]},
                                     {"exclude": True, "op_names": ["lm_head"]}])],
    "wanda50": [("WandaPruner", [{"sparsity": 0.5, **DEFAULT[0]}])],
    "sparsegpt50": [("SparseGPTPruner", [{"sparsity": 0.5, **DEFAULT[0]}])],
    "sparsegpt24": [("SparseGPTPruner", [{"sparse_pattern": "2:4", **DEFAULT[0]}])],
    "sparsegpt70": [("SparseGPTPruner", [{"sparsity": 0.7, **DEFAULT[0]}])],
    "rtn_w4g128": [("RtnQuantizer", [{"quant_bits": 4, "group_size": 128, **DEFAULT[0]}])],
    "gptq_w4g128": [("GptqQuantizer", [{"quant_bits": 4, "group_size": 128, **DEFAULT[0]}])],
    "rtn_w3g128": [("RtnQuantizer", [{"quant_bits": 3, "group_size": 128, **DEFAULT[0]}])],
    "gptq_w3g128": [("GptqQuantizer", [{"quant_bits": 3, "group_size": 128, **DEFAULT[0]}])],
    "awq_w4g128": [("AwqQuantizer", [{"quant_bits": 4, "group_size": 128, **DEFAULT[0]}])],
    # the grid scored on every sequence (the default takes 16), and llmcompressor 0.14's algorithm (that, without
    # the clipping search)
    "awq_w4g128_full": [("AwqQuantizer", [{"quant_bits": 4, "group_size": 128, "search_samples": None,
                                           **DEFAULT[0]}])],
    "awq_w4g128_noclip": [("AwqQuantizer", [{"quant_bits": 4, "group_size": 128, "search_samples": None,
                                             "apply_clip": False, **DEFAULT[0]}])],
    "sparsegpt24+gptq_w4g128": [("SparseGPTPruner", [{"sparse_pattern": "2:4", **DEFAULT[0]}]),
                                ("GptqQuantizer", [{"quant_bits": 4, "group_size": 128, **DEFAULT[0]}])],
}
#: the anchor's name for our method (examples/anchors/llmcompressor_rows.py), where it has one
ANCHOR = {"wanda50": "wanda50", "sparsegpt50": "sparsegpt50", "sparsegpt24": "sparsegpt24",
          "sparsegpt70": "sparsegpt70", "rtn_w4g128": "rtn_w4g128", "gptq_w4g128": "gptq_w4g128",
          "rtn_w3g128": "rtn_w3g128", "gptq_w3g128": "gptq_w3g128", "awq_w4g128": "awq_w4g128"}
#: the Keras 3.15 ``model.quantize`` row beside ours (examples/anchors/keras_quantize_rows.py; its int4 g128 grid
#: is asymmetric, ours symmetric)
KERAS_ANCHOR = {"rtn_w4g128": "int4_g128", "gptq_w4g128": "gptq_w4g128", "gptq_w3g128": "gptq_w3g128",
                "awq_w4g128": "awq_w4g128"}


#: the dtype of the one-shot block passes (``--forward-dtype``; calibrate's default is 'model')
FORWARD_DTYPE = {"value": "model"}


def apply_method(backend: Any, model: Any, method: str, calib: Any) -> float:
    """Apply ``method``'s compressors (``backend`` = compressor.torch or compressor.tf) in order; seconds."""
    t0 = time.perf_counter()
    for cls, cfg in METHODS[method]:
        c = getattr(backend, cls)(model, copy.deepcopy(cfg))
        if cls == "LevelPruner":
            c.compress()
        elif cls == "RtnQuantizer":
            c.calibrate()
        else:
            c.calibrate(calib, progress=False, forward_dtype=FORWARD_DTYPE["value"])
    return time.perf_counter() - t0


def run_torch(model: Any, method: str, calib: np.ndarray, windows: np.ndarray) -> tuple[float, float]:
    import torch

    import compressor.torch as ct

    m = copy.deepcopy(model)
    sec = apply_method(ct, m, method, torch.from_numpy(calib))
    return perplexity_torch(m, windows), sec


def run_keras(model: Any, state: dict[str, np.ndarray], method: str, calib: np.ndarray,
              windows: np.ndarray) -> tuple[float, float]:
    import compressor.tf as ctf
    from examples.llm_keras import build_keras_llama, load_hf_weights, perplexity_keras

    km = build_keras_llama(CONFIG)
    load_hf_weights(km, state)
    sec = apply_method(ctf, km, method, calib)
    return perplexity_keras(km, windows), sec


def run_anchor(python: str, state: Path, corpus_path: str, method: str, seed: int,
               script: str = "llmcompressor_rows.py") -> dict | None:
    """One anchor row: examples/anchors/<script> (llmcompressor's in ``python``'s own environment)."""
    name = (KERAS_ANCHOR if script.startswith("keras") else ANCHOR)[method]
    cmd = [python, str(ROOT / "examples" / "anchors" / script), "--state", str(state),
           "--corpus", corpus_path, "--methods", name, "--seed", str(seed)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if out.returncode != 0 or not rows:
        print(f"  anchor {method} failed (exit {out.returncode}): {out.stderr.strip().splitlines()[-3:]}",
              file=sys.stderr)
        return None
    return rows[-1]


BACKENDS = ("torch", "tf", "llmcompressor", "keras_quantize")


def summary(rows: list[dict], methods: list[str], backends: list[str]) -> str:
    """Markdown: per method and backend the mean (min..max) over seeds, and max |torch - Keras| per seed."""
    def vals(method: str, be: str) -> dict:
        return {r["seed"]: r["ppl"] for r in rows if r["method"] == method and r["backend"] == be}

    head = [f"{b} ppl mean (min..max)" for b in backends]
    lines = ["| method | seeds | " + " | ".join(head) + " | max abs(torch - tf) |",
             "|---|---|" + "---|" * (len(backends) + 1)]
    for method in ["dense", *methods]:
        cells, seeds = [], set()
        for be in backends:
            v = vals(method, be)
            seeds |= set(v)
            if not v:
                cells.append("-")
            elif len(v) == 1:
                cells.append(f"{next(iter(v.values())):.4f}")
            else:
                x = np.array(list(v.values()))
                cells.append(f"{x.mean():.4f} ({x.min():.4f}..{x.max():.4f})")
        t, k = vals(method, "torch"), vals(method, "tf")
        both = sorted(set(t) & set(k), key=str)
        diff = f"{max(abs(t[s] - k[s]) for s in both):.1e}" if both else "-"
        seed_s = ",".join(str(s) for s in sorted(seeds, key=str) if s is not None) or "-"
        lines.append(f"| {method} | {seed_s} | " + " | ".join(cells) + f" | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default="all", help=f"comma-separated of {list(METHODS)} (default all)")
    p.add_argument("--seeds", default="0", help="calibration seeds, e.g. 0,1,2")
    p.add_argument("--backend", default="torch",
                   help=f"comma-separated of {list(BACKENDS)}, or 'all' (torch,tf; llmcompressor when "
                        "--anchor-python is given). keras_quantize: Keras 3.15's own model.quantize on the "
                        "Keras port (examples/anchors/keras_quantize_rows.py)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--workdir", default=DEFAULT_CACHE,
                   help="trained weights are cached here (default: $COMPRESSOR_LLM_CACHE, else out/llm in the repository)")
    p.add_argument("--train-seed", type=int, default=0)
    p.add_argument("--forward-dtype", choices=("model", "float64", "auto"), default="model",
                   help="dtype of the one-shot block passes (default model, calibrate's default; float64: torch and "
                        "Keras agree to ~1e-7)")
    p.add_argument("--anchor-python", help="a python with llmcompressor 0.14 (its own venv)")
    p.add_argument("--json", help="rows as JSON, rewritten after every row; rows already in it are skipped "
                                  "(resume an interrupted run)")
    p.add_argument("--summary-only", action="store_true", help="print the table of the rows in --json")
    a = p.parse_args(argv)
    FORWARD_DTYPE["value"] = a.forward_dtype
    import torch

    torch.set_num_threads(1)
    methods = list(METHODS) if a.methods == "all" else a.methods.split(",")
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        p.error(f"unknown methods {unknown}; allowed: {list(METHODS)}")
    if a.backend == "all":
        backends = ["torch", "tf"] + (["llmcompressor"] if a.anchor_python else [])
    else:
        backends = a.backend.split(",")
    bad = sorted(set(backends) - set(BACKENDS))
    if bad:
        p.error(f"unknown backends {bad}; allowed: {list(BACKENDS)} or 'all'")
    if "llmcompressor" in backends and not a.anchor_python:
        p.error("--backend llmcompressor needs --anchor-python")
    json_path = Path(a.json) if a.json else None
    rows: list[dict] = json.loads(json_path.read_text()) if json_path and json_path.is_file() else []
    if a.summary_only:
        print(summary(rows, methods, [b for b in BACKENDS if any(r["backend"] == b for r in rows)]))
        return 0
    done = {(r["method"], r["backend"], r["seed"]) for r in rows}

    def add(row: dict) -> None:
        rows.append(row)
        done.add((row["method"], row["backend"], row["seed"]))
        if json_path:
            tmp = json_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(rows, indent=1))
            tmp.replace(json_path)

    text = corpus(a.corpus)
    print(text.describe())
    model = trained_llama(text, a.workdir, seed=a.train_seed)
    state_path = Path(a.workdir) / f"llama-bytes-seed{a.train_seed}-steps260.pt"
    windows = held_out_windows(text)
    if ("dense", "torch", None) not in done:
        dense = perplexity_torch(model, windows)
        add({"method": "dense", "backend": "torch", "seed": None, "ppl": dense, "seconds": 0.0})
    dense = next(r["ppl"] for r in rows if r["method"] == "dense" and r["backend"] == "torch")
    print(f"dense held-out perplexity: {dense:.4f} ({sum(q.numel() for q in model.parameters()):,} parameters)")
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()} if "tf" in backends else {}
    for seed in (int(s) for s in a.seeds.split(",")):
        calib = calibration_windows(text, 128, seed)
        for method in methods:
            for be in backends:
                if (method, be, seed) in done or (be == "llmcompressor" and method not in ANCHOR) or (
                        be == "keras_quantize" and method not in KERAS_ANCHOR):
                    continue
                if be in ("llmcompressor", "keras_quantize"):
                    r = (run_anchor(a.anchor_python, state_path, a.corpus, method, seed) if be == "llmcompressor"
                         else run_anchor(sys.executable, state_path, a.corpus, method, seed, "keras_quantize_rows.py"))
                    if r is None:
                        continue
                    ppl, sec = r["ppl"], r["seconds"]
                else:
                    ppl, sec = (run_torch(model, method, calib, windows) if be == "torch"
                                else run_keras(model, state, method, calib, windows))
                add({"method": method, "backend": be, "seed": seed, "ppl": ppl, "seconds": sec})
                print(f"  seed {seed} {method:24s} {be:13s} ppl {ppl:.4f}  ({sec:.1f} s)", flush=True)
    print()
    print(summary(rows, methods, [b for b in BACKENDS if any(r["backend"] == b for r in rows)]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
