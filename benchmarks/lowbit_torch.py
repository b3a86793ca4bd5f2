"""Packed int4 / int8 weights on PyTorch's CPU kernels vs float32 (issue 26), one thread, interleaved rounds.

1. One 2048 x 2048 Linear at M = 1 and M = 64 tokens: ``fp32`` (``nn.Linear``), ``int4-g128`` (PackedLinear,
   ``_weight_int4pack_mm_for_cpu``, bf16 compute), ``int8-wo`` (per-channel int8 weight-only,
   ``_weight_int8pack_mm``, bf16), ``int8-dyn`` (int8 activations x int8 weights, ``quantized.linear_dynamic``),
   and ``int4-g128-f32`` (the same int4 kernel with float32 activations) at M = 1 only (at M = 64 it takes
   over a second: the kernel's float32 path is a scalar loop). Codes: round to nearest of a random weight.
   ``max rel`` is max|y - y_dequant| / max|y_dequant| against float64 with the dequantized weight.
2. Whole models: the trained byte-level Llama of the one-shot reproduction (``examples/llm_common.py``, 3.5 M
   parameters, from ``--trained``, else ``$COMPRESSOR_TRAINED_LM``, else ``llama-bytes-seed0-steps260.pt`` in
   ``$COMPRESSOR_LLM_CACHE`` or ``out/llm`` under the repository root, where examples.reproduce_llm caches it)
   and a random-weight Llama of ~100 M parameters (width 768, FFN 2048, 12 layers, vocabulary 8192). Every
   Linear inside the blocks is quantized (RTN; the embedding and the head stay float, as the one-shot
   quantizers leave them) and packed. Resident weight bytes (parameters, buffers and the packed kernel
   tensors), next-token latency at batch 1 with the KV cache (after a 32-token prompt) and
   a 512-token prefill (batch 1), each vs float32 in the same rounds.
3. Every M (``sweep_table``): the 2048 x 2048 Linear at M = 1 .. 512 rows, packed int4 / int8 computing in bf16
   against a bf16 ``nn.Linear`` and int4 computing in float32 against float32, as PackedLinear picks its path
   (``auto``: the kernel below ``DEQUANT_ROWS``, the dequantized weight and the float matmul above), and with each
   path forced, as ratios to the float layer in the same interleaved rounds; ``int8-dyn`` (int8 activations per
   token x int8 weights, float32 in and out) against the bf16 layer too.

    python benchmarks/lowbit_torch.py [--rounds 5] [--skip-models] [--sweep-only] [--trained PATH]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
import warnings
from collections import Counter
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._interleave import interleaved_medians  # noqa: E402
from compressor.core.oneshot import QuantSpec, rtn_quantize  # noqa: E402
from compressor.torch import PackedLinear, RtnQuantizer, pack_weights  # noqa: E402

#: the trained weights: $COMPRESSOR_LLM_CACHE (default: out/llm under the repository root) / the cached file's name
TRAINED = str(Path(os.environ.get("COMPRESSOR_LLM_CACHE", Path(__file__).resolve().parent.parent / "out" / "llm"))
              / "llama-bytes-seed0-steps260.pt")


def packed_from(weight: torch.Tensor, bits: int, group: int | None, **kw) -> PackedLinear:
    q = rtn_quantize(weight.double().numpy(), QuantSpec(bits, True, group))
    codes = torch.from_numpy(q.codes).to(torch.int32)
    return PackedLinear.from_codes(codes, torch.from_numpy(q.scale).float(), torch.from_numpy(q.zero_point).to(
        torch.int32), bits, group, bias=None, **kw)


def layer_table(rounds: int) -> list[str]:
    torch.manual_seed(0)
    lin = nn.Linear(2048, 2048, bias=False)
    w = lin.weight.detach()
    variants = {"fp32": lin, "int4-g128": packed_from(w, 4, 128), "int8-wo": packed_from(w, 8, None),
                "int8-dyn": packed_from(w, 8, None, activation="dynamic"),
                "int4-g128-f32": packed_from(w, 4, 128, compute_dtype=torch.float32)}
    rows = ["| variant | kernel | M=1 ms | vs fp32 | M=64 ms | vs fp32 | max rel (M=64) |", "|---|---|---|---|---|---|---|"]
    med: dict = {}
    for m in (1, 64):
        x = torch.randn(m, 2048)
        fns = {(k, m): (lambda mod=mod, x=x: mod(x)) for k, mod in variants.items()
               if not (k == "int4-g128-f32" and m == 64)}
        with torch.no_grad():
            med.update(interleaved_medians(fns, rounds=rounds, calls=20 if m == 1 else 3))
    x = torch.randn(64, 2048)
    with torch.no_grad():
        for k, mod in variants.items():
            if k == "fp32":
                err, kernel = "0 (reference)", "mkl sgemm"
            else:
                ref = x.double() @ mod.dequantized_weight(torch.float64).T
                err = f"{float((mod(x).double() - ref).abs().max() / ref.abs().max()):.1e}"
                kernel = mod.kernel + ("" if mod.kernel == "int8-dynamic" else f" ({str(mod.compute_dtype)[6:]})")
            m64 = med.get((k, 64))
            rows.append(f"| {k} | {kernel} | {med[(k, 1)] * 1e3:.3f} | {med[(k, 1)] / med[('fp32', 1)]:.2f}x | "
                        + (f"{m64 * 1e3:.2f} | {m64 / med[('fp32', 64)]:.2f}x" if m64 else "not run | -")
                        + f" | {err} |")
    return rows


def sweep_table(rounds: int, sizes: tuple[int, ...] = (1, 4, 16, 32, 64, 128, 256, 512)) -> list[str]:
    """Packed layers against the float layer in the same dtype at every number of input rows M (tokens): one
    2048 x 2048 Linear, RTN codes. ``auto``: PackedLinear as it runs (the kernel below ``DEQUANT_ROWS``, else the
    dequantized weight and the float matmul); ``kernel``: the kernel at every M (``dequant_rows=None``);
    ``dequant``: the float path at every M (``dequant_rows=1``). bf16 against a bf16 ``nn.Linear``; float32
    against float32 (``compute_dtype=torch.float32``)."""
    torch.manual_seed(0)
    lin = nn.Linear(2048, 2048, bias=False)
    w = lin.weight.detach()
    lin16 = copy.deepcopy(lin).to(torch.bfloat16)
    mods = {}
    for name, bits, group, dt in (("int4-g128", 4, 128, torch.bfloat16), ("int8-wo", 8, None, torch.bfloat16),
                                  ("int4-g128-f32", 4, 128, torch.float32), ("int8-wo-f32", 8, None, torch.float32)):
        for mode, rows in (("auto", "default"), ("kernel", None), ("dequant", 1)):
            m = packed_from(w, bits, group, compute_dtype=dt)
            if rows != "default":
                m.dequant_rows = rows
            mods[(name, mode)] = m
    dyn = packed_from(w, 8, None, activation="dynamic")  # int8 x int8 (fbgemm), activations per token
    med: dict = {}
    for m_rows in sizes:
        x32 = torch.randn(m_rows, 2048)
        x16 = x32.to(torch.bfloat16)
        fns = {("bf16", m_rows): (lambda x=x16: lin16(x)), ("fp32", m_rows): (lambda x=x32: lin(x)),
               ("int8-dyn", "auto", m_rows): (lambda x=x32: dyn(x))}
        for (name, mode), mod in mods.items():
            if name.endswith("f32") and mode == "kernel" and m_rows > 4:
                continue  # the float32 kernel is a scalar loop: seconds at these sizes
            x = x32 if name.endswith("f32") else x16
            fns[(name, mode, m_rows)] = (lambda mod=mod, x=x: mod(x))
        calls = 20 if m_rows <= 4 else (5 if m_rows <= 64 else 2)
        with torch.no_grad():
            med.update(interleaved_medians(fns, rounds=rounds, calls=calls))
    head = "| variant | path | " + " | ".join(f"M={m}" for m in sizes) + " |"
    rows = [head, "|---|---|" + "---|" * len(sizes)]
    rows.append("| bf16 nn.Linear | mkldnn | " + " | ".join(f"{med[('bf16', m)] * 1e3:.2f} ms" for m in sizes) + " |")
    rows.append("| fp32 nn.Linear | mkl | " + " | ".join(f"{med[('fp32', m)] * 1e3:.2f} ms" for m in sizes) + " |")
    for name, mode in [*mods, ("int8-dyn", "auto")]:
        base = "fp32" if name.endswith("f32") else "bf16"
        cells = [f"{med[(name, mode, m)] / med[(base, m)]:.2f}x" if (name, mode, m) in med else "not run"
                 for m in sizes]
        rows.append(f"| {name} | {mode} | " + " | ".join(cells) + " |")
    return rows


# ------------------------------------------------------------------------------------------------ models
def random_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=12,
                      num_attention_heads=12, num_key_value_heads=12, max_position_embeddings=1024,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def trained_llama(path: str):
    from examples.llm_common import build_llama

    model = build_llama(0, max_position_embeddings=1024)
    model.load_state_dict(torch.load(path, weights_only=True))
    return model.eval()


def resident_bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total + sum(m.resident_bytes() - sum(t.numel() * t.element_size() for t in
                                                [*m.parameters(recurse=False), *m.buffers(recurse=False)])
                       for m in model.modules() if isinstance(m, PackedLinear))


def packed_variant(model: nn.Module, bits: int, group: int | None, activation: str | None = None) -> nn.Module:
    m = copy.deepcopy(model)
    cfg = {"quant_bits": bits, "op_types": ["Linear"]}
    if group:
        cfg["group_size"] = group
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        RtnQuantizer(m, [cfg]).calibrate(progress=False)
        pack_weights(m, activation=activation)
    return m


def decode_fn(model: nn.Module, prompt: torch.Tensor, steps: int):
    def run() -> None:
        out = model(prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        run.t = 0.0
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        run.t = (time.perf_counter() - t0) / steps
    return run


def model_table(name: str, model: nn.Module, rounds: int, prefill: int) -> list[str]:
    variants = {"fp32": model, "int4-g128": packed_variant(model, 4, 128), "int8-wo": packed_variant(model, 8, None),
                "int8-dyn": packed_variant(model, 8, None, "dynamic")}
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (1, 32), generator=g)
    long = torch.randint(0, vocab, (1, prefill), generator=g)
    dec = {k: decode_fn(m, prompt, 8) for k, m in variants.items()}
    times: dict = {k: [] for k in variants}
    with torch.no_grad():
        ref = model(long).logits
        agree = {k: float((m(long).logits.argmax(-1) == ref.argmax(-1)).float().mean()) for k, m in variants.items()}
        for k in variants:  # warm-up
            dec[k]()
        for _ in range(rounds):  # decode: time only the cached steps (the prompt's prefill is outside the clock)
            for k in sorted(variants, key=lambda _k: hash((_k, _))):
                dec[k]()
                times[k].append(dec[k].t)
        pre = interleaved_medians({k: (lambda m=m: m(long)) for k, m in variants.items()}, rounds=max(2, rounds // 2),
                                  calls=1, warmup=1)
    d = {k: statistics.median(v) for k, v in times.items()}
    b = {k: resident_bytes(m) for k, m in variants.items()}
    kernels = {k: Counter(m.kernel for m in v.modules() if isinstance(m, PackedLinear)) for k, v in variants.items()}
    n_params = sum(p.numel() for p in model.parameters())
    rows = [f"**{name}** ({n_params / 1e6:.1f} M parameters; prefill {prefill} tokens)", "",
            "| variant | kernels | resident weights MB | vs fp32 | next token ms | vs fp32 | prefill s | vs fp32 | "
            "argmax agreement vs fp32 |", "|---|---|---|---|---|---|---|---|---|"]
    for k in variants:
        ks = ", ".join(f"{n} {c}" for c, n in kernels[k].items()) or "-"
        rows.append(f"| {k} | {ks} | {b[k] / 1e6:.1f} | {b[k] / b['fp32']:.2f}x | {d[k] * 1e3:.2f} | "
                    f"{d[k] / d['fp32']:.2f}x | {pre[k]:.3f} | {pre[k] / pre['fp32']:.2f}x | {agree[k]:.1%} |")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--skip-models", action="store_true")
    ap.add_argument("--sweep-only", action="store_true", help="only the every-M table (implies --skip-models)")
    ap.add_argument("--trained", default=os.environ.get("COMPRESSOR_TRAINED_LM", TRAINED))
    ap.add_argument("--prefill", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers: past_key_values renamed
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, 1 thread, "
          f"quantized engine {torch.backends.quantized.engine}, {args.rounds} interleaved rounds\n")
    if not args.sweep_only:
        print("### One 2048 x 2048 Linear\n")
        print("\n".join(layer_table(args.rounds)))
    print("\n### Every M: packed vs the float layer in the same dtype (ratios; float rows in ms)\n")
    print("\n".join(sweep_table(args.rounds)))
    if args.skip_models or args.sweep_only:
        return
    print("\n### Whole models (RTN codes of every Linear in the blocks; embedding and head float32)\n")
    if Path(args.trained).is_file():
        print("\n".join(model_table("trained byte-level Llama", trained_llama(args.trained), args.rounds,
                                    args.prefill)))
    else:
        print(f"trained model skipped: {args.trained} not found (examples/reproduce_llm.py writes it)")
    print()
    print("\n".join(model_table("random-weight Llama", random_llama(), max(3, args.rounds // 2), args.prefill)))


if __name__ == "__main__":
    main()
