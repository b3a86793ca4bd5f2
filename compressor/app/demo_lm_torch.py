"""The PyTorch part of ``compressor demo --lm`` (:mod:`compressor.app.demo_lm`): train the byte-level Hugging Face
Llama, compress it one-shot, ship it and measure the shipped model.

Shipping, and what the row measures (always the model reloaded from the saved file, in a fresh model):

* dense: ``torch.save`` of the float32 ``state_dict``;
* pruned: ``export_model(model_path, compressed_path=...)``: the plain ``state_dict`` (zeros in place, loaded
  into a fresh ``LlamaForCausalLM``) and the compressed file (kept values + positions, entropy coded), whose
  bytes are the row's size;
* quantized: :func:`~compressor.torch.quantization.lowbit.pack_weights` (int4 codes two per byte, PyTorch's
  int4 CPU kernel in bfloat16), ``torch.save`` of the packed ``state_dict``, loaded into a fresh model whose
  quantized layers are :class:`PackedLinear` skeletons of the same format.

Requires ``transformers`` (imported lazily).
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..torch.quantization.lowbit import PackedLinear, pack_weights

__all__ = ["TorchLmHarness", "build_byte_llama", "train_byte_llama", "perplexity"]


def build_byte_llama(config: dict[str, Any], seed: int = 0) -> nn.Module:
    """``LlamaForCausalLM(LlamaConfig(**config))`` with eager attention, seeded, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(**config)
    cfg._attn_implementation = "eager"
    model = LlamaForCausalLM(cfg).eval()
    # byte vocabulary: no end-of-sequence token stops a timed decode early; pad with byte 0
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def train_byte_llama(config: dict[str, Any], windows: np.ndarray, batch: int, lr: float, seed: int = 0,
                     log: Callable[[str], None] | None = None) -> dict[str, np.ndarray]:
    """AdamW (weight decay 0.1, betas 0.9 / 0.95), linear warm-up over 10 % of the steps then cosine decay to
    10 % of ``lr``, gradient norm clipped at 1; one step per ``batch`` rows of ``windows`` (``[steps * batch,
    seq + 1]``). Returns the trained ``state_dict`` as float32 numpy arrays (HF keys)."""
    steps = len(windows) // batch
    model = build_byte_llama(config, seed).train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, betas=(0.9, 0.95))
    warm = max(1, steps // 10)
    t0 = time.perf_counter()
    with _threads(1):
        for i in range(steps):
            t = (i - warm) / max(1, steps - warm)
            for g in opt.param_groups:
                g["lr"] = lr * (i + 1) / warm if i < warm else lr * (0.1 + 0.45 * (1 + math.cos(math.pi * t)))
            x = torch.from_numpy(windows[i * batch:(i + 1) * batch])
            loss = model(input_ids=x[:, :-1], labels=x[:, :-1]).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if log is not None and (i == steps - 1 or (i % 50 == 0 and i)):
                log(f"  train step {i + 1}/{steps}: loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)")
    return {k: v.detach().float().numpy().copy() for k, v in model.state_dict().items()}


@contextlib.contextmanager
def _threads(n: int | None) -> Any:
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def perplexity(model: nn.Module, windows: np.ndarray, batch: int = 16) -> float:
    """``exp`` of the mean next-token cross entropy over ``windows`` (``[n, seq + 1]``; logits in float64)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(windows), batch):
            x = torch.from_numpy(windows[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits.double()
            total += float(nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                       reduction="sum"))
            count += x[:, 1:].numel()
    return math.exp(total / count)


def _packed_skeleton(model: nn.Module, formats: dict[str, dict[str, Any]]) -> nn.Module:
    """Replace the named Linear layers of a fresh ``model`` by empty :class:`PackedLinear` of the given format."""
    for name, f in formats.items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, attr)
        setattr(parent, attr, PackedLinear(old.in_features, old.out_features, name=name, **f))
    return model


class TorchLmHarness:
    """Ship and measure one-shot compressed copies of a trained byte-level HF Llama (see the module docstring)."""

    name = "torch"

    def __init__(self, config: dict[str, Any], state: dict[str, np.ndarray]) -> None:
        import compressor.torch as backend

        self.backend = backend
        self.config = config
        self.state = {k: torch.from_numpy(np.asarray(v)) for k, v in state.items()}
        self.notes: list[str] = [
            "decode ms/token at this size is Python / Hugging Face overhead more than weight reads, so packing changes "
            "little here; int4 pays off where batch-1 decoding is memory-bound (benchmarks/RESULTS.md, packed int4: "
            "0.69x the fp32 ms/token on a 100 M-parameter Llama)"]

    def threads(self, n: int | None) -> Any:
        return _threads(n)

    def fresh(self) -> nn.Module:
        model = build_byte_llama(self.config)
        model.load_state_dict(self.state)
        return model

    def ship_dense(self, windows: np.ndarray, tmp: str) -> tuple[Any, nn.Module]:
        from .demo_lm_rows import LmRow

        path = os.path.join(tmp, "dense.pt")
        torch.save(self.fresh().state_dict(), path)
        model = build_byte_llama(self.config)
        model.load_state_dict(torch.load(path, weights_only=True))
        return LmRow("dense", "dense (float32)", perplexity(model, windows), None, os.path.getsize(path),
                     "float32 state_dict (torch.save)", kernel="dense: float32 nn.Linear", file="dense.pt"), model

    def compress(self, method: Any, calib: np.ndarray) -> tuple[nn.Module, list[Any], float]:
        """A fresh copy of the trained model compressed by ``method``'s steps; (model, compressors, seconds)."""
        model = self.fresh()
        data = torch.from_numpy(calib)
        batches = [data[i:i + 8] for i in range(0, len(data), 8)]
        t0 = time.perf_counter()
        done = []
        for cls, cfg in method.steps:
            c = getattr(self.backend, cls)(model, copy.deepcopy(list(cfg)))
            if cls == "RtnQuantizer":
                c.calibrate(progress=False)
            else:
                c.calibrate(batches, progress=False)
            done.append(c)
        return model, done, time.perf_counter() - t0

    def run_method(self, method: Any, calib: np.ndarray, windows: np.ndarray, tmp: str) -> tuple[Any, nn.Module]:
        from .demo_lm_rows import LmRow

        model, compressors, seconds = self.compress(method, calib)
        ppl_model = perplexity(model, windows)
        if method.kind == "prune":
            pt, cz = os.path.join(tmp, f"{method.key}.pt"), os.path.join(tmp, f"{method.key}.cz")
            compressors[-1].export_model(model_path=pt, compressed_path=cz)
            shipped = build_byte_llama(self.config)
            shipped.load_state_dict(torch.load(pt, weights_only=True))
            return LmRow(method.key, method.label, perplexity(shipped, windows), ppl_model, os.path.getsize(cz),
                         "compressed file (export_model compressed_path: kept values + positions)", seconds,
                         kernel="pruned: float32 nn.Linear with zeros (export_model state_dict)", file=os.path.basename(cz)), shipped
        pack_weights(model)  # int4 codes, two per byte; bfloat16 compute on PyTorch's int4 CPU kernel
        formats = {n: {"bits": m.bits, "group_size": m.group_size, "signed": m.signed, "bias": m.bias is not None,
                       "awq": m.awq_scales is not None, "compute_dtype": m.compute_dtype, "source": m.source}
                   for n, m in model.named_modules() if isinstance(m, PackedLinear)}
        path = os.path.join(tmp, f"{method.key}.pt")
        torch.save(model.state_dict(), path)
        shipped = _packed_skeleton(build_byte_llama(self.config), formats)
        shipped.load_state_dict(torch.load(path, weights_only=True))
        packed = [m for m in shipped.modules() if isinstance(m, PackedLinear)]
        kernels = sorted({m.kernel for m in packed})
        resident = sum(m.resident_bytes() for m in packed)
        self.notes.append(f"{method.label}: the {len(packed)} packed Linear layers hold {resident:,} B in memory "
                          f"(codes in the kernel's layout + scales) vs {4 * sum(m.in_features * m.out_features for m in packed):,} "
                          f"B as float32")
        return LmRow(method.key, method.label, perplexity(shipped, windows), ppl_model, os.path.getsize(path),
                     "packed state_dict (torch.save; int4 codes 2 per byte + group scales, the rest float32)",
                     seconds, kernel=f"int4: PackedLinear ({', '.join(kernels)} kernel, bfloat16 compute)",
                     file=os.path.basename(path)), shipped

    def decode_times(self, models: Sequence[nn.Module], prompt: np.ndarray, tokens: int,
                     rounds: int) -> list[list[float]]:
        """Seconds per generated token of each model (batch 1, greedy, KV cache), ``rounds`` interleaved rounds
        after one warm-up decode per model."""
        ids = torch.from_numpy(prompt[None])
        kw = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "pad_token_id": 0}
        times: list[list[float]] = [[] for _ in models]
        with torch.no_grad():
            for m in models:
                m.generate(ids, **kw)
            for _ in range(rounds):
                for i, m in enumerate(models):
                    t0 = time.perf_counter()
                    m.generate(ids, **kw)
                    times[i].append((time.perf_counter() - t0) / tokens)
        return times
