"""``compressor demo --lm``: one-shot compression of a small language model, offline, in a few minutes.

1. **Corpus** (no download): the ``*.py`` files directly in Python's own standard library
   (``sysconfig.get_paths()['stdlib']``), sorted by name; file ``i`` is held out when ``i % 10 == 7``, the
   rest is training text (:func:`compressor.app.data.load_text_corpus`). Bytes are the tokens (vocabulary 256).
   ``--text-dir DIR``: the ``*.txt`` files of a folder (or a ``.tar.gz`` of them) instead, same split.
   The numbers depend on the Python version (its standard library is the text).
2. **Model**: a Hugging Face ``LlamaForCausalLM`` (2 layers, width 128, FFN 384, 4 heads, 0.49 M parameters;
   ``--quick``: 1 layer, width 64) trained here with AdamW for a fixed number of steps on windows of the
   training text, seeded. The Keras rows use the same trained weights in a Keras port of the model
   (:mod:`compressor.app.demo_lm_tf`). Training needs PyTorch + transformers, also for ``--backend tf``.
3. **Methods** (one-shot, calibration windows from the training text, every decoder ``Linear`` / ``Dense``,
   ``lm_head`` left out): SparseGPT 50 %, SparseGPT 2:4, Wanda 50 %, RTN w4, GPTQ w4, AWQ w4 (4-bit
   symmetric codes, group 128; ``--quick``: group 32). Then each result is shipped and measured ON the
   shipped artifact, reloaded from its file:

   * torch: quantized models: :func:`compressor.torch.pack_weights` (int4 codes, two per byte, run by
     PyTorch's int4 CPU kernel in bfloat16), the packed ``state_dict`` saved with ``torch.save``, loaded into a
     fresh model; pruned models: ``export_model`` (plain ``state_dict`` with zeros, loaded into a fresh
     model) and its compressed file (``compressed_path``: kept values + positions, entropy coded), whose size
     is the row's. Decode latency: batch 1, greedy, ``--decode-tokens`` new tokens with the KV cache
     (``generate``), median of interleaved rounds over every model (the float32 dense model included).
   * Keras: quantized models: :func:`compressor.tf.to_keras_quantized` (Keras 3's own int4 layers with our
     codes), saved as ``.keras`` and reloaded with ``keras.saving.load_model``; pruned models: the stripped
     model saved as ``.keras``. No decode column (the port has no KV cache).

4. A table per backend (method | perplexity | vs dense | weight size | decode ms/token | x dense) and one line
   in plain words. Perplexity: ``exp`` of the mean next-byte cross entropy over consecutive held-out windows.

This module imports neither framework; the backend parts are :mod:`compressor.app.demo_lm_torch` and
:mod:`compressor.app.demo_lm_tf`, imported only for the backends that run.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.matching import DefaultSkipWarning
from .data import DataError, TextCorpus, byte_windows, load_text_corpus
from .demo_lm_rows import LmRow  # in its own module: the backend harnesses build rows

__all__ = ["LmProfile", "LmRow", "LmResult", "METHODS", "PROFILES", "load_corpus", "run_lm_demo", "main"]

BACKENDS = ("torch", "tf")
FRAMEWORK = {"torch": "torch", "tf": "tensorflow"}


@dataclass(frozen=True)
class LmProfile:
    """Model size, training and measurement settings of one ``--lm`` run."""

    hidden: int
    ffn: int
    layers: int
    heads: int
    seq: int  # training / calibration / evaluation window length (bytes)
    steps: int  # AdamW steps
    batch: int
    lr: float
    calib: int  # calibration windows
    eval_windows: int  # held-out windows for the perplexity
    group_size: int  # of the 4-bit quantizers
    decode_tokens: int  # new tokens per timed greedy decode
    decode_rounds: int  # interleaved timing rounds

    def llama_config(self) -> dict[str, Any]:
        """``LlamaConfig`` keys (byte vocabulary, untied LM head)."""
        return {"vocab_size": 256, "hidden_size": self.hidden, "intermediate_size": self.ffn,
                "num_hidden_layers": self.layers, "num_attention_heads": self.heads,
                "num_key_value_heads": self.heads, "max_position_embeddings": max(self.seq, 2 * self.decode_tokens),
                "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


PROFILES: dict[bool, LmProfile] = {
    False: LmProfile(hidden=128, ffn=384, layers=2, heads=4, seq=128, steps=150, batch=8, lr=3e-3, calib=32,
                     eval_windows=64, group_size=128, decode_tokens=32, decode_rounds=9),
    True: LmProfile(hidden=64, ffn=128, layers=1, heads=4, seq=64, steps=30, batch=8, lr=3e-3, calib=8,
                    eval_windows=16, group_size=32, decode_tokens=8, decode_rounds=2),
}


@dataclass(frozen=True)
class Method:
    """One row: ``steps`` = (compressor class name, config_list) applied in order; ``kind`` 'prune' or 'quant'."""

    key: str
    label: str
    kind: str
    steps: tuple[tuple[str, tuple[dict[str, Any], ...]], ...]


_LM_HEAD = {"exclude": True, "op_names": ["lm_head"]}


def methods(group_size: int) -> list[Method]:
    """The demo's methods (4-bit codes with ``group_size``); the same configs on both backends."""
    dflt = {"op_types": ["default"]}
    q4 = {"quant_bits": 4, "group_size": group_size, **dflt}
    return [
        Method("sparsegpt50", "SparseGPT 50 %", "prune", (("SparseGPTPruner", ({"sparsity": 0.5, **dflt}, _LM_HEAD)),)),
        Method("sparsegpt24", "SparseGPT 2:4", "prune",
               (("SparseGPTPruner", ({"sparse_pattern": "2:4", **dflt}, _LM_HEAD)),)),
        Method("wanda50", "Wanda 50 %", "prune", (("WandaPruner", ({"sparsity": 0.5, **dflt}, _LM_HEAD)),)),
        Method("rtn_w4", f"RTN w4 g{group_size}", "quant", (("RtnQuantizer", (q4, _LM_HEAD)),)),
        Method("gptq_w4", f"GPTQ w4 g{group_size}", "quant", (("GptqQuantizer", (q4, _LM_HEAD)),)),
        Method("awq_w4", f"AWQ w4 g{group_size}", "quant", (("AwqQuantizer", (q4, _LM_HEAD)),)),
    ]


METHODS = [m.key for m in methods(128)]


# ---------------------------------------------------------------------------------------------- results
@dataclass
class LmResult:
    backend: str
    description: str
    rows: list[LmRow] = field(default_factory=list)
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def dense(self) -> LmRow:
        return self.rows[0]

    def row(self, key: str) -> LmRow:
        return next(r for r in self.rows if r.key == key)

    def table(self) -> str:
        d = self.dense
        head = ("method", "perplexity", "vs dense", "weight size", "decode ms/token", "x dense")
        lines_ = [head]
        for r in self.rows:
            ms = f"{1e3 * r.decode_s:.2f}" if r.decode_s is not None else "-"
            speed = (f"{d.decode_s / r.decode_s:.2f}x" if r.decode_s and d.decode_s and r is not d else
                     ("1.00x" if r is d and r.decode_s else "-"))
            size = f"{r.file_bytes:,} B ({d.file_bytes / r.file_bytes:.2f}x smaller)" if r is not d else \
                f"{r.file_bytes:,} B"
            vs = "-" if r is d else f"{100 * (r.ppl / d.ppl - 1):+.2f} %"
            lines_.append((r.label, f"{r.ppl:.4f}", vs, size, ms, speed))
        widths = [max(len(x[i]) for x in lines_) for i in range(len(head))]
        out = [f"== {self.backend}: {self.description} ({self.seconds:.1f} s) =="]
        out += ["  " + "   ".join(c.ljust(w) for c, w in zip(x, widths)).rstrip() for x in lines_]
        whats: dict[str, list[str]] = {}
        for r in self.rows:
            whats.setdefault(r.file_what, []).append(r.label)
        out.append("  weight size = bytes of the saved file: " + "; ".join(
            f"{', '.join(labels)}: {what}" for what, labels in whats.items()))
        sims = [f"{r.label} {r.ppl_model:.4f}" for r in self.rows[1:] if r.ppl_model is not None]
        if sims:
            out.append("  perplexity before shipping (masked / fake-quant model): " + ", ".join(sims))
        kernels = list(dict.fromkeys(r.kernel for r in self.rows if r.kernel))
        if kernels:
            out.append("  runs on: " + "; ".join(kernels))
        if any(r.decode_range for r in self.rows):
            out.append("  decode ms/token min-max (interleaved rounds): " + ", ".join(
                f"{r.label} {1e3 * r.decode_range[0]:.2f}-{1e3 * r.decode_range[1]:.2f}"
                for r in self.rows if r.decode_range))
        out.append("  compression time (one-shot, s): " + ", ".join(f"{r.label} {r.compress_s:.1f}" for r in self.rows[1:]))
        out += [f"  {n}" for n in self.notes]
        out.append(f"  {self.backend}: {self.summary()}")
        return "\n".join(out)

    def summary(self) -> str:
        """The result in plain words: the best 4-bit row by perplexity, and the best pruned row."""
        d = self.dense
        quant = [r for r in self.rows[1:] if r.key.endswith("_w4")]
        prune = [r for r in self.rows[1:] if not r.key.endswith("_w4")]
        parts = []
        if quant:
            q = min(quant, key=lambda r: r.ppl)
            s = f"{q.label.split(' g')[0].replace(' w4', ' int4')} gives a {d.file_bytes / q.file_bytes:.1f}x smaller model"
            if q.decode_s and d.decode_s:
                s += f", {d.decode_s / q.decode_s:.2f}x {'faster' if q.decode_s < d.decode_s else 'the speed of'} decoding"
            parts.append(s + f", {100 * (q.ppl / d.ppl - 1):+.1f} % perplexity")
        if prune:
            p = min(prune, key=lambda r: r.ppl)
            parts.append(f"{p.label} gives a {d.file_bytes / p.file_bytes:.1f}x smaller compressed file, "
                         f"{100 * (p.ppl / d.ppl - 1):+.1f} % perplexity")
        return "; ".join(parts) if parts else "dense only"


# ---------------------------------------------------------------------------------------------- data
def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def load_corpus(text_dir: str | None = None) -> TextCorpus:
    """Python's standard library ``*.py`` files (default) or the ``*.txt`` files of ``text_dir``; file ``i``
    held out when ``i % 10 == 7`` (sorted names)."""
    if text_dir is None:
        return load_text_corpus(stdlib_dir(), suffix=".py")
    return load_text_corpus(text_dir, suffix=".txt")


def held_out_windows(text: TextCorpus, seq: int, limit: int) -> np.ndarray:
    """The first ``limit`` consecutive non-overlapping windows of ``seq + 1`` bytes of the held-out text."""
    t = text.held_out
    n = min((len(t) - 1) // seq, limit)
    if n < 1:
        raise DataError(f"the held-out text ({len(t)} bytes) is shorter than one window of {seq + 1} bytes")
    return np.stack([t[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int64)


def training_windows(text: TextCorpus, p: LmProfile, seed: int) -> np.ndarray:
    """``steps * batch`` random windows of ``seq + 1`` bytes from the training text (int64)."""
    return byte_windows(text.train, p.steps * p.batch, p.seq + 1, seed=seed + 1000)


def calibration_windows(text: TextCorpus, p: LmProfile, seed: int) -> np.ndarray:
    return byte_windows(text.train, p.calib, p.seq, seed=seed + 7)


# ---------------------------------------------------------------------------------------------- harnesses
def get_lm_harness(backend: str, config: dict[str, Any], state: dict[str, np.ndarray]) -> Any:
    """The backend's LM harness holding the trained weights (``state``: HF keys, torch layouts, numpy)."""
    if backend == "torch":
        from .demo_lm_torch import TorchLmHarness

        return TorchLmHarness(config, state)
    if backend == "tf":
        from .demo_lm_tf import TfLmHarness

        return TfLmHarness(config, state)
    raise ValueError(f"unknown backend {backend!r}; allowed: {list(BACKENDS)}")


def installed_backends() -> list[str]:
    return [b for b in BACKENDS if importlib.util.find_spec(FRAMEWORK[b]) is not None]


def _decode_prompt(text: TextCorpus, p: LmProfile) -> np.ndarray:
    return text.held_out[: p.decode_tokens].astype(np.int64)


@contextlib.contextmanager
def _workdir(save_dir: str | None, backend: str) -> Iterator[str]:
    """``save_dir/backend`` (created, kept) or a temporary folder removed afterwards."""
    if save_dir is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
        return
    path = os.path.join(save_dir, backend)
    os.makedirs(path, exist_ok=True)
    yield path


def run_backend(backend: str, text: TextCorpus, p: LmProfile, state: dict[str, np.ndarray], seed: int,
                description: str, only: Sequence[str] | None = None, save_dir: str | None = None,
                log: Callable[[str], None] = print) -> LmResult:
    """Compress the trained model with every method on ``backend``, ship each one and measure the artifacts."""
    t0 = time.perf_counter()
    h = get_lm_harness(backend, p.llama_config(), state)
    windows = held_out_windows(text, p.seq, p.eval_windows)
    calib = calibration_windows(text, p, seed)
    res = LmResult(backend, description)
    artifacts = []
    with h.threads(1), _workdir(save_dir, backend) as tmp, warnings.catch_warnings():
        # 'default' leaving out the embedding is the intended selection here (said in the description)
        warnings.simplefilter("ignore", DefaultSkipWarning)
        row, art = h.ship_dense(windows, tmp)
        res.rows.append(row)
        artifacts.append(art)
        log(f"[{backend}] dense perplexity {row.ppl:.4f}")
        for m in methods(p.group_size):
            if only is not None and m.key not in only:
                continue
            row, art = h.run_method(m, calib, windows, tmp)
            res.rows.append(row)
            artifacts.append(art)
            log(f"[{backend}] {m.label}: perplexity {row.ppl:.4f} ({row.compress_s:.1f} s to compress)")
        times = h.decode_times(artifacts, _decode_prompt(text, p), p.decode_tokens, p.decode_rounds)
    if times is not None:
        for r, ts in zip(res.rows, times):
            r.decode_s = statistics.median(ts)
            r.decode_range = (min(ts), max(ts))
    res.notes.extend(h.notes)
    res.seconds = time.perf_counter() - t0
    return res


def train(text: TextCorpus, p: LmProfile, seed: int, log: Callable[[str], None] = print) -> dict[str, np.ndarray]:
    """Train the byte-level HF Llama on PyTorch; returns its state_dict as numpy arrays."""
    from .demo_lm_torch import train_byte_llama

    return train_byte_llama(p.llama_config(), training_windows(text, p, seed), p.batch, p.lr, seed, log=log)


def run_lm_demo(backends: Sequence[str], quick: bool = False, seed: int = 0, text_dir: str | None = None,
                only: Sequence[str] | None = None, save_dir: str | None = None,
                out: Callable[[str], None] = print) -> list[LmResult]:
    """Train, compress on every backend of ``backends``, print each table through ``out``; returns the results."""
    p = PROFILES[bool(quick)]
    text = load_corpus(text_dir)
    out(f"compressor demo --lm: {text.describe()}; backends: {', '.join(backends)}{' (quick)' if quick else ''}")
    t0 = time.perf_counter()
    state = train(text, p, seed, log=out)
    n_params = sum(int(v.size) for v in state.values())
    desc = (f"byte-level Llama, {p.layers} layer(s), width {p.hidden}, FFN {p.ffn}, {n_params:,} parameters, "
            f"{p.steps} AdamW steps of {p.batch} x {p.seq} bytes; decoder Linear layers compressed (embedding and "
            f"lm_head float32), {p.calib} calibration windows; perplexity on "
            f"{min(p.eval_windows, (len(text.held_out) - 1) // p.seq)} held-out windows of {p.seq} bytes")
    out(f"trained in {time.perf_counter() - t0:.1f} s")
    results = []
    for b in backends:
        r = run_backend(b, text, p, state, seed, desc, only=only, save_dir=save_dir, log=out)
        out(r.table())
        results.append(r)
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="compressor demo --lm", description=(
        "Train a small byte-level Llama on Python's standard library source (offline), compress it one-shot "
        "(SparseGPT 50 % and 2:4, Wanda 50 %, RTN / GPTQ / AWQ int4) on every installed backend, ship each "
        "result (torch: packed int4 / exported state_dict; Keras: .keras with Keras's int4 layers) and print "
        "perplexity, file size and decode latency of the shipped models."))
    p.add_argument("--backend", choices=("torch", "tf", "all"), default="all",
                   help="which backend to run (default: every installed one)")
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (a smoke test, seconds)")
    p.add_argument("--text-dir", help="train on the *.txt files of this folder (or .tar.gz) instead of the stdlib")
    p.add_argument("--methods", help=f"comma-separated subset of {METHODS} (default: all)")
    p.add_argument("--save-dir", metavar="DIR", help="keep the shipped files in DIR/<backend>/ (default: a "
                                                      "temporary folder, removed)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``compressor demo --lm``; returns the exit code (2 on bad input, one line on stderr)."""
    args = build_parser().parse_args(argv)
    installed = installed_backends()

    def fail(msg: str) -> int:
        print(f"compressor demo --lm: error: {msg}", file=sys.stderr)
        return 2

    backends = installed if args.backend == "all" else [args.backend]
    if not backends:
        return fail("neither torch nor tensorflow is installed (pip install 'compressor[torch,demo]')")
    missing = [b for b in backends if b not in installed]
    if missing:
        return fail(f"backend {missing[0]!r} needs {FRAMEWORK[missing[0]]}, which is not installed")
    for mod in ("torch", "transformers"):
        if importlib.util.find_spec(mod) is None:
            return fail(f"the language model is trained with PyTorch + transformers (also for --backend tf); "
                        f"{mod!r} is not installed (pip install 'compressor[torch,hf]')")
    only = None
    if args.methods:
        only = [m.strip() for m in args.methods.split(",") if m.strip()]
        bad = sorted(set(only) - set(METHODS))
        if bad or not only:
            return fail(f"--methods {args.methods!r}: unknown {bad}; allowed: {METHODS}")
    if args.text_dir is not None and not os.path.exists(args.text_dir):
        return fail(f"--text-dir {args.text_dir!r} does not exist")
    try:
        run_lm_demo(backends, args.quick, args.seed, args.text_dir, only, args.save_dir)
    except (FileNotFoundError, DataError) as e:
        return fail(str(e))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
