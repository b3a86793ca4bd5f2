"""Keras weight layouts <-> the canonical layout core math sees (output channels first, torch's layout).

Pure shape plumbing, no math: Dense ``[in, out]`` -> ``[out, in]``; ConvND ``[k..., in, out]`` ->
``[out, in, k...]``; ConvNDTranspose ``[k..., out, in]`` -> ``[in, out, k...]`` (torch's ConvTranspose
layout); DepthwiseConv2D ``[kh, kw, in, mult]`` -> ``[in * mult, 1, kh, kw]`` (torch's depthwise Conv2d);
1-D weights (BN gamma, biases) are unchanged. The value projection of a MultiHeadAttention pruned by heads
(layer type :data:`HEADS_VALUE`): EinsumDense kernel ``[in, heads, head_dim]`` -> ``[heads * head_dim, in]``
(torch's value Linear: one filter per context channel), bias ``[heads, head_dim]`` -> ``[heads * head_dim]``.
In Keras the filters are the LAST kernel axis, so flat
indices, tie-breaks and filter axes match torch once transposed, hence masks are identical.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["weight_of", "bias_of", "to_canonical", "from_canonical", "canonical_shape", "channel_axis", "WEIGHT_ATTRS",
           "BIAS_ATTRS", "HEADS_VALUE"]

#: main weight attribute per layer class (first one present wins)
WEIGHT_ATTRS = ("kernel", "depthwise_kernel", "embeddings", "gamma")
#: bias attribute per layer class (BN: beta)
BIAS_ATTRS = ("bias", "beta")

_DEPTHWISE = ("DepthwiseConv1D", "DepthwiseConv2D")
#: layout type of a MultiHeadAttention's value EinsumDense pruned by heads (kernel [in, heads, head_dim])
HEADS_VALUE = "MultiHeadAttention(value)"


def _var(layer: Any, attr: str) -> Any:
    if not getattr(layer, "built", False):
        return None
    try:
        v = getattr(layer, attr, None)
    except (AttributeError, ValueError):
        return None
    return v if v is not None and hasattr(v, "assign") else None


def weight_of(layer: Any) -> Any:
    """The layer's main weight variable, or None (unbuilt, or no known weight)."""
    if type(layer).__name__ == "BatchNormalization" or hasattr(layer, "moving_mean"):
        return _var(layer, "gamma")
    for attr in WEIGHT_ATTRS:
        v = _var(layer, attr)
        if v is not None:
            return v
    return None


def bias_of(layer: Any) -> Any:
    """The layer's bias variable (BN: beta), or None."""
    for attr in BIAS_ATTRS:
        v = _var(layer, attr)
        if v is not None:
            return v
    return None


def _kind(layer_type: str, ndim: int) -> str:
    if ndim <= 1:
        return "vector"
    if layer_type == HEADS_VALUE:
        return "heads" if ndim == 3 else "heads_bias"
    if layer_type in _DEPTHWISE:
        return "depthwise"
    if "Transpose" in layer_type:
        return "transpose"
    return "dense_or_conv"


def to_canonical(layer_type: str, x: Any) -> Any:
    """A Keras-layout weight (or mask) of a ``layer_type`` layer in canonical layout."""
    nd = len(x.shape)
    kind = _kind(layer_type, nd)
    if kind == "vector":
        return x
    if kind == "heads_bias":  # [heads, head_dim] -> [heads * head_dim]
        return tf.reshape(x, [-1])
    if kind == "heads":  # [in, heads, head_dim] -> [in, heads * head_dim] -> [heads * head_dim, in]
        s = [int(d) for d in x.shape]
        return tf.transpose(tf.reshape(x, [s[0], s[1] * s[2]]))
    if kind == "depthwise":  # [k..., in, mult] -> [in, mult, k...] -> [in*mult, 1, k...]
        perm = [nd - 2, nd - 1] + list(range(nd - 2))
        t = tf.transpose(x, perm)
        s = t.shape
        return tf.reshape(t, [int(s[0]) * int(s[1]), 1] + [int(d) for d in s[2:]])
    # [k..., a, b] -> [b, a, k...] (Dense: [in, out] -> [out, in])
    perm = [nd - 1, nd - 2] + list(range(nd - 2))
    return tf.transpose(x, perm)


def from_canonical(layer_type: str, x: Any, keras_shape: Any) -> Any:
    """Inverse of :func:`to_canonical` for a weight whose Keras shape is ``keras_shape``."""
    shape = [int(d) for d in keras_shape]
    nd = len(shape)
    kind = _kind(layer_type, nd)
    if kind in ("vector", "heads_bias"):
        return tf.reshape(x, shape)
    if kind == "heads":
        return tf.reshape(tf.transpose(x), shape)
    if kind == "depthwise":
        t = tf.reshape(x, [shape[-2], shape[-1]] + shape[:-2])
        return tf.transpose(t, list(range(2, nd)) + [0, 1])
    perm = list(range(2, nd)) + [1, 0]
    return tf.transpose(x, perm)


def canonical_shape(layer_type: str, keras_shape: Any) -> tuple[int, ...]:
    """The shape :func:`to_canonical` gives a weight of Keras shape ``keras_shape`` (static, no tensor)."""
    s = [int(d) for d in keras_shape]
    kind = _kind(layer_type, len(s))
    if kind == "vector":
        return tuple(s)
    if kind == "heads_bias":
        return (s[0] * s[1],)
    if kind == "heads":
        return (s[1] * s[2], s[0])
    if kind == "depthwise":
        return (s[-2] * s[-1], 1, *s[:-2])
    return (s[-1], s[-2], *s[:-2])


def channel_axis(layer: Any) -> int:
    """Output-channel axis of the layer's output (Keras: last unless ``data_format='channels_first'``)."""
    return 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1
