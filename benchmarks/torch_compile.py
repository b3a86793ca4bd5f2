"""torch.compile on compressed models: compiled train step of a pruned / QAT model vs compiled baselines.

A small Hugging Face BERT (random weights, no dropout) trains on random tokens; every variant is a copy of
the same model with the same optimizer (SGD with momentum, not compiled), compiled with the default
backend (inductor) unless marked eager. Variants are timed in interleaved rounds (each round runs every
variant for ``--steps`` steps, in a shuffled order) and medians over rounds are compared, so drifting
machine load hits all of them alike.

* ``dense``: the plain model; ``pruned``: LevelPruner 50 % on every Linear (its optimizer hook re-masks
  after each step; compiled forwards mask out of place). Goal: compiled pruned <= 1.05x compiled dense.
* ``QAT``: QAT_Quantizer, 8-bit weights, inputs and outputs of every Linear (uint8, per-tensor affine: weights
  from the current min/max, activations EMA-tracked); ``ao-style``: the same quantization points and math
  in a plain model (each Linear replaced by a module calling ``torch.fake_quantize_per_tensor_affine``, the
  way torch.ao's FakeQuantize does; torch.ao's own ``prepare_qat`` modules are not used because dynamo skips
  torch.ao code: 10 graphs for this model). Goal: compiled QAT <= 1.1x compiled ao-style.

Also printed: graphs and graph breaks per variant (``torch._dynamo.explain``) and the number of
recompilations during the timed rounds (should be 0).

Usage: ``python benchmarks/torch_compile.py [--device cuda] [--rounds 20] [--steps 3] [--batch 8] [--seq 64]``
"""

from __future__ import annotations

import argparse
import copy
import random
import statistics
import time
import warnings

import torch
import torch._dynamo as dynamo
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters

try:
    from benchmarks._device import torch_device
except ModuleNotFoundError:  # run as a file (python benchmarks/<name>.py): its folder is on sys.path
    from _device import torch_device
from compressor.torch import LevelPruner, QAT_Quantizer


def bert(hidden: int, layers: int) -> nn.Module:
    import transformers as tr

    torch.manual_seed(0)
    cfg = tr.BertConfig(vocab_size=1000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                        intermediate_size=4 * hidden, max_position_embeddings=512, num_labels=4,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return tr.BertForSequenceClassification(cfg)


# ------------------------------------------------------------------------------------------ ao-style baseline
def _qparams(rmin: torch.Tensor, rmax: torch.Tensor, qmin: int = 0, qmax: int = 255):
    rmin, rmax = torch.clamp(rmin, max=0.0), torch.clamp(rmax, min=0.0)
    scale = torch.clamp((rmax - rmin) / (qmax - qmin), min=1e-8)
    zero_point = torch.clamp(torch.round(qmin - rmin / scale), qmin, qmax).to(torch.int32)
    return scale, zero_point


class FakeQuantLinear(nn.Module):
    """A Linear with uint8 per-tensor affine fake quantization of its input, weight and output (EMA ranges for
    activations, decay 0.99), written as torch.ao's FakeQuantize computes it; no wrapper machinery."""

    def __init__(self, linear: nn.Linear, decay: float = 0.99) -> None:
        super().__init__()
        self.weight, self.bias, self.decay = linear.weight, linear.bias, decay
        for t in ("input", "output"):
            self.register_buffer(f"{t}_min", torch.zeros((), device=linear.weight.device))
            self.register_buffer(f"{t}_max", torch.zeros((), device=linear.weight.device))
            self.register_buffer(f"{t}_seen", torch.zeros((), dtype=torch.bool, device=linear.weight.device))

    def _activation(self, x: torch.Tensor, t: str) -> torch.Tensor:
        lo, hi, seen = self._buffers[f"{t}_min"], self._buffers[f"{t}_max"], self._buffers[f"{t}_seen"]
        if self.training:
            with torch.no_grad():
                mn, mx = torch.aminmax(x.detach())
                lo.copy_(torch.where(seen, lo * self.decay + mn * (1 - self.decay), mn))
                hi.copy_(torch.where(seen, hi * self.decay + mx * (1 - self.decay), mx))
                seen.fill_(True)
        scale, zp = _qparams(lo, hi)
        return torch.fake_quantize_per_tensor_affine(x, scale, zp, 0, 255)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._activation(x, "input")
        with torch.no_grad():
            scale, zp = _qparams(*torch.aminmax(self.weight.detach()))
        w = torch.fake_quantize_per_tensor_affine(self.weight, scale, zp, 0, 255)
        return self._activation(F.linear(x, w, self.bias), "output")


def ao_style(model: nn.Module) -> nn.Module:
    for name, child in model.named_children():
        if isinstance(child, nn.Linear):
            setattr(model, name, FakeQuantLinear(child))
        else:
            ao_style(child)
    return model


# ------------------------------------------------------------------------------------------ timing
def build(kind: str, base: nn.Module) -> tuple[nn.Module, torch.optim.Optimizer]:
    model = copy.deepcopy(base).train()
    if kind == "ao-style":
        model = ao_style(model)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    if kind == "pruned":
        LevelPruner(model, [{"sparsity": 0.5, "op_types": ["Linear"]}], opt).compress()
    elif kind == "QAT":
        QAT_Quantizer(model, [{"quant_types": ["weight", "input", "output"], "quant_bits": 8, "op_types": ["Linear"],
                               "quant_dtype": "uint", "quant_scheme": "per_tensor_affine"}], opt).compress()
    return model, opt


def time_steps(run, opt: torch.optim.Optimizer, ids: torch.Tensor, y: torch.Tensor, steps: int) -> float:
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(run(input_ids=ids).logits, y).backward()
        opt.step()
    sync()
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="intra-op threads (default 1: on a shared machine 2 threads wait at barriers for a busy core)")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    dev = torch_device(ap, args.device)
    base = bert(args.hidden, args.layers).to(dev)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 1000, (args.batch, args.seq), generator=g).to(dev)
    y = torch.randint(0, 4, (args.batch,), generator=g).to(dev)

    kinds = ["dense", "pruned", "QAT", "ao-style"]
    graphs: dict[str, tuple[int, int]] = {}
    variants: dict[str, tuple] = {}
    compile_s: dict[str, float] = {}
    for kind in kinds:
        model, opt = build(kind, base)
        explained = dynamo.explain(lambda m=model: m(input_ids=ids).logits)()
        graphs[kind] = (explained.graph_count, explained.graph_break_count)
        variants[f"{kind} eager"] = (model, model, opt)
    dynamo.reset()  # (after all explains: a reset drops every compiled variant's code)
    for kind in kinds:
        model_c, opt_c = build(kind, base)
        run = torch.compile(model_c)
        t0 = time.perf_counter()
        time_steps(run, opt_c, ids, y, 3)  # compile + warm-up (also seeds observers)
        compile_s[kind] = time.perf_counter() - t0
        variants[f"{kind} compiled"] = (run, model_c, opt_c)
    for name, (run, _, opt) in variants.items():
        if name.endswith("eager"):
            time_steps(run, opt, ids, y, 3)
    frames_before = counters["stats"]["unique_graphs"]  # a recompilation adds a graph

    times: dict[str, list[float]] = {k: [] for k in variants}
    order = list(variants)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for k in order:
            run, _, opt = variants[k]
            times[k].append(time_steps(run, opt, ids, y, args.steps))
    recompiled = counters["stats"]["unique_graphs"] - frames_before
    med = {k: statistics.median(v) for k, v in times.items()}

    pruned_nonzero = sum(int((w.weight[~w.weight_mask] != 0).sum()) for w in variants["pruned compiled"][1].modules()
                         if hasattr(w, "weight_mask"))
    print(f"device={dev} threads={args.threads} BERT hidden={args.hidden} layers={args.layers} batch={args.batch} "
          f"seq={args.seq} rounds={args.rounds} steps/round={args.steps} (wall time, medians over rounds)")
    print(f"{'variant':20s} {'ms/step':>9s} {'min':>8s} {'max':>8s}  {'graphs/breaks':>13s}  compile+3 steps")
    for k, v in med.items():
        kind = k.rsplit(" ", 1)[0]
        extra = f"{graphs[kind][0]:>6d}/{graphs[kind][1]:<6d}  {compile_s[kind]:6.1f} s" if k.endswith("compiled") else ""
        print(f"{k:20s} {v * 1e3:9.3f} {min(times[k]) * 1e3:8.3f} {max(times[k]) * 1e3:8.3f}  {extra}")
    print(f"pruned compiled / dense compiled:   {med['pruned compiled'] / med['dense compiled']:.3f}x  (goal <= 1.05)")
    print(f"QAT compiled / ao-style compiled:   {med['QAT compiled'] / med['ao-style compiled']:.3f}x  (goal <= 1.10)")
    for kind in kinds:
        print(f"{kind:8s} compiled / eager:         {med[kind + ' compiled'] / med[kind + ' eager']:.3f}x")
    print(f"recompilations during the timed rounds: {recompiled}; pruned weights != 0 after compiled training: "
          f"{pruned_nonzero}")


if __name__ == "__main__":
    main()
