"""Step 3: one-shot compression on the GPU against the same run on the CPU.

SparseGPT at 50 %, GPTQ w4 g128 and AWQ w4 g128 on the tests' tiny Hugging Face Llama (random weights from a
config: vocabulary 64, 2 layers, 4 heads, 2 key/value heads; width and FFN from ``GPU_CHECK_LLAMA``, default
256,512 so that groups of 128 are real groups; no download). The same model and calibration tokens are
compressed twice with the default ``forward_dtype`` ('auto': float64 on the CPU, the model's float32 on the
GPU): once on the CPU, once with the model and the data on the device. Reported per method: how many mask /
code entries differ (total, fraction, worst layer), the perplexity of held-out tokens of both results (and of
the dense model) and their difference, and the wall time of each run.

Checks: at least ``GPU_CHECK_ONESHOT_MIN_SAME`` (default 0.995) of the entries equal in every layer, the
perplexities within ``GPU_CHECK_ONESHOT_MAX_PPL_REL`` (default 0.01, relative), the compressed model still on
the device. Dry run: width 64, fewer tokens, and the "device" run is a CPU run with ``forward_dtype='model'``
(float32), which is what 'auto' means on a GPU, so the comparison there is float32 against float64 too; AWQ
searches 5 grid points instead of 20.
"""

from __future__ import annotations

import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import Step, dry, env_float, run_step, sync  # noqa: E402

VOCAB = 64
METHODS: dict[str, tuple[str, dict[str, Any]]] = {
    "sparsegpt-50%": ("SparseGPTPruner", {"sparsity": 0.5}),
    "gptq-w4-g128": ("GptqQuantizer", {"quant_bits": 4, "group_size": 128}),
    "awq-w4-g128": ("AwqQuantizer", {"quant_bits": 4, "group_size": 128}),
}


def sizes() -> tuple[int, int, int, int, int]:
    """(hidden, ffn, calibration batches, sequence length, held-out sequences)."""
    raw = os.environ.get("GPU_CHECK_LLAMA", "")
    if raw.strip():
        hidden, ffn = (int(v) for v in raw.split(","))
    else:
        hidden, ffn = (64, 128) if dry() else (256, 512)
    return (hidden, ffn, 2, 16, 2) if dry() else (hidden, ffn, 4, 64, 8)


def llama(hidden: int, ffn: int, seq: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(64, seq))).eval()


def tokens(n: int, seq: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (4, seq), generator=g) for _ in range(n)]


def perplexity(model: torch.nn.Module, held: list[torch.Tensor], device: torch.device) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for ids in held:
            ids = ids.to(device)
            loss = model(input_ids=ids, labels=ids).loss
            n = ids.shape[0] * (ids.shape[1] - 1)
            total += float(loss) * n
            count += n
    return math.exp(total / count)


def compress(method: str, model: torch.nn.Module, data: list[torch.Tensor], forward_dtype: str) -> Any:
    import compressor.torch as ct

    cls_name, cfg = METHODS[method]
    if dry() and cls_name == "AwqQuantizer":
        cfg = {**cfg, "n_grid": 5}  # the dry run checks that the path works, not AWQ's search: 5 of its 20 points
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        c = getattr(ct, cls_name)(model, [{**cfg, "op_types": ["default"]}])
        c.calibrate(data, progress=False, forward_dtype=forward_dtype)
    return c


def entries(wrapper: Any) -> torch.Tensor:
    from compressor.torch.quantization.lowbit import oneshot_codes

    if hasattr(wrapper, "weight_mask"):
        return wrapper.weight_mask.detach()
    return oneshot_codes(wrapper)


def one_method(step: Step, method: str, device: torch.device) -> dict[str, Any]:
    hidden, ffn, n_calib, seq, n_held = sizes()
    calib, held = tokens(n_calib, seq, 1), tokens(n_held, seq, 99)
    dense = llama(hidden, ffn, seq)
    dense_ppl = perplexity(dense, held, torch.device("cpu"))

    t0 = time.perf_counter()
    cpu_model = llama(hidden, ffn, seq)
    cpu = compress(method, cpu_model, calib, "auto")
    cpu_s = time.perf_counter() - t0

    dev_fd = "model" if dry() else "auto"
    dev_model = llama(hidden, ffn, seq).to(device)
    sync(device)
    t0 = time.perf_counter()
    dev = compress(method, dev_model, [t.to(device) for t in calib], dev_fd)
    sync(device)
    dev_s = time.perf_counter() - t0

    wc = {w.name: w for w in cpu.get_modules_wrapper()}
    wd = {w.name: w for w in dev.get_modules_wrapper()}
    layers = {}
    total = differ = 0
    worst = (1.0, "")
    for name, a in wc.items():
        ea, eb = entries(a).cpu(), entries(wd[name]).cpu()
        d = int((ea != eb).sum())
        layers[name] = {"entries": ea.numel(), "differ": d}
        total += ea.numel()
        differ += d
        same = 1.0 - d / ea.numel()
        if same < worst[0]:
            worst = (same, name)
    on_device = all(t.device.type == device.type for t in [*dev_model.parameters(), *dev_model.buffers()])
    cpu_ppl = perplexity(cpu_model, held, torch.device("cpu"))
    dev_ppl = perplexity(dev_model, held, device)
    rel = abs(dev_ppl - cpu_ppl) / cpu_ppl
    rec = {"layers": len(wc), "entries": total, "differ": differ, "differ_fraction": differ / max(1, total),
           "worst_layer": worst[1], "worst_layer_same": round(worst[0], 6), "per_layer": layers,
           "ppl_dense": round(dense_ppl, 4), "ppl_cpu": round(cpu_ppl, 4), "ppl_device": round(dev_ppl, 4),
           "ppl_rel_diff": rel, "seconds_cpu": round(cpu_s, 2), "seconds_device": round(dev_s, 2),
           "forward_dtype_cpu": "auto (float64)", "forward_dtype_device": f"{dev_fd} (float32)",
           "model": {"hidden": hidden, "ffn": ffn, "vocab": VOCAB, "layers": 2, "calib": [n_calib, 4, seq]}}
    min_same = env_float("GPU_CHECK_ONESHOT_MIN_SAME", 0.995)
    max_rel = env_float("GPU_CHECK_ONESHOT_MAX_PPL_REL", 0.01)
    vs = "float32 run vs float64 run, both on cpu" if dry() else f"{device.type} vs cpu"
    step.check(f"{method}: >= {min_same:.1%} of the entries equal in every layer ({vs})",
               worst[0] >= min_same, f"{differ} of {total} differ ({differ / max(1, total):.3%}); worst "
                                     f"{worst[1] or '-'} {worst[0]:.4%} equal")
    step.check(f"{method}: perplexity within {max_rel:.1%} of the CPU run",
               rel <= max_rel, f"ppl cpu {cpu_ppl:.4f}, device run {dev_ppl:.4f} (rel {rel:.2e}); dense "
                               f"{dense_ppl:.4f}; {cpu_s:.1f} s cpu, {dev_s:.1f} s device run")
    step.check(f"{method}: the compressed model stays on {device.type}", on_device)
    return rec


def body(step: Step) -> None:
    device = torch.device(step.device)
    for method in METHODS:
        with step.guard(f"{method}: runs on {device.type} and on cpu"):
            step.results[method] = one_method(step, method, device)


if __name__ == "__main__":
    raise SystemExit(run_step("step3_oneshot", "one-shot SparseGPT / GPTQ / AWQ on the device vs the CPU", body))
