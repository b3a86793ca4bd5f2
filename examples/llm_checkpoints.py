"""Checkpoint sizes of the one-shot compressed language model (issue 26): ``export_model(hf_path=DIR)`` on the
trained byte-level Llama of examples/llm_common.py, for each method of examples/reproduce_llm.py and each
storage of its pruned layers; per row the file size, the tensor bytes vs the float checkpoint
(``compressor.core.compressed_tensors.checkpoint_report``), and the max |logit| difference against the
compressed model of the reloaded checkpoint: ``AutoModelForCausalLM.from_pretrained`` (compressed-tensors
installed) and the numpy reader (``load_compressed_tensors``).

    python -m examples.llm_checkpoints [--methods gptq_w4g128,sparsegpt50] [--calib 128] [--out DIR] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import tempfile
import time
import warnings
from typing import Any

from examples.llm_common import (
    DEFAULT_CACHE,
    DEFAULT_CORPUS,
    calibration_windows,
    corpus,
    held_out_windows,
    trained_llama,
)
from examples.reproduce_llm import METHODS

#: method -> the hf_sparse_format values to write (pruned float layers); quantized layers are always packed
ROWS = {"gptq_w4g128": ["dense"], "rtn_w4g128": ["dense"], "awq_w4g128": ["dense"],
        "sparsegpt50": ["dense", "bitmask"], "sparsegpt24": ["dense", "2:4"], "sparsegpt24+gptq_w4g128": ["dense"]}


def _size(folder: str) -> int:
    return sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import torch
    import transformers

    import compressor.torch as ct
    from compressor.core.compressed_tensors import checkpoint_report, load_compressed_tensors

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--methods", default=",".join(ROWS))
    p.add_argument("--calib", type=int, default=128, help="calibration windows (the protocol's 128)")
    p.add_argument("--workdir", default=DEFAULT_CACHE,
                   help="the trained weights' cache (default: $COMPRESSOR_LLM_CACHE, else out/llm in the repository)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--out", default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    text = corpus(args.corpus)
    base = trained_llama(text, args.workdir)
    calib = torch.from_numpy(calibration_windows(text, count=args.calib, seed=0))
    ids = torch.from_numpy(held_out_windows(text)[:4, :-1])
    out = args.out or tempfile.mkdtemp(prefix="llm-checkpoints-")

    def logits(m: Any) -> Any:
        with torch.no_grad():
            return m(input_ids=ids).logits

    base.save_pretrained(os.path.join(out, "float"))
    rows: dict[str, Any] = {"float (save_pretrained)": {"bytes": _size(os.path.join(out, "float"))}}
    print(f"float (save_pretrained): {rows['float (save_pretrained)']['bytes']:,} bytes", flush=True)
    for method in args.methods.split(","):
        model = copy.deepcopy(base)
        kept = []
        t0 = time.perf_counter()
        for cls, cfg in METHODS[method]:
            c = getattr(ct, cls)(model, copy.deepcopy(cfg))
            c.calibrate() if cls == "RtnQuantizer" else c.calibrate(calib, progress=False)
            kept.append(c)  # a pruner's wrappers hold it weakly: keep it for export_model
        sec = time.perf_counter() - t0
        ref = logits(model)
        for fmt in ROWS.get(method, ["dense"]):
            folder = os.path.join(out, f"{method}-{fmt.replace(':', '')}")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                kept[-1].export_model(None, hf_path=folder, hf_sparse_format=fmt)
            floats = [str(w.message) for w in caught if "written as float weights" in str(w.message)]
            total = checkpoint_report(folder)["total"]
            row = {"bytes": _size(folder), "tensor_bytes": total["bytes"], "float_tensor_bytes": total["dense_bytes"],
                   "calibrate_s": round(sec, 1), "float_layers_note": floats[0] if floats else None}
            plain = copy.deepcopy(base)
            plain.load_state_dict({k: torch.from_numpy(v) for k, v in load_compressed_tensors(folder).items()})
            row["reader_max_abs_diff"] = float((logits(plain) - ref).abs().max())
            if fmt == "dense":  # compressed-tensors 0.15+ does not read the sparse formats
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    hf = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
                row["from_pretrained_max_abs_diff"] = float((logits(hf) - ref).abs().max())
            rows[f"{method} [{fmt}]"] = row
            print(f"{method} [{fmt}]: {row['bytes']:,} bytes, tensors {row['tensor_bytes']:,} of "
                  f"{row['float_tensor_bytes']:,}; reader diff {row['reader_max_abs_diff']:.2e}"
                  + (f", from_pretrained diff {row['from_pretrained_max_abs_diff']:.2e}" if fmt == "dense" else ""),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return rows


if __name__ == "__main__":
    main()
