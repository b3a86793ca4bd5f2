"""Step 4: the packed int4 / int8 linear layers and 2:4 semi-structured sparsity against dense bf16.

One ``K x N`` layer (default 4096 x 4096; ``GPU_CHECK_KERNEL_SIZE``) at ``M`` rows of input (default 1, 16, 256;
``GPU_CHECK_KERNEL_M``), all in one run, the variants interleaved in rounds:

* ``dense-bf16``: ``nn.Linear`` in bfloat16 with the dequantized int4 weight (the baseline of every ratio);
* ``packed-int4-g128``: :class:`compressor.torch.PackedLinear` from signed int4 codes, groups of 128, bf16
  compute (``pack_weights``' default), built on the device; its ``kernel`` says what runs there;
* ``packed-int8``: the same with per-channel int8 codes;
* ``semi-structured-2:4``: the dense weight pruned 2:4 by ``LevelPruner(sparse_pattern='2:4')`` and converted by
  :func:`compressor.torch.to_semi_structured` (bf16; CUDA only);
* ``aten-int4-tinygemm`` / ``aten-int8-wo`` (CUDA, for comparison only, not checked): PyTorch's own CUDA weight-only
  kernels (``_weight_int4pack_mm``, ``_weight_int8pack_mm``) on the same codes, what a CUDA path of
  PackedLinear could call.

Timings: CUDA events around ``GPU_CHECK_KERNEL_CALLS`` back-to-back calls, ``GPU_CHECK_KERNEL_ROUNDS`` rounds;
the ratio is the median over rounds of (variant / dense-bf16 of the same round). Checks: each compressor layer's
output within 2e-2 (of max |y|) of the float32 product with its dequantized / masked weight. Dry run: a 256 x 256
layer at M = 1, 16 on the CPU (PackedLinear then runs PyTorch's CPU kernels), and ``to_semi_structured`` must
refuse the CPU with an error naming CUDA.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import Step, dry, env_int, median, run_step, short_error, sync, time_calls  # noqa: E402
from torch import nn  # noqa: E402

TOL = 2e-2
GROUP = 128


def settings() -> tuple[int, list[int], int, int]:
    size = env_int("GPU_CHECK_KERNEL_SIZE", 256 if dry() else 4096)
    raw = os.environ.get("GPU_CHECK_KERNEL_M", "")
    ms = [int(v) for v in raw.split(",")] if raw.strip() else ([1, 16] if dry() else [1, 16, 256])
    return size, ms, env_int("GPU_CHECK_KERNEL_ROUNDS", 3 if dry() else 15), env_int("GPU_CHECK_KERNEL_CALLS",
                                                                                      2 if dry() else 50)


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


def int4_codes(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Signed int4 codes ``[n, k]``, scales ``[n, k / 128]`` and the dequantized float32 weight."""
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, k // GROUP, generator=g) * 0.02 + 0.005
    w = codes.float() * scale.repeat_interleave(GROUP, 1)
    return codes.to(device), scale.to(device), w.to(device)


def int8_codes(n: int, k: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int32)
    scale = torch.rand(n, 1, generator=g) * 1e-3 + 2e-4
    return codes.to(device), scale.to(device), (codes.float() * scale).to(device)


def aten_int4(codes: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """PyTorch's CUDA int4 weight-only kernel (tinygemm layout: ``(q - 8) * s + z`` per group) on our codes."""
    u = (codes + 8).to(torch.int32)
    packed = (u[:, ::2] << 4 | u[:, 1::2]).to(torch.uint8)
    wq = torch.ops.aten._convert_weight_to_int4pack(packed.contiguous(), 8)
    sz = torch.stack([scale, torch.zeros_like(scale)], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return lambda x: torch.ops.aten._weight_int4pack_mm(x, wq, GROUP, sz)


def aten_int8(codes: torch.Tensor, scale: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    wq = codes.to(torch.int8).contiguous()
    s = scale.reshape(-1).to(torch.bfloat16).contiguous()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, wq, s)


def build(step: Step, device: torch.device, size: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """name -> (fn(x_bf16) -> y, float32 weight whose product is the reference); plus notes per variant."""
    from compressor.torch import LevelPruner, PackedLinear, to_semi_structured
    from compressor.torch.pruning.export import unwrapped_model

    n = k = size
    variants: dict[str, Any] = {}
    notes: dict[str, Any] = {}
    c4, s4, w4 = int4_codes(n, k, device)
    dense = nn.Linear(k, n, bias=False).to(device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        dense.weight.copy_(w4)
    variants["dense-bf16"] = (dense, w4.to(torch.bfloat16).float())
    with step.guard("packed-int4-g128: builds on the device"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        p4 = PackedLinear.from_codes(c4.to(torch.int8), s4, torch.zeros_like(s4, dtype=torch.int32), 4, GROUP,
                                     compute_dtype=torch.bfloat16, name="int4")
        variants["packed-int4-g128"] = (p4, w4)
        notes["packed-int4-g128"] = {"kernel": p4.kernel, "kernel_note": p4.kernel_note,
                                     "warnings": [str(w.message)[:200] for w in warned]}
    c8, s8, w8 = int8_codes(n, k, device)
    with step.guard("packed-int8: builds on the device"), warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        p8 = PackedLinear.from_codes(c8.to(torch.int8), s8, torch.zeros_like(s8, dtype=torch.int32), 8, None,
                                     compute_dtype=torch.bfloat16, name="int8")
        variants["packed-int8"] = (p8, w8)
        notes["packed-int8"] = {"kernel": p8.kernel, "kernel_note": p8.kernel_note,
                                "warnings": [str(w.message)[:200] for w in warned]}
    # 2:4: the dense weight pruned by the pruner, converted for the sparse tensor cores
    model = nn.Sequential(nn.Linear(k, n, bias=False)).to(device)
    with torch.no_grad():
        model[0].weight.copy_(w4)
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_types": ["Linear"]}])
    pruner.compress()
    masked = unwrapped_model(model)[0].weight.detach().float().clone()
    if device.type == "cuda":
        with step.guard("semi-structured-2:4: converts on CUDA"):
            sparse = to_semi_structured(pruner, dtype=torch.bfloat16)
            kind = type(sparse[0].weight).__name__
            step.check("semi-structured-2:4: the weight is a semi-structured sparse tensor",
                       kind.startswith("SparseSemiStructured"), kind)
            variants["semi-structured-2:4"] = (sparse, masked.to(torch.bfloat16).float())
            notes["semi-structured-2:4"] = {"weight": kind}
        for name, make, codes, scale, w in (("aten-int4-tinygemm", aten_int4, c4, s4, w4),
                                            ("aten-int8-wo", aten_int8, c8, s8, w8)):
            try:
                variants[name] = (make(codes, scale), w)
                notes[name] = {"note": "PyTorch's CUDA kernel, not used by compressor; not checked"}
            except Exception as e:  # noqa: BLE001 - reported only
                notes[name] = {"error": short_error(e, frames=2)}
    else:
        from compressor import ModelError

        try:
            to_semi_structured(pruner, dtype=torch.bfloat16)
            refused = "converted on a CPU"
        except ModelError as e:
            refused = str(e)
        step.check("semi-structured-2:4: refused without CUDA, naming CUDA", "CUDA" in refused, refused[:160])
    return variants, notes


def body(step: Step) -> None:
    device = torch.device(step.device)
    size, ms, rounds, calls = settings()
    variants, notes = build(step, device, size)
    step.results.update({"size": [size, size], "m": ms, "rounds": rounds, "calls": calls, "notes": notes})
    checked = {"packed-int4-g128", "packed-int8", "semi-structured-2:4"}
    table: dict[str, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(2)
    for m in ms:
        x = (torch.randn(m, size, generator=g)).to(device=device, dtype=torch.bfloat16)
        live = {}
        for name, (fn, w) in variants.items():
            try:
                with torch.no_grad():
                    y = fn(x)
                    ref = x.float() @ w.t()
                err = rel_err(y, ref)
                if name in checked:
                    step.check(f"{name} at M={m}: output within {TOL:g} of the float product", err <= TOL,
                               f"max rel err {err:.2e}")
                live[name] = fn
                table.setdefault(name, {})[f"M={m}"] = {"max_rel_err": err}
            except Exception as e:  # noqa: BLE001 - a kernel that cannot run this shape
                table.setdefault(name, {})[f"M={m}"] = {"error": short_error(e, frames=2)}
                if name in checked:
                    step.check(f"{name} at M={m}: runs", False, short_error(e, frames=3))
        times: dict[str, list[float]] = {k: [] for k in live}
        ratios: dict[str, list[float]] = {k: [] for k in live}
        with torch.no_grad():
            for fn in live.values():  # warm-up
                time_calls(lambda fn=fn, x=x: fn(x), device, 2)
            for r in range(rounds):
                order = list(live)[r % len(live):] + list(live)[:r % len(live)]
                got = {name: time_calls(lambda fn=live[name], x=x: fn(x), device, calls) for name in order}
                for name, t in got.items():
                    times[name].append(t)
                    ratios[name].append(t / got["dense-bf16"])
        sync(device)
        for name in live:
            cell = table[name][f"M={m}"]
            cell["us_per_call"] = round(median(times[name]) * 1e6, 2)
            cell["vs_dense_bf16"] = round(median(ratios[name]), 3)
        step.say(f"M={m}: " + ", ".join(f"{k} {table[k][f'M={m}']['us_per_call']:.1f} us "
                                        f"({table[k][f'M={m}']['vs_dense_bf16']:.2f}x)" for k in live))
    step.results["table"] = table
    for name, note in notes.items():
        if "kernel" in note:
            step.say(f"{name}: kernel {note['kernel']!r} ({note['kernel_note']})")
        elif "error" in note:
            step.say(f"{name}: not available: {note['error']}")


if __name__ == "__main__":
    raise SystemExit(run_step("step4_kernels", "packed int4 / int8 and 2:4 layers vs dense bf16", body))
