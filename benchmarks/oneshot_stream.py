"""Streamed one-shot compression (``compressor oneshot``): peak memory against depth, against the checkpoint's
size, and against the in-memory path on the same checkpoint.

A random-weight Llama checkpoint is written for each depth in ``--layers`` (TinyLlama's shape by default: width
2048, FFN 5632, 32 heads / 4 KV heads, vocabulary 32000, bfloat16; ``--shape small``: width 512, FFN 1408, 8 / 2
heads, the same vocabulary), with random token ids as the calibration set. Each run happens in a FRESH process
(one intra-op thread unless ``--threads``):

* ``stream``: ``compressor.torch.oneshot(src, out, recipe, ids.npy)`` (GPTQ w4 g128, ``lm_head`` left out), the
  process's peak RSS (its own ``VmHWM``) and wall time;
* ``in-memory`` (``--sides stream,memory``): ``from_pretrained`` + ``GptqQuantizer.calibrate`` +
  ``export_model(hf_path=...)`` on the same checkpoint and data;
* ``llmc`` (``--sides stream,llmc``): llmcompressor 0.14's ``oneshot`` with ``GPTQModifier(scheme='W4A16')``
  (int4 g128, ``lm_head`` ignored) on ``from_pretrained(src, dtype=bfloat16)``, the same token ids as a DataLoader
  of batch 1, run by ``--llmc-python`` (its own venv: ``python3 -m venv V && V/bin/pip install torch==2.13.0
  llmcompressor==0.14``).

``--wrap CMD``: the stream runs are started as ``CMD python ...`` (e.g. a script that moves itself into a
memory-limited cgroup, then execs its arguments: a run under a hard memory limit).

* ``--parallel 1x1,1x2,2x1``: the stream run again as PROCESSES x THREADS (``workers=``, ``threads=``) for each
  entry, wall time only (the goal: 2 x 1 at least 1.6x faster than 1 x 1, and not slower than 1 x 2).

Printed: a markdown table (layers, checkpoint MiB, peak RSS MiB, peak / checkpoint bytes, seconds), and the ratio
of the deepest stream run's peak to the shallowest's. Goal (issue 44): the peak at 22 layers within 10 % of the
peak at 4 layers, and at most 0.5x the checkpoint's bytes at 22 layers.

    python benchmarks/oneshot_stream.py [--shape tiny|small] [--layers 4,22] [--samples 128] [--seq-len 512]
        [--sides stream[,memory][,llmc]] [--threads 1] [--parallel 1x1,1x2,2x1] [--workdir DIR] [--wrap CMD]
        [--llmc-python PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHAPES = {
    "tiny": {"hidden_size": 2048, "intermediate_size": 5632, "num_attention_heads": 32, "num_key_value_heads": 4,
             "vocab_size": 32000},
    "small": {"hidden_size": 512, "intermediate_size": 1408, "num_attention_heads": 8, "num_key_value_heads": 2,
              "vocab_size": 32000},
}
RECIPE = [{"GptqQuantizer": [{"quant_bits": 4, "group_size": 128, "op_types": ["Linear"]},
                             {"op_names": ["lm_head"], "exclude": True}]}]


def _make(folder: Path, shape: str, layers: int, samples: int, seq_len: int) -> None:
    import numpy as np
    import torch
    import transformers

    cfg = transformers.LlamaConfig(**SHAPES[shape], num_hidden_layers=layers, max_position_embeddings=max(seq_len, 2048),
                                   tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    model.save_pretrained(folder / "src", safe_serialization=True, max_shard_size="500MB")
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(samples, seq_len))
    np.save(folder / "ids.npy", ids)


def _worker(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    folder = Path(args.folder)
    t0 = time.perf_counter()
    if args.worker == "stream":
        from compressor.torch.hf_oneshot import oneshot

        out = folder / f"out-stream-{args.workers}x{args.threads}"
        oneshot(folder / "src", out, RECIPE, str(folder / "ids.npy"), num_samples=args.samples,
                seq_len=args.seq_len, batch_size=8, progress=False, workers=args.workers, threads=args.threads)
        import shutil

        shutil.rmtree(out)
    elif args.worker == "llmc":
        import numpy as np
        import transformers
        from llmcompressor import oneshot
        from llmcompressor.modifiers.quantization import GPTQModifier

        model = transformers.AutoModelForCausalLM.from_pretrained(folder / "src", dtype=torch.bfloat16).eval()
        ids = torch.tensor(np.load(folder / "ids.npy")[:args.samples, :args.seq_len])
        rows = [{"input_ids": r, "attention_mask": torch.ones(len(r), dtype=torch.long)} for r in ids]

        class NoText:  # the batches are token ids already: no tokenizer
            pass
        oneshot(model=model, dataset=torch.utils.data.DataLoader(rows, batch_size=1),
                recipe=GPTQModifier(scheme="W4A16", targets=["Linear"], ignore=["lm_head"]),
                num_calibration_samples=len(rows), processor=NoText(), max_seq_length=args.seq_len,
                pad_to_max_length=False)
    else:
        import numpy as np
        import transformers

        from compressor.torch import GptqQuantizer

        model = transformers.AutoModelForCausalLM.from_pretrained(folder / "src", dtype=torch.bfloat16).eval()
        ids = torch.tensor(np.load(folder / "ids.npy")[:args.samples, :args.seq_len])
        q = GptqQuantizer(model, RECIPE[0]["GptqQuantizer"])
        q.calibrate(list(ids.split(8)), progress=False, forward_dtype="model")
        q.export_model(str(folder / "m.pt"), hf_path=str(folder / "out-memory"))
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mib": _vm_hwm()}))


def _vm_hwm() -> float:
    """This process's peak RSS (VmHWM, MiB): counted from its own exec, unlike the rusage of a forked child, which
    starts at the size of the parent that forked it (here: the parent that built the checkpoint)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise SystemExit("no VmHWM in /proc/self/status (Linux only)")


def _run(side: str, folder: Path, args: argparse.Namespace, workers: int = 1, threads: int | None = None) -> dict:
    python = args.llmc_python if side == "llmc" else sys.executable
    wrap = args.wrap.split() if args.wrap and side == "stream" else []
    cmd = [*wrap, python, __file__, "--worker", side, "--folder", str(folder), "--samples", str(args.samples),
           "--seq-len", str(args.seq_len), "--threads", str(threads or args.threads), "--workers", str(workers)]
    # numpy's BLAS pool sized as torch's (the statistics and solves run there): "1 thread" means one thread
    blas = {k: str(threads or args.threads) for k in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")}
    env = {**os.environ, "PYTHONPATH": str(ROOT), **blas}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{side} run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--layers", default="4,22")
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--sides", default="stream")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--parallel", default="", help="PROCESSESxTHREADS entries, e.g. 1x1,1x2,2x1")
    p.add_argument("--wrap", default="", help="a command the stream runs are started under (e.g. into a cgroup)")
    p.add_argument("--llmc-python", default=str(ROOT / ".venv-llmc" / "bin" / "python"),
                   help="the python of a venv with llmcompressor 0.14 (--sides llmc)")
    p.add_argument("--workers", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help="where the checkpoints are written (default: a temporary folder)")
    p.add_argument("--worker", choices=("stream", "memory", "llmc"), help=argparse.SUPPRESS)
    p.add_argument("--folder", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    rows, par = [], []
    with tempfile.TemporaryDirectory(dir=args.workdir) as tmp:
        for n in [int(x) for x in args.layers.split(",")]:
            folder = Path(tmp) / f"l{n}"
            folder.mkdir()
            _make(folder, args.shape, n, args.samples, args.seq_len)
            size = sum(f.stat().st_size for f in (folder / "src").glob("*.safetensors")) / 2**20
            for side in sides:
                r = _run(side, folder, args)
                rows.append((n, side, size, r["peak_mib"], r["seconds"]))
            for entry in [e.strip() for e in args.parallel.split(",") if e.strip()]:
                w, t = (int(x) for x in entry.split("x"))
                r = _run("stream", folder, args, w, t)
                par.append((n, w, t, r["seconds"]))
            for f in (folder / "src").glob("*.safetensors"):
                f.unlink()
    print(f"shape {args.shape}, GPTQ w4 g128, {args.samples} x {args.seq_len} tokens, {args.threads} thread(s)\n")
    print("| layers | side | checkpoint MiB | peak RSS MiB | peak / checkpoint | seconds |")
    print("|---:|---|---:|---:|---:|---:|")
    for n, side, size, peak, sec in rows:
        print(f"| {n} | {side} | {size:.0f} | {peak:.0f} | {peak / size:.2f} | {sec:.0f} |")
    if par:
        print("\n| layers | processes x threads | seconds | speed-up vs 1 x 1 |")
        print("|---:|---|---:|---:|")
        base = {n: sec for n, w, t, sec in par if (w, t) == (1, 1)}
        for n, w, t, sec in par:
            up = f"{base[n] / sec:.2f}x" if n in base else "-"
            print(f"| {n} | {w} x {t} | {sec:.0f} | {up} |")
    stream = [r for r in rows if r[1] == "stream"]
    if len(stream) > 1:
        print(f"\nstream peak, deepest / shallowest: {stream[-1][3] / stream[0][3]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
