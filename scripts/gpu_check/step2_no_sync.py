"""Step 2: no host synchronisation inside a training step, for every pruner and quantizer that trains.

Each wrapper (the training-time pruners: level, AGP, the filter pruners L1 / L2 / FPGM / APoZ / mean activation /
Taylor, Slim, lottery ticket; the quantizers QAT, LSQ, DoReFa, BNN, naive) wraps a small CNN with BatchNorm on
the device, with an SGD optimizer. Then:

1. ``torch.cuda.set_sync_debug_mode('error')`` around three training steps (AGP: an epoch update before each, so
   its masks are recomputed inside; the statistics pruners collect and decide inside too; the quantizers get
   one step before, where they set their scales up, as in the CUDA tests) and an eval forward: any
   ``.item()``, ``bool(tensor)``, blocking copy to the host ... raises, and the error (with where it was
   called) is the check's detail;
2. ``torch.profiler`` around one more step: the trace must hold no device-to-host copy (``Memcpy DtoH``: this
   also catches the non-blocking copies sync debug mode lets through). The count of host reads of a tensor
   (``aten::_local_scalar_dense``, what ``.item()`` runs) is reported too.

Dry run (CPU): the same wrappers and steps on the CPU, without sync debug mode (there is no device to wait for)
and with a CPU-only profile; the host reads are reported, not checked (CPU-only code paths may read scalars).
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch  # noqa: E402
from common import Step, no_host_sync, run_step, short_error, sync  # noqa: E402
from torch import nn  # noqa: E402

STEPS_CHECKED = 3


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 16, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 16, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(16)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.fc = nn.Linear(16 * 4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.bn1(self.conv1(x)))
        x = torch.relu(self.bn2(self.conv2(x)))
        return self.fc(self.pool(x).flatten(1))


def wrappers() -> dict[str, Callable[[nn.Module, Any], Any]]:
    """name -> build(model, optimizer) returning the pruner / quantizer (not yet compressed)."""
    import compressor.torch as ct

    conv = ["Conv2d"]
    return {
        "LevelPruner": lambda m, o: ct.LevelPruner(m, [{"sparsity": 0.5, "op_types": ["Conv2d", "Linear"]}], o),
        "AGPPruner(level)": lambda m, o: ct.AGPPruner(
            m, [{"initial_sparsity": 0.0, "final_sparsity": 0.5, "start_epoch": 0, "end_epoch": 2, "frequency": 1,
                 "op_types": ["Conv2d", "Linear"]}], o, pruning_algorithm="level"),
        "AGPPruner(l1)": lambda m, o: ct.AGPPruner(
            m, [{"initial_sparsity": 0.0, "final_sparsity": 0.5, "start_epoch": 0, "end_epoch": 2, "frequency": 1,
                 "op_types": conv}], o, pruning_algorithm="l1"),
        "L1FilterPruner": lambda m, o: ct.L1FilterPruner(m, [{"sparsity": 0.5, "op_types": conv}], o),
        "L2FilterPruner": lambda m, o: ct.L2FilterPruner(m, [{"sparsity": 0.5, "op_types": conv}], o),
        "FPGMPruner": lambda m, o: ct.FPGMPruner(m, [{"sparsity": 0.5, "op_types": conv}], o),
        "ActivationAPoZRankFilterPruner": lambda m, o: ct.ActivationAPoZRankFilterPruner(
            m, [{"sparsity": 0.5, "op_types": conv}], o, statistics_batch_num=2),
        "ActivationMeanRankFilterPruner": lambda m, o: ct.ActivationMeanRankFilterPruner(
            m, [{"sparsity": 0.5, "op_types": conv}], o, statistics_batch_num=2),
        "TaylorFOWeightFilterPruner": lambda m, o: ct.TaylorFOWeightFilterPruner(
            m, [{"sparsity": 0.5, "op_types": conv}], o, statistics_batch_num=2),
        "SlimPruner": lambda m, o: ct.SlimPruner(m, [{"sparsity": 0.5, "op_types": ["BatchNorm2d"]}], o),
        "LotteryTicketPruner": lambda m, o: ct.LotteryTicketPruner(
            m, [{"sparsity": 0.5, "prune_iterations": 1, "op_types": ["Conv2d", "Linear"]}], o),
        "QAT_Quantizer(w8a8)": lambda m, o: ct.QAT_Quantizer(
            m, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}], o),
        "QAT_Quantizer(w4 per-channel)": lambda m, o: ct.QAT_Quantizer(
            m, [{"quant_types": ["weight", "output"], "quant_bits": 4,
                 "quant_dtype": {"weight": "int", "output": "uint"},
                 "quant_scheme": {"weight": "per_channel_symmetric", "output": "per_tensor_affine"},
                 "op_types": ["Conv2d", "Linear"]}], o),
        "LsqQuantizer": lambda m, o: ct.LsqQuantizer(
            m, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}], o),
        "DoReFaQuantizer": lambda m, o: ct.DoReFaQuantizer(
            m, [{"quant_types": ["weight"], "quant_bits": 4, "op_types": ["Conv2d", "Linear"]}], o),
        "BNNQuantizer": lambda m, o: ct.BNNQuantizer(
            m, [{"quant_types": ["weight"], "quant_bits": 1, "op_types": ["Conv2d", "Linear"]}], o),
        "NaiveQuantizer": lambda m, o: ct.NaiveQuantizer(
            m, [{"quant_types": ["weight"], "quant_bits": 8, "op_types": ["Conv2d", "Linear"]}], o),
    }


def profile_step(step_fn: Callable[[], None], device: torch.device) -> dict[str, Any]:
    """Counts of device-to-host copies, host reads of a tensor and explicit synchronisations in one step."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=acts) as prof:
        step_fn()
        sync(device)  # the step's kernels finish inside the trace; this one sync is the profiler's, not the step's
    names: dict[str, int] = {}
    for ev in prof.events():
        names[ev.name] = names.get(ev.name, 0) + 1
    dtoh = sum(n for k, n in names.items() if "dtoh" in k.lower().replace(" ", "") or "devicetohost" in k.lower())
    syncs = names.get("cudaStreamSynchronize", 0) + names.get("cudaEventSynchronize", 0)
    syncs += max(0, names.get("cudaDeviceSynchronize", 0) - 1)  # less the trace's own closing synchronize
    return {"memcpy_dtoh": dtoh, "host_reads": names.get("aten::_local_scalar_dense", 0), "sync_calls": syncs,
            "memcpy_htod": sum(n for k, n in names.items() if "htod" in k.lower().replace(" ", "")),
            "events": sum(names.values())}


def check_one(name: str, build: Callable[[nn.Module, Any], Any], device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    model = SmallCNN().to(device)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(16, 3, 8, 8, generator=g).to(device)
    y = torch.randint(0, 10, (16,), generator=g).to(device)
    # warm the libraries (cuDNN / cuBLAS handles, the caching allocator) on a dense copy: their first-call
    # set-up is not the wrapper's doing
    dense = copy.deepcopy(model)
    nn.functional.cross_entropy(dense(x), y).backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        comp = build(model, opt)
        comp.compress()
        if hasattr(comp, "prune_iteration_start"):  # lottery ticket: round 0 trains dense, round 1 is pruned
            comp.prune_iteration_start()
            comp.prune_iteration_start()

    epoch = [0]

    def step() -> None:
        if hasattr(comp, "update_epoch"):
            comp.update_epoch(epoch[0])
            epoch[0] += 1
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    # quantizers set their scales up on the first batch they see (as the CUDA tests do, one step first);
    # pruners get none: their statistics and mask decisions fall inside the checked steps
    warmup = 1 if "Quantizer" in name else 0
    for _ in range(warmup):
        step()
    rec: dict[str, Any] = {"warmup_steps": warmup}
    try:
        with no_host_sync(device):
            for _ in range(STEPS_CHECKED):
                step()
            model.eval()
            with torch.no_grad():
                model(x)
            model.train()
        sync(device)
        rec["sync_debug"] = "ok" if device.type == "cuda" else "not applicable on cpu"
    except Exception as e:  # noqa: BLE001 - the check's detail
        rec["sync_debug"] = short_error(e, frames=8)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("default")
    rec.update(profile_step(step, device))
    masks = [b for n, b in model.named_buffers() if n.endswith("_mask")]
    rec["buffers_on_device"] = all(b.device.type == device.type for b in model.buffers())
    rec["pruned_fraction"] = (round(float(sum(int((~m.bool()).sum()) for m in masks)) /
                                    max(1, sum(m.numel() for m in masks)), 3) if masks else None)
    return rec


def body(step: Step) -> None:
    device = torch.device(step.device)
    on_gpu = device.type == "cuda"
    rows = {}
    for name, build in wrappers().items():
        with step.guard(f"{name}: builds and trains on {device.type}"):
            rec = check_one(name, build, device)
            rows[name] = rec
            detail = (f"dtoh copies {rec['memcpy_dtoh']}, host reads {rec['host_reads']}, sync calls "
                      f"{rec['sync_calls']}, pruned {rec['pruned_fraction']}")
            if on_gpu:
                step.check(f"{name}: no host sync in {STEPS_CHECKED} steps + eval (sync debug 'error')",
                           rec["sync_debug"] == "ok", rec["sync_debug"])
                step.check(f"{name}: no device-to-host copy in a profiled step",
                           rec["memcpy_dtoh"] == 0 and rec["sync_calls"] == 0, detail)
            else:
                step.check(f"{name}: trains and profiles on cpu", True, detail)
            step.check(f"{name}: masks / quantization buffers on {device.type}", rec["buffers_on_device"])
    step.results["wrappers"] = rows


if __name__ == "__main__":
    raise SystemExit(run_step("step2_no_sync", "no host sync inside a training step (every pruner / quantizer)",
                              body))
