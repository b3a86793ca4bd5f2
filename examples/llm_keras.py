"""A Keras 3 port of Hugging Face ``LlamaForCausalLM`` for the one-shot reproduction of issue 25.

The same trained weights are compressed on PyTorch (the HF model of :mod:`examples.llm_common`) and on Keras
(this port), and the held-out perplexities are compared; keras-hub is an optional extra, so the Keras side is
our own port. It computes exactly what ``LlamaForCausalLM`` (transformers 5.x, eager attention, no cache)
computes for the keys of ``llm_common.CONFIG``:

token ``Embedding`` -> ``num_hidden_layers`` x :class:`DecoderBlock` (RMSNorm -> attention with rotary
embeddings (rotate-half convention), grouped-query heads repeated, causal mask, float32 softmax -> residual;
RMSNorm -> SiLU-gated MLP -> residual) -> final RMSNorm -> ``lm_head``. Every projection is a
``Dense(use_bias=False)`` named as in HF (``q_proj`` ... ``down_proj``); the blocks are the list attribute
``decoder_layers`` of the model, named ``layers_0``, ``layers_1``, ... so the one-shot compressors of
:mod:`compressor.tf.sequential` find them as the repeated blocks, and layer paths read
``layers_0/self_attn/q_proj`` (HF: ``model.layers.0.self_attn.q_proj``).

``load_hf_weights`` copies an HF state_dict (numpy arrays, torch layouts) into the port and
``keras_state_dict`` reads it back in the same keys and layouts; ``perplexity_keras`` is
``llm_common.perplexity_torch`` on this model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import keras
import numpy as np
from keras import ops

__all__ = ["build_keras_llama", "load_hf_weights", "keras_state_dict", "perplexity_keras", "KerasLlama",
           "DecoderBlock", "LlamaAttention", "LlamaMLP", "RMSNorm", "rope_tables"]

#: config keys the port reads (with the HF default where HF has one), and HF keys it accepts only at the value
#: the port implements
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
_DEFAULTS = {"num_key_value_heads": None, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
             "max_position_embeddings": 2048, "head_dim": None}
_FIXED = {"tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
          "rope_scaling": None, "attention_dropout": 0.0, "pretraining_tp": 1}
#: HF keys that do not change the forward pass of a causal LM without cache
_IGNORED = ("bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range", "torch_dtype",
            "dtype", "model_type", "architectures", "transformers_version")


def _resolve(config: Mapping[str, Any]) -> dict[str, Any]:
    """The full config of the port from ``config``; a ValueError names a missing, unknown or unsupported key."""
    if not isinstance(config, Mapping):
        raise TypeError(f"build_keras_llama: config must be a dict of LlamaConfig keys, got {type(config).__name__}")
    cfg = dict(config)
    rope = cfg.pop("rope_parameters", None)
    if rope is not None:
        if dict(rope).get("rope_type", "default") != "default":
            raise ValueError(f"build_keras_llama: rope_parameters {dict(rope)!r}: only rope_type 'default' is ported")
        cfg.setdefault("rope_theta", dict(rope).get("rope_theta", _DEFAULTS["rope_theta"]))
    missing = [k for k in _REQUIRED if k not in cfg]
    unknown = sorted(set(cfg) - set(_REQUIRED) - set(_DEFAULTS) - set(_FIXED) - set(_IGNORED))
    if missing or unknown:
        raise ValueError(f"build_keras_llama: config is missing {missing} / has unknown keys {unknown}; the port "
                         f"reads {list(_REQUIRED) + list(_DEFAULTS)} and accepts {sorted(_FIXED)} at their "
                         f"defaults {_FIXED}")
    for key, value in _FIXED.items():
        if key in cfg and cfg[key] != value and not (value is None and not cfg[key]):
            raise ValueError(f"build_keras_llama: {key}={cfg[key]!r} is not ported (only {key}={value!r})")
    out = {**_DEFAULTS, **{k: cfg[k] for k in _REQUIRED}, **{k: cfg[k] for k in _DEFAULTS if k in cfg}}
    if out["num_key_value_heads"] is None:
        out["num_key_value_heads"] = out["num_attention_heads"]
    if out["head_dim"] is None:
        out["head_dim"] = out["hidden_size"] // out["num_attention_heads"]
    if out["num_attention_heads"] % out["num_key_value_heads"]:
        raise ValueError(f"build_keras_llama: num_attention_heads {out['num_attention_heads']} is not a multiple of "
                         f"num_key_value_heads {out['num_key_value_heads']}")
    return out


def rope_tables(head_dim: int, length: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """``(cos, sin)`` ``[length, head_dim]`` float32 as HF's default rotary embedding computes them (in float32:
    ``inv_freq = 1 / theta ** (arange(0, d, 2) / d)``, ``freqs = position * inv_freq``, duplicated halves)."""
    inv_freq = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32)
                                                         / np.float32(head_dim)))
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv_freq[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


class RMSNorm(keras.layers.Layer):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last axis, computed in float32 (HF ``LlamaRMSNorm``)."""

    def __init__(self, eps: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.eps = float(eps)

    def build(self, input_shape: Any) -> None:
        self.weight = self.add_weight(name="weight", shape=(int(input_shape[-1]),), initializer="ones")

    def call(self, x: Any) -> Any:
        dtype = x.dtype
        h = ops.cast(x, "float32")
        variance = ops.mean(ops.square(h), axis=-1, keepdims=True)
        h = h * ops.rsqrt(variance + self.eps)
        return self.weight * ops.cast(h, dtype)


def _rotate_half(x: Any) -> Any:
    half = x.shape[-1] // 2
    return ops.concatenate([-x[..., half:], x[..., :half]], axis=-1)


class LlamaAttention(keras.layers.Layer):
    """Causal self-attention with rotary embeddings and grouped-query heads (HF ``LlamaAttention``, eager)."""

    def __init__(self, cfg: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.heads, self.kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        self.scaling = self.head_dim ** -0.5
        self.q_proj = keras.layers.Dense(self.heads * self.head_dim, use_bias=False, name="q_proj")
        self.k_proj = keras.layers.Dense(self.kv_heads * self.head_dim, use_bias=False, name="k_proj")
        self.v_proj = keras.layers.Dense(self.kv_heads * self.head_dim, use_bias=False, name="v_proj")
        self.o_proj = keras.layers.Dense(cfg["hidden_size"], use_bias=False, name="o_proj")

    def _split(self, x: Any, heads: int) -> Any:
        """``[b, s, heads * d]`` -> ``[b, heads, s, d]``."""
        shape = ops.shape(x)
        return ops.transpose(ops.reshape(x, (shape[0], shape[1], heads, self.head_dim)), (0, 2, 1, 3))

    def call(self, x: Any, position_embeddings: tuple[Any, Any], attention_mask: Any) -> Any:
        cos, sin = position_embeddings  # [s, d] each
        q = self._split(self.q_proj(x), self.heads)
        k = self._split(self.k_proj(x), self.kv_heads)
        v = self._split(self.v_proj(x), self.kv_heads)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        groups = self.heads // self.kv_heads
        if groups > 1:  # kv head j serves query heads j * groups ... (j + 1) * groups - 1 (repeat_interleave)
            k, v = ops.repeat(k, groups, axis=1), ops.repeat(v, groups, axis=1)
        scores = ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * self.scaling + attention_mask
        probs = ops.cast(ops.softmax(ops.cast(scores, "float32"), axis=-1), q.dtype)
        out = ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))
        shape = ops.shape(out)
        return self.o_proj(ops.reshape(out, (shape[0], shape[1], self.heads * self.head_dim)))


class LlamaMLP(keras.layers.Layer):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (HF ``LlamaMLP``)."""

    def __init__(self, cfg: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.gate_proj = keras.layers.Dense(cfg["intermediate_size"], use_bias=False, name="gate_proj")
        self.up_proj = keras.layers.Dense(cfg["intermediate_size"], use_bias=False, name="up_proj")
        self.down_proj = keras.layers.Dense(cfg["hidden_size"], use_bias=False, name="down_proj")

    def call(self, x: Any) -> Any:
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderBlock(keras.layers.Layer):
    """One decoder layer (HF ``LlamaDecoderLayer``): pre-norm attention and pre-norm MLP, each with a residual.
    ``call(hidden_states, position_embeddings=(cos, sin), attention_mask=additive [1, 1, s, s])``."""

    def __init__(self, cfg: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        self.input_layernorm = RMSNorm(cfg["rms_norm_eps"], name="input_layernorm")
        self.self_attn = LlamaAttention(cfg, name="self_attn")
        self.post_attention_layernorm = RMSNorm(cfg["rms_norm_eps"], name="post_attention_layernorm")
        self.mlp = LlamaMLP(cfg, name="mlp")

    def call(self, hidden_states: Any, position_embeddings: tuple[Any, Any], attention_mask: Any) -> Any:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), position_embeddings, attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class KerasLlama(keras.Model):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]`` (float32); see the module docstring."""

    def __init__(self, config: Mapping[str, Any], **kw: Any) -> None:
        kw.setdefault("name", "llama")
        super().__init__(**kw)
        self.llama_config = _resolve(config)
        cfg = self.llama_config
        self.embed_tokens = keras.layers.Embedding(cfg["vocab_size"], cfg["hidden_size"], name="embed_tokens")
        self.decoder_layers = [DecoderBlock(cfg, name=f"layers_{i}") for i in range(cfg["num_hidden_layers"])]
        self.norm = RMSNorm(cfg["rms_norm_eps"], name="norm")
        self.lm_head = keras.layers.Dense(cfg["vocab_size"], use_bias=False, name="lm_head")
        self._cos, self._sin = rope_tables(cfg["head_dim"], cfg["max_position_embeddings"], cfg["rope_theta"])

    def call(self, input_ids: Any, training: bool = False) -> Any:
        seq = input_ids.shape[1]
        if seq is None:
            raise ValueError("KerasLlama: the sequence length must be known (call the model on arrays / eagerly)")
        if seq > self.llama_config["max_position_embeddings"]:
            raise ValueError(f"KerasLlama: sequence length {seq} is longer than max_position_embeddings "
                             f"{self.llama_config['max_position_embeddings']}")
        h = self.embed_tokens(ops.cast(input_ids, "int32"))
        rope = (ops.convert_to_tensor(self._cos[:seq]), ops.convert_to_tensor(self._sin[:seq]))
        # HF's eager causal mask: 0 where key <= query, the float32 minimum above the diagonal
        mask = ops.convert_to_tensor(np.where(np.tril(np.ones((seq, seq), dtype=bool)), np.float32(0),
                                              np.finfo(np.float32).min).astype(np.float32)[None, None])
        for block in self.decoder_layers:
            h = block(h, position_embeddings=rope, attention_mask=mask)
        return self.lm_head(self.norm(h))


def build_keras_llama(config: Mapping[str, Any]) -> KerasLlama:
    """The port of ``LlamaForCausalLM(LlamaConfig(**config))``, built (weights created, Keras initializers)."""
    model = KerasLlama(config)
    model(np.zeros((1, 2), dtype=np.int32))
    return model


# ------------------------------------------------------------------------------------------------ weights
def _weights(model: KerasLlama) -> dict[str, tuple[Any, bool]]:
    """HF key -> (the Keras variable, whether it is a Dense kernel: stored transposed)."""
    out: dict[str, tuple[Any, bool]] = {"model.embed_tokens.weight": (model.embed_tokens.embeddings, False)}
    for i, block in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            out[f"{p}self_attn.{name}.weight"] = (getattr(block.self_attn, name).kernel, True)
        for name in ("gate_proj", "up_proj", "down_proj"):
            out[f"{p}mlp.{name}.weight"] = (getattr(block.mlp, name).kernel, True)
        out[f"{p}input_layernorm.weight"] = (block.input_layernorm.weight, False)
        out[f"{p}post_attention_layernorm.weight"] = (block.post_attention_layernorm.weight, False)
    out["model.norm.weight"] = (model.norm.weight, False)
    out["lm_head.weight"] = (model.lm_head.kernel, True)
    return out


def load_hf_weights(model: KerasLlama, state_dict: Mapping[str, Any]) -> KerasLlama:
    """Copy an HF Llama ``state_dict`` (numpy arrays or anything ``np.asarray`` takes; torch layouts) into
    ``model``: Dense kernels get ``weight.T``. Every key must be there with its shape, and no other (a
    ValueError names the differences before any weight changes). Returns the model."""
    targets = _weights(model)
    arrays = {k: np.asarray(v) for k, v in state_dict.items() if not k.endswith("rotary_emb.inv_freq")}
    missing, unexpected = sorted(set(targets) - set(arrays)), sorted(set(arrays) - set(targets))
    bad = [f"{k}: {arrays[k].shape}, expected {tuple(v.shape)[::-1] if t else tuple(v.shape)}"
           for k, (v, t) in targets.items() if k in arrays
           and arrays[k].shape != (tuple(v.shape)[::-1] if t else tuple(v.shape))]
    if missing or unexpected or bad:
        raise ValueError(f"load_hf_weights: the state_dict does not fit the model: missing {missing}, unexpected "
                         f"{unexpected}, wrong shapes {bad}")
    for k, (v, transposed) in targets.items():
        a = arrays[k].T if transposed else arrays[k]
        v.assign(a.astype(v.dtype))
    return model


def keras_state_dict(model: KerasLlama) -> dict[str, np.ndarray]:
    """The model's weights under HF keys in torch layouts (Dense kernels transposed back), float32 numpy."""
    return {k: np.ascontiguousarray(np.asarray(v.numpy()).T if t else np.asarray(v.numpy()))
            for k, (v, t) in _weights(model).items()}


# ------------------------------------------------------------------------------------------------ evaluation
def _log_softmax64(logits: np.ndarray) -> np.ndarray:
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def perplexity_keras(model: Any, windows: np.ndarray, batch: int = 32) -> float:
    """exp(mean next-token cross entropy) over ``windows`` (``[n, seq + 1]`` token ids; every position predicted
    once), the logits taken to float64 before the log-softmax: ``llm_common.perplexity_torch`` on Keras."""
    windows = np.asarray(windows)
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        logp = _log_softmax64(np.asarray(model(x[:, :-1].astype(np.int32), training=False)))
        target = x[:, 1:]
        total += float(-np.take_along_axis(logp, target[..., None], axis=-1).sum())
        count += target.size
    return math.exp(total / count)


# ------------------------------------------------------------------------------------------------ check
def main(argv: list[str] | None = None) -> None:
    """Load the trained HF weights into the port and print the held-out perplexity on both backends, dense and
    after SparseGPT 50 % (same calibration windows on both), with the mask entries that differ per block."""
    import argparse

    import torch

    import compressor.tf as ctf
    import compressor.torch as cth
    from examples import llm_common as lc

    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--weights", default=lc.DEFAULT_WEIGHTS,
                    help="trained HF weights (default: llama-bytes-seed0-steps260.pt in $COMPRESSOR_LLM_CACHE, "
                         "else in out/llm of the repository)")
    ap.add_argument("--limit", type=int, default=None, help="held-out windows (default: all)")
    args = ap.parse_args(argv)
    text = lc.corpus()
    tm = lc.build_llama(0)
    tm.load_state_dict(torch.load(args.weights, weights_only=True))
    km = load_hf_weights(build_keras_llama(lc.CONFIG), {k: v.numpy() for k, v in tm.state_dict().items()})
    held = lc.held_out_windows(text, limit=args.limit)
    print(f"dense          torch {lc.perplexity_torch(tm, held):.6f}  keras {perplexity_keras(km, held):.6f}")
    calib = lc.calibration_windows(text)
    cfg = [{"sparsity": 0.5, "op_types": ["default"]}]
    cth.SparseGPTPruner(tm, cfg).calibrate([torch.from_numpy(calib[i:i + 8]) for i in range(0, len(calib), 8)],
                                           progress=False)
    ctf.SparseGPTPruner(km, cfg).calibrate(calib, progress=False)
    ts = {k.replace(".module.", "."): v.numpy() for k, v in tm.state_dict().items() if "mask" not in k}
    ks = keras_state_dict(km)
    differ = [sum(int(np.sum((ts[k] == 0) != (ks[k] == 0))) for k in ks if k.startswith(f"model.layers.{i}.")
                  and ks[k].ndim == 2) for i in range(lc.CONFIG["num_hidden_layers"])]
    print(f"SparseGPT 50 % torch {lc.perplexity_torch(tm, held):.6f}  keras {perplexity_keras(km, held):.6f}  "
          f"mask entries that differ per block {differ}")


if __name__ == "__main__":
    main()
