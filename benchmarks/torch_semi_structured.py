"""2:4 semi-structured sparsity on CUDA: a transformer-FFN matmul, dense vs ``to_sparse_semi_structured``.

    python benchmarks/torch_semi_structured.py --device cuda [--rounds N] [--shape OUT IN] [--batch B]

The weight (default 4096 x 16384, float16: the down projection of a 4096-wide FFN) is pruned to 2:4 by
core's N:M mask (``LevelPruner`` with ``sparse_pattern: '2:4'``), the activations are ``batch x in``
(default 2048); the dense masked ``F.linear`` and the converted layer
(:func:`compressor.torch.to_semi_structured`) are timed with CUDA events, interleaved, median of
``--rounds`` runs of 20 calls each, and the outputs compared. Runs only with ``--device cuda``
(``benchmarks/run.py`` skips it otherwise); on a CPU it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from torch import nn


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--shape", type=int, nargs=2, default=[4096, 16384], metavar=("OUT", "IN"))
    p.add_argument("--batch", type=int, default=2048)
    args = p.parse_args(argv)
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print(f"skipped: 2:4 sparse tensor cores need --device cuda and a CUDA GPU (device {args.device!r}, "
              f"CUDA available: {torch.cuda.is_available()})")
        return 0
    from compressor.torch import LevelPruner, to_semi_structured

    dev = torch.device(args.device)
    out_f, in_f = args.shape
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(in_f, out_f, bias=False)).to(dev)
    pruner = LevelPruner(model, [{"sparse_pattern": "2:4", "op_types": ["Linear"]}])
    pruner.compress()
    from compressor.torch.pruning.export import unwrapped_model

    dense = unwrapped_model(model).half().eval()
    sparse = to_semi_structured(pruner)
    x = torch.randn(args.batch, in_f, device=dev, dtype=torch.float16)

    def timed(m: nn.Module) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.no_grad():
            start.record()
            for _ in range(20):
                m(x)
            end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    with torch.no_grad():
        for _ in range(3):
            dense(x), sparse(x)
        err = (sparse(x).float() - dense(x).float()).abs().max().item()
    t_dense, t_sparse = [], []
    for _ in range(args.rounds):
        t_dense.append(timed(dense))
        t_sparse.append(timed(sparse))
    d, s = statistics.median(t_dense), statistics.median(t_sparse)
    flops = 2 * args.batch * in_f * out_f
    print(f"GPU: {torch.cuda.get_device_name(dev)}; torch {torch.__version__}")
    print("| variant | shape (out x in), batch | median ms | min ms | TFLOP/s (dense-equivalent) | speedup |")
    print("|---|---|---|---|---|---|")
    print(f"| dense fp16 (masked 2:4) | {out_f} x {in_f}, {args.batch} | {d:.3f} | {min(t_dense):.3f} | "
          f"{flops / d / 1e9:.1f} | 1.00x |")
    print(f"| to_sparse_semi_structured | {out_f} x {in_f}, {args.batch} | {s:.3f} | {min(t_sparse):.3f} | "
          f"{flops / s / 1e9:.1f} | {d / s:.2f}x |")
    print(f"max |sparse - dense| output difference: {err:.3g} (float16)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
