"""The streamed command and the in-memory API give the same checkpoint, on the one-shot reproduction's model.

The byte-level Llama of ``examples/reproduce_llm`` (trained on Vim's help files, cached in ``out/llm``) is saved as a
Hugging Face checkpoint; for each method, the same 128 calibration windows go to

* ``compressor.torch.oneshot(SRC, OUT, recipe, ids.npy)`` (streamed, one block in memory, optionally ``--workers``), and
* ``from_pretrained`` + ``calibrate`` + ``export_model(hf_path=...)`` (in memory),

with the same dtype settings (``forward_dtype``, float32 checkpoint). Printed per method: the tensors of the two
checkpoints compared name by name and bit for bit (the streamed checkpoint is sharded one block per file, the
in-memory one is one file, so the FILES differ while every tensor and config.json's quantization_config are
equal), and both checkpoints' held-out perplexity as ``transformers`` loads them.

    python -m examples.stream_vs_memory [--methods sparsegpt50,gptq_w4g128,awq_w4g128] [--workers 1]
        [--forward-dtype model] [--corpus PATH] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from examples.llm_common import (
    DEFAULT_CACHE,
    DEFAULT_CORPUS,
    calibration_windows,
    corpus,
    held_out_windows,
    perplexity_torch,
    trained_llama,
)

SKIP = {"op_names": ["lm_head"], "exclude": True}
RECIPES = {
    "sparsegpt50": [{"SparseGPTPruner": [{"sparsity": 0.5, "op_types": ["Linear"]}, SKIP]}],
    "gptq_w4g128": [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["Linear"]}, SKIP]}],
    "awq_w4g128": [{"AwqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["Linear"]}, SKIP]}],
}


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    from compressor.core.compressed_tensors import read_safetensors

    out: dict[str, np.ndarray] = {}
    for f in sorted(os.listdir(folder)):
        if f.endswith(".safetensors"):
            out.update(read_safetensors(folder / f))
    return out


def _in_memory(src: Path, recipe: list, calib: np.ndarray, out: Path, forward_dtype: str) -> None:
    import torch
    import transformers

    import compressor.torch as ct

    model = transformers.AutoModelForCausalLM.from_pretrained(src).eval()
    (name, config), = recipe[0].items()
    comp = getattr(ct, name)(model, config)
    comp.calibrate(list(torch.from_numpy(calib).split(8)), progress=False, forward_dtype=forward_dtype)
    extra = (str(out / "mask.pt"),) if name.endswith("Pruner") else ()
    comp.export_model(str(out / "m.pt"), *extra, hf_path=str(out / "memory"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--methods", default=",".join(RECIPES))
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--forward-dtype", choices=("model", "float64", "auto"), default="model")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--workdir", default=DEFAULT_CACHE, help="the trained weights' cache (default out/llm)")
    p.add_argument("--seed", type=int, default=0, help="calibration seed")
    a = p.parse_args(argv)
    import torch
    import transformers

    from compressor.torch.hf_oneshot import oneshot

    torch.set_num_threads(1)
    text = corpus(a.corpus)
    model = trained_llama(text, a.workdir)
    windows = held_out_windows(text)
    calib = calibration_windows(text, 128, a.seed)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        model.save_pretrained(d / "src", safe_serialization=True)
        np.save(d / "ids.npy", calib)
        for method in a.methods.split(","):
            recipe = RECIPES[method]
            work = d / method
            work.mkdir()
            t0 = time.perf_counter()
            oneshot(d / "src", work / "stream", recipe, str(d / "ids.npy"), num_samples=len(calib),
                    seq_len=calib.shape[1], batch_size=8, forward_dtype=a.forward_dtype, workers=a.workers,
                    progress=False)
            t_stream = time.perf_counter() - t0
            t0 = time.perf_counter()
            _in_memory(d / "src", recipe, calib, work, a.forward_dtype)
            t_memory = time.perf_counter() - t0
            got, want = _tensors(work / "stream"), _tensors(work / "memory")
            same_names = sorted(got) == sorted(want)
            differing = [k for k in want if k not in got or got[k].dtype != want[k].dtype
                         or got[k].tobytes() != want[k].tobytes()]
            qc = [json.loads((work / s / "config.json").read_text()).get("quantization_config")
                  for s in ("stream", "memory")]
            ppl = [perplexity_torch(transformers.AutoModelForCausalLM.from_pretrained(work / s).eval(), windows)
                   for s in ("stream", "memory")]
            rows.append((method, len(want), same_names, len(differing), qc[0] == qc[1], ppl[0], ppl[1], t_stream,
                         t_memory))
    print(f"forward_dtype {a.forward_dtype}, {a.workers} process(es), 128 x 256 calibration bytes (seed {a.seed})\n")
    print("| method | tensors | same names | tensors differing (bits) | same quantization_config | ppl streamed | "
          "ppl in memory | streamed s | in memory s |")
    print("|---|---:|---|---:|---|---:|---:|---:|---:|")
    for m, n, names, diff, qc, p1, p2, t1, t2 in rows:
        print(f"| {m} | {n} | {names} | {diff} | {qc} | {p1:.4f} | {p2:.4f} | {t1:.0f} | {t2:.0f} |")
    return 0 if all(r[2] and r[3] == 0 and r[4] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
