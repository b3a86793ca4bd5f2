"""Keras 3 low-bit layers on TensorFlow (issue 26): our one-shot codes in Keras's own int4 / int8 layers vs
float and vs Keras's own ``quantize()``; one thread, interleaved, ratios to float in the same run.

Part 1, one ``Dense(2048 -> 2048, use_bias=False)`` at M = 1 and M = 64 input rows:

* ``float``; Keras's own ``quantize('int8')`` (dynamic int8 activations, its default) and weight-only
  (``Int8QuantizationConfig(activation_quantizer=None)``); Keras's own ``quantize('int4')`` per channel
  (``block_size=-1``) and with ``block_size=128``;
* ours: ``RtnQuantizer`` codes (the layout is what matters for speed; GPTQ codes store the same way) through
  :func:`compressor.tf.quantization.lowbit.to_keras_quantized`: w4 g128 (Keras ``int4/128``), w4 per channel
  (``int4/-1``), w4 per channel with ``fast=True`` (the nibbles in Keras's ``int8`` layer), w8 per channel
  (``int8``, weight-only).

Part 2, the trained byte-level Llama of the one-shot issue in its Keras port (``examples/llm_keras.py``,
weights ``--weights``: by default ``llama-bytes-seed0-steps260.pt`` in ``$COMPRESSOR_LLM_CACHE``, else in
``out/llm`` under the repository root, where ``python -m examples.reproduce_llm`` caches them; 3.5 M parameters,
the LM head left float as the quantizers do by default): the
``.weights.h5`` file size and the latency of one forward pass at batch 1 over ``--context`` tokens (the port
has no KV cache, so the next token costs a forward of the context), float vs ours w4 g128 / w4 per channel
fast / w8, and the max |logit| difference to the fake-quant model.

    python benchmarks/lowbit_tf.py [--rounds 7] [--calls 5] [--context 32] [--weights PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)
tf.config.threading.set_inter_op_parallelism_threads(1)

import keras  # noqa: E402

from benchmarks._interleave import interleaved_medians  # noqa: E402
from compressor.tf import RtnQuantizer  # noqa: E402
from compressor.tf.quantization.lowbit import to_keras_quantized  # noqa: E402

N = 2048
#: the trained weights: $COMPRESSOR_LLM_CACHE (default: out/llm under the repository root) / the cached file's name
WEIGHTS = str(Path(os.environ.get("COMPRESSOR_LLM_CACHE", Path(__file__).resolve().parent.parent / "out" / "llm"))
              / "llama-bytes-seed0-steps260.pt")


def _dense(w: np.ndarray) -> keras.Model:
    x = keras.Input((N,))
    layer = keras.layers.Dense(N, use_bias=False, name="fc")
    m = keras.Model(x, layer(x))
    layer.kernel.assign(w)
    return m


def _ours(w: np.ndarray, cfg: dict, fast: bool = False) -> keras.Model:
    m = _dense(w)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        q = RtnQuantizer(m, [{**cfg, "op_types": ["Dense"]}])
        q.calibrate(progress=False)
    to_keras_quantized(q, fast=fast)
    return m


def _keras_own(w: np.ndarray, mode: str, config=None) -> keras.Model:
    m = _dense(w)
    m.get_layer("fc").quantize(mode, config=config)
    return m


def _fn(model: keras.Model, x: tf.Tensor):
    f = tf.function(lambda t: model(t, training=False))
    f(x)
    return lambda: f(x).numpy()


def dense_table(rounds: int, calls: int) -> list[str]:
    from keras.quantizers import Int4QuantizationConfig, Int8QuantizationConfig

    rng = np.random.default_rng(0)
    w = (rng.standard_normal((N, N)) * 0.02).astype(np.float32)
    variants = {
        "float": _dense(w),
        "keras int8 (dynamic act.)": _keras_own(w, "int8"),
        "keras int8 weight-only": _keras_own(w, "int8", Int8QuantizationConfig(activation_quantizer=None)),
        "keras int4/-1": _keras_own(w, "int4", Int4QuantizationConfig(block_size=-1)),
        "keras int4/128": _keras_own(w, "int4", Int4QuantizationConfig(block_size=128)),
        "ours w4 g128 -> int4/128": _ours(w, {"quant_bits": 4, "group_size": 128}),
        "ours w4 channel -> int4/-1": _ours(w, {"quant_bits": 4}),
        "ours w4 channel fast -> int8": _ours(w, {"quant_bits": 4}, fast=True),
        "ours w8 channel -> int8": _ours(w, {"quant_bits": 8}),
    }
    xs = {m: tf.constant(rng.standard_normal((m, N)).astype(np.float32)) for m in (1, 64)}
    ref = {m: variants["float"](xs[m]).numpy() for m in xs}
    fns = {(k, m): _fn(v, xs[m]) for k, v in variants.items() for m in xs}
    med = interleaved_medians(fns, rounds=rounds, calls=calls)
    lines = [f"Dense {N}x{N}, one thread, medians of {rounds} interleaved rounds x {calls} calls",
             "", "| variant | weight bytes | M=1 ms | vs float | M=64 ms | vs float | max rel. err vs float (M=64) |",
             "|---|---|---|---|---|---|---|"]
    for k, v in variants.items():
        layer = v.get_layer("fc")
        nbytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in layer.weights)
        err = float(np.abs(v(xs[64]).numpy() - ref[64]).max() / np.abs(ref[64]).max())
        lines.append(f"| {k} | {nbytes / 2**20:.2f} MiB | {med[(k, 1)] * 1e3:.2f} | {med[(k, 1)] / med[('float', 1)]:.2f}x | "
                     f"{med[(k, 64)] * 1e3:.2f} | {med[(k, 64)] / med[('float', 64)]:.2f}x | {err:.1e} |")
    return lines


def _llama(weights: str):
    import torch  # only to read the cached state_dict (weights_only=True)

    from examples.llm_common import CONFIG
    from examples.llm_keras import build_keras_llama, load_hf_weights

    sd = {k: v.numpy() for k, v in torch.load(weights, map_location="cpu", weights_only=True).items()}
    m = build_keras_llama(CONFIG)
    load_hf_weights(m, sd)
    return m, sd


def llm_table(weights: str, context: int, rounds: int, calls: int) -> list[str]:
    if not os.path.isfile(weights):
        return [f"(LM part skipped: {weights} not found)"]
    from examples.llm_common import CONFIG
    from examples.llm_keras import build_keras_llama, load_hf_weights

    base, sd = _llama(weights)
    ids = np.random.default_rng(1).integers(0, 256, (1, context)).astype(np.int32)
    variants = {"float": (base, None)}
    for name, cfg, fast in (("ours w4 g128 -> int4/128", {"quant_bits": 4, "group_size": 128}, False),
                            ("ours w4 channel fast -> int8", {"quant_bits": 4}, True),
                            ("ours w8 channel -> int8", {"quant_bits": 8}, False)):
        m = build_keras_llama(CONFIG)
        load_hf_weights(m, sd)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            q = RtnQuantizer(m, [{**cfg, "op_types": ["default"]}])
            q.calibrate(progress=False)
        fake = m(ids).numpy()
        to_keras_quantized(q, fast=fast)
        variants[name] = (m, float(np.abs(m(ids).numpy() - fake).max() / np.abs(fake).max()))
    sizes = {}
    with tempfile.TemporaryDirectory() as d:
        for k, (m, _) in variants.items():
            p = os.path.join(d, "m.weights.h5")
            m.save_weights(p)
            sizes[k] = os.path.getsize(p)
            os.remove(p)
    x = tf.constant(ids)
    fns = {k: _fn(m, x) for k, (m, _) in variants.items()}
    med = interleaved_medians(fns, rounds=rounds, calls=calls)
    lines = [f"Trained byte Llama (Keras port, 3.5 M params; LM head float), batch 1, {context}-token forward "
             f"(no KV cache), one thread", "",
             "| variant | .weights.h5 | vs float | latency ms | vs float | max rel. logit diff vs fake-quant |",
             "|---|---|---|---|---|---|"]
    for k, (_, err) in variants.items():
        lines.append(f"| {k} | {sizes[k] / 2**20:.2f} MiB | {sizes[k] / sizes['float']:.2f}x | {med[k] * 1e3:.2f} | "
                     f"{med[k] / med['float']:.2f}x | {'-' if err is None else f'{err:.1e}'} |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--weights", default=WEIGHTS)
    args = ap.parse_args()
    print("\n".join(dense_table(args.rounds, args.calls)))
    print()
    print("\n".join(llm_table(args.weights, args.context, args.rounds, args.calls)))


if __name__ == "__main__":
    main()
