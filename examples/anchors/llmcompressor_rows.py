"""Anchor rows for examples/reproduce_llm.py: llmcompressor 0.14 on the same trained weights.

Runs in its OWN environment (never a project dependency; compressor is not imported here):

    python -m venv .venv-llmc && .venv-llmc/bin/pip install "torch==2.13.0" "llmcompressor==0.14.*"
    .venv-llmc/bin/python examples/anchors/llmcompressor_rows.py --state W.pt --corpus vim-help.tar.gz \
        --methods sparsegpt50,wanda50,gptq_w4g128 --seed 0

(run from the repository root: ``.venv-*/`` is ignored by git; the benchmarks look for this interpreter at
``.venv-llmc/bin/python`` unless told otherwise).

The corpus split, the calibration windows (numpy default_rng(seed + 7), 128 x 256 bytes of the training
files) and the held-out windows are computed exactly as examples/llm_common.py does, so both sides see the
same data. Prints one JSON object per method: {"method", "ppl", "seconds"}.
"""

from __future__ import annotations

import argparse
import json
import math
import tarfile
import tempfile
import time

import numpy as np
import torch

SEQ = 256
CONFIG = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
          "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": SEQ,
          "tie_word_embeddings": False, "rms_norm_eps": 1e-5}
# NOT "lm_head": SparseGPT / Wanda in llmcompressor 0.14 name each module "<target layer>.<sub name>"; with
# targets ["Linear"] every Linear is its own target layer, so lm_head is checked as "lm_head." and a plain
# "lm_head" in ignore does not match it: lm_head was pruned to 50 % (8.7824 vs 8.6626 on our weights). The
# regex form matches both that name and the quantization modifiers' "lm_head".
IGNORE = ["re:.*lm_head"]


def split(path: str) -> tuple[np.ndarray, np.ndarray]:
    with tarfile.open(path, "r:*") as tar:
        files = {m.name.rsplit("/", 1)[-1]: tar.extractfile(m).read() for m in tar.getmembers()
                 if m.isfile() and m.name.endswith(".txt")}
    names = sorted(files)
    held = [n for i, n in enumerate(names) if i % 10 == 7]
    train = [n for n in names if n not in set(held)]
    cat = lambda ns: np.frombuffer(b"".join(files[n] for n in ns), dtype=np.uint8)  # noqa: E731
    return cat(train), cat(held)


def windows(tokens: np.ndarray, count: int, length: int, seed: int) -> np.ndarray:
    starts = np.random.default_rng(seed).integers(0, len(tokens) - length, size=count)
    return np.stack([tokens[s:s + length] for s in starts]).astype(np.int64)


def model_from(state: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**CONFIG)
    cfg._attn_implementation = "eager"
    m = LlamaForCausalLM(cfg)
    m.load_state_dict(torch.load(state, weights_only=True))
    # llmcompressor reads the config back from model.config.name_or_path: give it a local checkpoint
    d = tempfile.mkdtemp(prefix="llmc-anchor-")
    m.save_pretrained(d)
    m = LlamaForCausalLM.from_pretrained(d, attn_implementation="eager")
    return m.eval()


def ppl(model, held: np.ndarray, batch: int = 32) -> float:
    n = (len(held) - 1) // SEQ
    w = np.stack([held[i * SEQ:i * SEQ + SEQ + 1] for i in range(n)]).astype(np.int64)
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(w), batch):
            x = torch.from_numpy(w[i:i + batch])
            logits = model(input_ids=x[:, :-1]).logits.double()
            total += float(torch.nn.functional.cross_entropy(logits.reshape(-1, 256), x[:, 1:].reshape(-1),
                                                             reduction="sum"))
            count += x[:, 1:].numel()
    return math.exp(total / count)


def recipe(method: str):
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.obcq import SparseGPTModifier
    from llmcompressor.modifiers.pruning import WandaPruningModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier

    targets = ["Linear"]
    if method.startswith("sparsegpt") or method.startswith("wanda"):
        cls = SparseGPTModifier if method.startswith("sparsegpt") else WandaPruningModifier
        tail = method.split("sparsegpt" if method.startswith("sparsegpt") else "wanda")[1]
        if tail == "24":
            return cls(sparsity=0.5, mask_structure="2:4", targets=targets, ignore=IGNORE)
        return cls(sparsity=int(tail) / 100, mask_structure="0:0", targets=targets, ignore=IGNORE)
    if method.startswith("gptq_w") or method.startswith("rtn_w"):
        # "gptq_w4g128": llmcompressor's defaults (actorder "static"); "gptq_w4g128-noact": actorder None,
        # the column order ours uses (for a like-for-like comparison)
        method, noact = method.removesuffix("-noact"), method.endswith("-noact")
        bits = int(method.split("_w")[1].split("g")[0])
        scheme = {"4": "W4A16", "8": "W8A16"}.get(str(bits))
        if scheme is None:  # w3: a custom scheme
            scheme_kw = {"config_groups": {"g0": {"targets": targets, "weights": {
                "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}}
        else:
            scheme_kw = {"scheme": scheme, "targets": targets}
        if method.startswith("gptq"):
            return GPTQModifier(ignore=IGNORE, **scheme_kw, **({"actorder": None} if noact else {}))
        return QuantizationModifier(ignore=IGNORE, **scheme_kw)
    if method.startswith("awq_w4"):
        return [AWQModifier(ignore=IGNORE, scheme="W4A16", targets=targets)]
    raise SystemExit(f"unknown method {method!r}")


class _NoText:
    """Stands in for a tokenizer: the calibration batches are already token ids (bytes), nothing to encode."""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--methods", default="sparsegpt50")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--samples", type=int, default=128)
    a = p.parse_args()
    torch.set_num_threads(1)
    if not torch.cuda.is_available():
        # llmcompressor 0.14's AWQ pins its cached activations (pin_memory), which a CPU-only torch refuses
        # ("Cannot access accelerator device"); on CPU pinning has nothing to do: the identity here
        torch.Tensor.pin_memory = lambda self, *args, **kwargs: self
    from llmcompressor import oneshot

    train, held = split(a.corpus)
    calib = windows(train, a.samples, SEQ, a.seed + 7)
    # a DataLoader of ready token batches: no tokenizer / processor needed (bytes are the tokens)
    rows = [{"input_ids": torch.from_numpy(c), "attention_mask": torch.ones(len(c), dtype=torch.long)} for c in calib]
    ds = torch.utils.data.DataLoader(rows, batch_size=1)
    if a.methods == "dense":
        print(json.dumps({"method": "dense", "ppl": ppl(model_from(a.state), held), "seconds": 0.0}), flush=True)
        return
    for method in a.methods.split(","):
        model = model_from(a.state)
        before = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        t0 = time.perf_counter()
        oneshot(model=model, dataset=ds, recipe=recipe(method), num_calibration_samples=a.samples, processor=_NoText(),
                max_seq_length=SEQ, pad_to_max_length=False)
        sec = time.perf_counter() - t0
        # what it compressed: Linear layers whose weight changed (pruning, GPTQ) or that carry a quantization
        # scheme (RTN / AWQ fake-quantize in forward), to check lm_head was left alone
        done = sorted(n for n, m in model.named_modules() if n in before and (
            getattr(m, "quantization_scheme", None) is not None or not torch.equal(m.weight, before[n])))
        print(json.dumps({"method": method, "ppl": ppl(model, held), "seconds": sec, "compressed": len(done),
                          "lm_head_compressed": "lm_head" in done}), flush=True)


if __name__ == "__main__":
    main()
