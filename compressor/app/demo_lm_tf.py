"""The Keras part of ``compressor demo --lm`` (:mod:`compressor.app.demo_lm`): a Keras 3 port of the byte-level
Hugging Face Llama holding the weights trained on PyTorch, compressed one-shot, shipped as ``.keras`` and
measured after reloading it.

The port computes what ``LlamaForCausalLM`` (transformers 5.x, eager attention, no cache) computes for the
demo's config (multi-head attention with rotary embeddings, rotate-half convention; RMSNorm; SiLU-gated MLP;
untied LM head), with every projection a ``Dense(use_bias=False)`` named as in HF, a direct child of its block
(Keras paths ``layers_0/q_proj/kernel``); the decoder layers are the list ``decoder_layers`` (``layers_0``, ...), which the one-shot compressors find as the
repeated blocks. (``examples/llm_keras.py`` is the fuller port the reproduction uses; this one is what the
demo needs, plus saving.) It is registered for Keras serialization and its config records the dtype policy of
every quantized ``Dense`` (``to_keras_quantized`` turns them into Keras's own ``int4`` layers), so
``keras.saving.load_model`` rebuilds the quantized layers and loads their codes.

Shipping: quantized models: :func:`compressor.tf.to_keras_quantized`, ``model.save('x.keras')``; pruned
models: ``export_model(model_path='x.keras', compressed_path=...)`` (the row's size is the compressed file).
Every row's perplexity is measured on the model loaded back from its ``.keras`` file.
"""

from __future__ import annotations

import contextlib
import copy
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import ops

__all__ = ["TfLmHarness", "ByteLlama", "build_byte_llama", "load_hf_weights", "perplexity"]

_PKG = "compressor_demo_lm"


def _rope(head_dim: int, length: int, theta: float = 10000.0) -> tuple[np.ndarray, np.ndarray]:
    """HF's default rotary tables ``(cos, sin)`` ``[length, head_dim]`` in float32."""
    inv = np.float32(1.0) / (np.float32(theta) ** (np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)))
    freqs = np.arange(length, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([freqs, freqs], axis=-1)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


class _RMSNorm(keras.layers.Layer):
    def __init__(self, eps: float, **kw: Any) -> None:
        super().__init__(**kw)
        self.eps = float(eps)

    def build(self, input_shape: Any) -> None:
        self.weight = self.add_weight(name="weight", shape=(int(input_shape[-1]),), initializer="ones")

    def call(self, x: Any) -> Any:
        return self.weight * (x * ops.rsqrt(ops.mean(ops.square(x), axis=-1, keepdims=True) + self.eps))


def _dense(units: int, name: str, path: str, policies: dict[str, Any]) -> keras.layers.Dense:
    policy = policies.get(path)
    kw = {"dtype": keras.dtype_policies.deserialize(policy)} if policy is not None else {}
    return keras.layers.Dense(units, use_bias=False, name=name, **kw)


class _Block(keras.layers.Layer):
    """One ``LlamaDecoderLayer``: pre-norm attention and pre-norm SiLU-gated MLP, each with a residual."""

    def __init__(self, cfg: dict[str, Any], policies: dict[str, Any], **kw: Any) -> None:
        super().__init__(**kw)
        p, h, f = self.name, cfg["hidden_size"], cfg["intermediate_size"]
        self.heads = cfg["num_attention_heads"]
        self.head_dim = h // self.heads
        self.input_layernorm = _RMSNorm(cfg["rms_norm_eps"], name="input_layernorm")
        self.post_attention_layernorm = _RMSNorm(cfg["rms_norm_eps"], name="post_attention_layernorm")
        for n, units in (("q_proj", h), ("k_proj", h), ("v_proj", h), ("o_proj", h)):
            setattr(self, n, _dense(units, n, f"{p}/{n}", policies))
        for n, units in (("gate_proj", f), ("up_proj", f), ("down_proj", h)):
            setattr(self, n, _dense(units, n, f"{p}/{n}", policies))

    def _split(self, x: Any) -> Any:
        s = ops.shape(x)
        return ops.transpose(ops.reshape(x, (s[0], s[1], self.heads, self.head_dim)), (0, 2, 1, 3))

    def call(self, x: Any, cos: Any, sin: Any, mask: Any) -> Any:
        a = self.input_layernorm(x)
        q, k, v = self._split(self.q_proj(a)), self._split(self.k_proj(a)), self._split(self.v_proj(a))
        half = self.head_dim // 2

        def rot(t: Any) -> Any:
            return t * cos + ops.concatenate([-t[..., half:], t[..., :half]], axis=-1) * sin

        q, k = rot(q), rot(k)
        probs = ops.softmax(ops.matmul(q, ops.transpose(k, (0, 1, 3, 2))) * self.head_dim ** -0.5 + mask, axis=-1)
        o = ops.transpose(ops.matmul(probs, v), (0, 2, 1, 3))
        s = ops.shape(o)
        x = x + self.o_proj(ops.reshape(o, (s[0], s[1], self.heads * self.head_dim)))
        m = self.post_attention_layernorm(x)
        return x + self.down_proj(ops.silu(self.gate_proj(m)) * self.up_proj(m))


@keras.saving.register_keras_serializable(package=_PKG)
class ByteLlama(keras.Model):
    """Token ids ``[batch, seq]`` -> logits ``[batch, seq, vocab]``: the demo's HF Llama on Keras.

    ``config``: the ``LlamaConfig`` keys of :meth:`compressor.app.demo_lm.LmProfile.llama_config`;
    ``layer_policies``: Keras path of a ``Dense`` -> its serialized dtype policy (filled in by
    :meth:`get_config` for the layers ``to_keras_quantized`` converted)."""

    def __init__(self, config: dict[str, Any], layer_policies: dict[str, Any] | None = None, **kw: Any) -> None:
        kw.setdefault("name", "llama")
        super().__init__(**kw)
        self.llama_config = dict(config)
        cfg, pol = self.llama_config, dict(layer_policies or {})
        self.embed_tokens = keras.layers.Embedding(cfg["vocab_size"], cfg["hidden_size"], name="embed_tokens")
        self.decoder_layers = [_Block(cfg, pol, name=f"layers_{i}") for i in range(cfg["num_hidden_layers"])]
        self.norm = _RMSNorm(cfg["rms_norm_eps"], name="norm")
        self.lm_head = _dense(cfg["vocab_size"], "lm_head", "lm_head", pol)
        self._cos, self._sin = _rope(cfg["hidden_size"] // cfg["num_attention_heads"], cfg["max_position_embeddings"])

    def call(self, input_ids: Any, training: bool = False) -> Any:
        seq = input_ids.shape[1]
        h = self.embed_tokens(ops.cast(input_ids, "int32"))
        cos, sin = ops.convert_to_tensor(self._cos[:seq]), ops.convert_to_tensor(self._sin[:seq])
        mask = ops.convert_to_tensor(np.where(np.tril(np.ones((seq, seq), dtype=bool)), np.float32(0),
                                              np.finfo(np.float32).min).astype(np.float32)[None, None])
        for block in self.decoder_layers:
            h = block(h, cos, sin, mask)
        return self.lm_head(self.norm(h))

    def _denses(self) -> dict[str, keras.layers.Dense]:
        out = {"lm_head": self.lm_head}
        for b in self.decoder_layers:
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                out[f"{b.name}/{n}"] = getattr(b, n)
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{b.name}/{n}"] = getattr(b, n)
        return out

    def get_config(self) -> dict[str, Any]:
        policies = {p: keras.dtype_policies.serialize(d.dtype_policy) for p, d in self._denses().items()
                    if d.dtype_policy.quantization_mode is not None}
        return {"config": self.llama_config, "layer_policies": policies, "name": self.name}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ByteLlama:
        model = cls(**config)
        cfg = model.llama_config
        for path, d in model._denses().items():  # quantized layers create their integer variables here
            d.build((None, cfg["intermediate_size"] if path.endswith("down_proj") else cfg["hidden_size"]))
            if d.quantization_mode == "awq":
                d.is_awq_calibrated = True  # its codes are in the file (Keras's call would want a float kernel)
        model(np.zeros((1, 2), dtype=np.int32))
        return model


def build_byte_llama(config: dict[str, Any]) -> ByteLlama:
    model = ByteLlama(config)
    model(np.zeros((1, 2), dtype=np.int32))
    return model


def load_hf_weights(model: ByteLlama, state: dict[str, np.ndarray]) -> ByteLlama:
    """Copy the HF ``state_dict`` (numpy, torch layouts; Linear weights transposed into Dense kernels)."""
    model.embed_tokens.embeddings.assign(state["model.embed_tokens.weight"])
    for i, b in enumerate(model.decoder_layers):
        p = f"model.layers.{i}."
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            getattr(b, n).kernel.assign(state[f"{p}self_attn.{n}.weight"].T)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(b, n).kernel.assign(state[f"{p}mlp.{n}.weight"].T)
        b.input_layernorm.weight.assign(state[f"{p}input_layernorm.weight"])
        b.post_attention_layernorm.weight.assign(state[f"{p}post_attention_layernorm.weight"])
    model.norm.weight.assign(state["model.norm.weight"])
    model.lm_head.kernel.assign(state["lm_head.weight"].T)
    return model


def perplexity(model: Any, windows: np.ndarray, batch: int = 16) -> float:
    """``exp`` of the mean next-token cross entropy over ``windows`` (log-softmax in float64)."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch):
        x = windows[i:i + batch]
        z = np.asarray(model(x[:, :-1].astype(np.int32), training=False)).astype(np.float64)
        z = z - z.max(-1, keepdims=True)
        logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
        total -= float(np.take_along_axis(logp, x[:, 1:, None], axis=-1).sum())
        count += x[:, 1:].size
    return math.exp(total / count)


@contextlib.contextmanager
def _threads(n: int | None) -> Any:
    """TF's thread pools are fixed once it has run an op; this only sets them when it can."""
    if n:
        with contextlib.suppress(RuntimeError):
            tf.config.threading.set_intra_op_parallelism_threads(n)
            tf.config.threading.set_inter_op_parallelism_threads(n)
    yield


class TfLmHarness:
    """Ship and measure one-shot compressed copies of the trained Llama on Keras (see the module docstring)."""

    name = "tf"

    def __init__(self, config: dict[str, Any], state: dict[str, np.ndarray]) -> None:
        import compressor.tf as backend

        self.backend = backend
        self.config = config
        self.state = state
        self.notes = ["decode ms/token: not measured on Keras (the port has no KV cache)"]

    def threads(self, n: int | None) -> Any:
        return _threads(n)

    def fresh(self) -> ByteLlama:
        return load_hf_weights(build_byte_llama(self.config), self.state)

    def ship_dense(self, windows: np.ndarray, tmp: str) -> tuple[Any, Any]:
        from .demo_lm_rows import LmRow

        path = os.path.join(tmp, "dense_tf.keras")
        self.fresh().save(path)
        shipped = keras.saving.load_model(path)
        return LmRow("dense", "dense (float32)", perplexity(shipped, windows), None, os.path.getsize(path),
                     ".keras file (float32)", kernel="dense: float32 Dense", file=os.path.basename(path)), shipped

    def run_method(self, method: Any, calib: np.ndarray, windows: np.ndarray, tmp: str) -> tuple[Any, Any]:
        from .demo_lm_rows import LmRow

        model = self.fresh()
        t0 = time.perf_counter()
        compressors = []
        for cls, cfg in method.steps:
            c = getattr(self.backend, cls)(model, copy.deepcopy(list(cfg)))
            if cls == "RtnQuantizer":
                c.calibrate(progress=False)
            else:
                c.calibrate(calib, progress=False)
            compressors.append(c)
        seconds = time.perf_counter() - t0
        ppl_model = perplexity(model, windows)
        path = os.path.join(tmp, f"{method.key}_tf.keras")
        if method.kind == "prune":
            cz = os.path.join(tmp, f"{method.key}_tf.cz")
            compressors[-1].export_model(model_path=path, compressed_path=cz)
            shipped = keras.saving.load_model(path)
            return LmRow(method.key, method.label, perplexity(shipped, windows), ppl_model, os.path.getsize(cz),
                         "compressed file (export_model compressed_path: kept values + positions)", seconds,
                         kernel="pruned: float32 Dense with zeros (.keras)", file=os.path.basename(cz)), shipped
        rows = self.backend.to_keras_quantized(compressors[-1])
        model.save(path)
        shipped = keras.saving.load_model(path)
        modes = sorted({str(r["mode"]) for r in rows})
        return LmRow(method.key, method.label, perplexity(shipped, windows), ppl_model, os.path.getsize(path),
                     ".keras file (Keras int4 layers: codes 2 per byte + group scales, the rest float32)", seconds,
                     kernel=f"{method.label}: Keras's own quantized Dense (mode {', '.join(modes)})",
                     file=os.path.basename(path)), shipped

    def decode_times(self, models: Sequence[Any], prompt: np.ndarray, tokens: int, rounds: int) -> None:
        return None
