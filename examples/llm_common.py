"""The small language model of the one-shot reproduction (issue 25): byte-level Llama trained on Vim's help.

Protocol (``shared/data/text/README.md``): file names sorted, every file with index % 10 == 7 held out;
bytes are tokens (vocabulary 256). Model: Hugging Face ``LlamaForCausalLM``, 4 layers, width 256, FFN 768,
4 heads (3.5 M parameters), trained with AdamW on 16 x 256-byte windows of the training files. Held-out
perplexity: the mean next-byte cross entropy over consecutive 256-byte windows of the held-out text.

The trained weights are cached (``<workdir>/llama-bytes-seed<seed>-steps<steps>.pt``) so the compression rows reuse
them. The default cache directory is ``$COMPRESSOR_LLM_CACHE``, else ``out/llm`` under the repository root (ignored by
git); the examples and benchmarks that read the trained model look there by default.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from compressor.app.data import TextCorpus, byte_windows, load_text_corpus

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CORPUS = os.environ.get("COMPRESSOR_TEXT_CORPUS",
                                str(ROOT.parent / "shared" / "data" / "text" / "vim-help.tar.gz"))
#: where the trained weights are cached: $COMPRESSOR_LLM_CACHE, else out/llm under the repository root
DEFAULT_CACHE = os.environ.get("COMPRESSOR_LLM_CACHE", str(ROOT / "out" / "llm"))
#: the weights every example and benchmark reads by default (train seed 0, 260 steps)
DEFAULT_WEIGHTS = str(Path(DEFAULT_CACHE) / "llama-bytes-seed0-steps260.pt")
SEQ = 256
CONFIG = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5}


def corpus(path: str = DEFAULT_CORPUS) -> TextCorpus:
    return load_text_corpus(path)


def build_llama(seed: int = 0, **overrides: Any) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**CONFIG, **overrides})
    cfg._attn_implementation = "eager"
    return LlamaForCausalLM(cfg).eval()


def train_llama(text: TextCorpus, seed: int = 0, steps: int = 260, batch: int = 16, lr: float = 3e-3,
                log_every: int = 20, **overrides: Any) -> Any:
    """AdamW (weight decay 0.1), linear warm-up over 10 % of the steps then cosine decay to 10 % of ``lr``."""
    import torch

    model = build_llama(seed, **overrides).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, steps // 10)

    def lr_at(i: int) -> float:
        if i < warm:
            return lr * (i + 1) / warm
        t = (i - warm) / max(1, steps - warm)
        return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    data = byte_windows(text.train, steps * batch, SEQ + 1, seed=seed + 1000)
    t0 = time.perf_counter()
    for i in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(i)
        x = torch.from_numpy(data[i * batch:(i + 1) * batch])
        loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if log_every and (i % log_every == 0 or i == steps - 1):
            print(f"  step {i:4d}/{steps} loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    return model.eval()


def trained_llama(text: TextCorpus, workdir: str | os.PathLike, seed: int = 0, steps: int = 260) -> Any:
    """The trained model, from the cache when it is there (``torch.load`` of a state_dict, weights only)."""
    import torch

    path = Path(workdir) / f"llama-bytes-seed{seed}-steps{steps}.pt"
    model = build_llama(seed)
    if path.is_file():
        model.load_state_dict(torch.load(path, weights_only=True))
        return model.eval()
    model = train_llama(text, seed=seed, steps=steps)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(model.state_dict(), tmp)
    os.replace(tmp, path)
    return model


def held_out_windows(text: TextCorpus, seq: int = SEQ, limit: int | None = None) -> np.ndarray:
    """Consecutive non-overlapping windows of ``seq + 1`` bytes over the held-out text (int64)."""
    t = text.held_out
    n = (len(t) - 1) // seq
    if limit is not None:
        n = min(n, limit)
    return np.stack([t[i * seq:i * seq + seq + 1] for i in range(n)]).astype(np.int64)


def perplexity_torch(model: Any, windows: np.ndarray, batch: int = 32) -> float:
    """exp(mean next-byte cross entropy) over the windows (every position predicted once)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits.double()
            nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                    reduction="sum")
            total += float(nll)
            count += x[:, 1:].numel()
    return math.exp(total / count)


def calibration_windows(text: TextCorpus, count: int = 128, seed: int = 0) -> np.ndarray:
    """``count`` calibration windows of 256 bytes from the training files (int64 ``[count, 256]``)."""
    return byte_windows(text.train, count, SEQ, seed=seed + 7)
