"""Keras weight layouts <-> the canonical layout core math sees (output channels first, torch's layout).

Pure shape plumbing, no math: Dense ``[in, out]`` -> ``[out, in]``; ConvND ``[k..., in, out]`` ->
``[out, in, k...]``; ConvNDTranspose ``[k..., out, in]`` -> ``[in, out, k...]`` (torch's ConvTranspose
layout); DepthwiseConv2D ``[kh, kw, in, mult]`` -> ``[in * mult, 1, kh, kw]`` (torch's depthwise Conv2d);
1-D weights (BN gamma, biases) are unchanged. In Keras the filters are the LAST kernel axis, so flat
indices, tie-breaks and filter axes match torch once transposed, hence masks are identical.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

__all__ = ["weight_of", "bias_of", "to_canonical", "from_canonical", "canonical_shape", "channel_axis", "WEIGHT_ATTRS",
           "BIAS_ATTRS"]

#: main weight attribute per layer class (first one present wins)
WEIGHT_ATTRS = ("kernel", "depthwise_kernel", "embeddings", "gamma")
#: bias attribute per layer class (BN: beta)
BIAS_ATTRS = ("bias", "beta")

_DEPTHWISE = ("DepthwiseConv1D", "DepthwiseConv2D")


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
    if kind == "vector":
        return tf.reshape(x, shape)
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
    if kind == "depthwise":
        return (s[-2] * s[-1], 1, *s[:-2])
    return (s[-1], s[-2], *s[:-2])


def channel_axis(layer: Any) -> int:
    """Output-channel axis of the layer's output (Keras: last unless ``data_format='channels_first'``)."""
    return 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1
