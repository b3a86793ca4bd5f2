"""Anchor rows for examples/reproduce_llm.py: Keras 3.15's own ``model.quantize`` on the Keras port.

Keras's quantizers (not ``compressor``) on the same trained weights (examples/llm_keras.py port of the HF
model), the decoder's Dense layers only (``lm_head`` and the embedding left float, as in our rows), the same
held-out windows; GPTQ / AWQ get the same 128 x 256 calibration windows as our rows (seed ``s``).

    python examples/anchors/keras_quantize_rows.py --state W.pt --methods int4_g128,gptq_w4g128 --seed 0

Methods (Keras 3.15 semantics, read from keras/src/layers/core/dense.py and keras/src/quantizers):

* ``int8``: ``model.quantize('int8')``: int8 weights per output channel (abs-max, [-127, 127]) AND int8
  activations quantized per token at run time (W8A8 dynamic);
* ``int8_w``: the same weights, activations left float (``Int8QuantizationConfig(activation_quantizer=None)``);
* ``int4``: ``model.quantize('int4')``: Keras resolves mode 'int4' to ``Int4QuantizationConfig()``, whose
  ``block_size`` defaults to 128: the same as ``int4_g128`` (measured: identical perplexity);
* ``int4_g128``: ``Int4QuantizationConfig(block_size=128)``: groups of 128 inputs, asymmetric (a zero point per
  group), weight-only: the grid closest to our ``rtn_w4g128`` (ours is symmetric [-7, 7]);
* ``int4_pc``: ``Int4QuantizationConfig(block_size=None)``: per output channel, symmetric abs-max on [-8, 7];
* ``gptq_w4g128`` / ``gptq_w3g128``: ``GPTQConfig(weight_bits, group_size=128)`` with its defaults
  (asymmetric, no act-order, damping 0.01);
* ``awq_w4g128``: ``AWQConfig(group_size=128)`` with its defaults (20 grid points).

Keras's GPTQ/AWQ call each sequential block as ``block(hidden_states)`` and sample their own windows from
``dataset`` (a hash-seeded stride): the port's blocks take rotary tables and a mask, so each is wrapped in a
layer that binds them, and Keras's ``get_dataloader`` is replaced by one that returns our windows.
Prints one JSON object per method: {"method", "ppl", "seconds", "quantized" (layers), "grid"}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import keras  # noqa: E402
import numpy as np  # noqa: E402

from examples.llm_common import CONFIG, DEFAULT_CORPUS, calibration_windows, corpus, held_out_windows  # noqa: E402
from examples.llm_keras import build_keras_llama, load_hf_weights, perplexity_keras  # noqa: E402

METHODS = ("int8", "int8_w", "int4", "int4_g128", "int4_pc", "gptq_w4g128", "gptq_w3g128", "awq_w4g128")
GRID = {"int8": "int8 per channel, symmetric [-127, 127]; activations int8 per token (dynamic)",
        "int8_w": "int8 per channel, symmetric [-127, 127]; activations float",
        "int4": "int4 groups of 128, asymmetric (Keras's default Int4QuantizationConfig)",
        "int4_pc": "int4 per channel, symmetric [-8, 7] (abs-max / 7 scale)",
        "int4_g128": "int4 groups of 128, asymmetric (zero point per group)",
        "gptq_w4g128": "GPTQ int4 groups of 128, asymmetric, no act-order",
        "gptq_w3g128": "GPTQ int3 groups of 128, asymmetric, no act-order",
        "awq_w4g128": "AWQ int4 groups of 128 (Keras defaults)"}


class _Bound(keras.layers.Layer):
    """A port block with its rotary tables and causal mask bound: ``call(hidden_states)``, as Keras's GPTQ /
    AWQ call a sequential block."""

    def __init__(self, block, rope, mask, **kw):
        super().__init__(name=f"bound_{block.name}", **kw)
        self.block, self.rope, self.mask = block, rope, mask

    def call(self, x):
        return self.block(x, position_embeddings=self.rope, attention_mask=self.mask)


def decoder_dense(layer) -> bool:
    """Keras's ``filters``: the decoder's Dense layers (not lm_head, not the embedding)."""
    return isinstance(layer, keras.layers.Dense) and layer.name != "lm_head"


def structure(model, seq: int) -> dict:
    from keras import ops

    rope = (ops.convert_to_tensor(model._cos[:seq]), ops.convert_to_tensor(model._sin[:seq]))
    mask = ops.convert_to_tensor(np.where(np.tril(np.ones((seq, seq), dtype=bool)), np.float32(0),
                                          np.finfo(np.float32).min).astype(np.float32)[None, None])
    return {"pre_block_layers": [model.embed_tokens],
            "sequential_blocks": [_Bound(b, rope, mask) for b in model.decoder_layers]}


def quantize(model, method: str, calib: np.ndarray) -> None:
    from keras.src.quantizers import awq_core, gptq_core

    q = keras.quantizers
    if method in ("int8", "int4"):
        model.quantize(method, filters=decoder_dense)
    elif method == "int8_w":
        model.quantize("int8", config=q.Int8QuantizationConfig(activation_quantizer=None), filters=decoder_dense)
    elif method == "int4_pc":
        model.quantize("int4", config=q.Int4QuantizationConfig(block_size=None), filters=decoder_dense)
    elif method == "int4_g128":
        model.quantize("int4", config=q.Int4QuantizationConfig(block_size=128), filters=decoder_dense)
    elif method.startswith("gptq_w") or method.startswith("awq_w"):
        ours = calib[:, None, :].astype(np.int32)
        originals = (gptq_core.get_dataloader, awq_core.get_dataloader)
        gptq_core.get_dataloader = awq_core.get_dataloader = lambda *a, **k: ours  # our windows, in order
        try:
            st = structure(model, calib.shape[1])
            kw = {"num_samples": len(calib), "sequence_length": calib.shape[1], "group_size": 128,
                  "quantization_layer_structure": st}
            if method.startswith("gptq"):
                bits = int(method.split("_w")[1].split("g")[0])
                cfg = q.GPTQConfig(dataset=list(calib), tokenizer=object(), weight_bits=bits, **kw)
                model.quantize("gptq", config=cfg, filters=decoder_dense)
            else:
                cfg = q.AWQConfig(dataset=list(calib), tokenizer=object(), weight_bits=4, **kw)
                model.quantize("awq", config=cfg, filters=decoder_dense)
        finally:
            gptq_core.get_dataloader, awq_core.get_dataloader = originals
    else:
        raise SystemExit(f"unknown method {method!r}; allowed: {list(METHODS)}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--state", required=True, help="the trained HF state_dict (torch.save)")
    p.add_argument("--corpus", default=DEFAULT_CORPUS)
    p.add_argument("--methods", default="int4_g128")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    import torch

    state = {k: v.numpy() for k, v in torch.load(a.state, weights_only=True).items()}
    text = corpus(a.corpus)
    calib = calibration_windows(text, 128, a.seed)
    held = held_out_windows(text)
    for method in a.methods.split(","):
        model = build_keras_llama(CONFIG)
        load_hf_weights(model, state)
        t0 = time.perf_counter()
        quantize(model, method, calib)
        sec = time.perf_counter() - t0
        done = sorted(lay.path for lay in model._flatten_layers() if getattr(lay, "quantization_mode", None))
        print(json.dumps({"method": method, "ppl": perplexity_keras(model, held), "seconds": sec,
                          "quantized": len(done), "lm_head_quantized": any("lm_head" in d for d in done),
                          "grid": GRID[method]}), flush=True)


if __name__ == "__main__":
    main()
