"""Keras weight layouts <-> the canonical layout core math sees (output channels first, torch's layout).

Pure shape plumbing, no math: Dense ``[in, out]`` -> ``[out, in]``; ConvND ``[k..., in, out]`` ->
``[out, in, k...]``; ConvNDTranspose ``[k..., out, in]`` -> ``[in, out, k...]`` (torch's ConvTranspose
layout); DepthwiseConv2D ``[kh, kw, in, mult]`` -> ``[in * mult, 1, kh, kw]`` (torch's depthwise Conv2d);
1-D weights (BN gamma, biases) are unchanged; Embedding ``[num, dim]`` is torch's layout already. Recurrent
and attention layers hold several matrices, each compressed on its own as a *slot* of the layer (its
``kernel`` / ``recurrent_kernel``, its ``query`` / ``key`` / ``value`` / ``attention_output`` kernels):
:func:`slots_of`, ``weight_of(layer, slot)``, and their canonical layouts (gate blocks of a GRU reordered
into torch's order) in :mod:`compressor.core.layouts`. The value projection of a MultiHeadAttention pruned by heads
(layer type :data:`HEADS_VALUE`): EinsumDense kernel ``[in, heads, head_dim]`` -> ``[heads * head_dim, in]``
(torch's value Linear: one filter per context channel), bias ``[heads, head_dim]`` -> ``[heads * head_dim]``.
In Keras the filters are the LAST kernel axis, so flat
indices, tie-breaks and filter axes match torch once transposed, hence masks are identical.
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from ..core import layouts as core_layouts
from ..core.layouts import KERAS_MHA_SLOTS, KERAS_RECURRENT_SLOTS, MHA_ROLES, mha_layout_type, recurrent_kind

__all__ = ["weight_of", "bias_of", "to_canonical", "from_canonical", "canonical_shape", "channel_axis", "WEIGHT_ATTRS",
           "BIAS_ATTRS", "HEADS_VALUE", "KNOWN_WEIGHTS", "resolve", "slot_owner", "slots_of", "weight_facts"]

#: main weight attribute per layer class (first one present wins)
WEIGHT_ATTRS = ("kernel", "depthwise_kernel", "embeddings", "gamma")
#: bias attribute per layer class (BN: beta)
BIAS_ATTRS = ("bias", "beta")

_DEPTHWISE = ("DepthwiseConv1D", "DepthwiseConv2D")
#: layout type of a MultiHeadAttention's value EinsumDense pruned by heads (kernel [in, heads, head_dim])
HEADS_VALUE = "MultiHeadAttention(value)"
#: what compressors can take, for error messages
KNOWN_WEIGHTS = ("layers with a 'kernel' (Dense, Conv*, EinsumDense), 'depthwise_kernel', 'embeddings' (Embedding) or "
                 "'gamma' (norms); LSTM / GRU / SimpleRNN layers and their cells ('kernel' and 'recurrent_kernel'); "
                 "MultiHeadAttention ('query', 'key', 'value', 'attention_output' kernels)")
_MHA_DENSE = {"query": "_query_dense", "key": "_key_dense", "value": "_value_dense",
              "attention_output": "_output_dense"}


def _cell(layer: Any) -> Any:
    """The cell of a recurrent layer (``layer.cell``) or the cell itself; None for other layers."""
    if recurrent_kind(type(layer).__name__) is not None and not hasattr(layer, "cell"):
        return layer  # LSTMCell, GRUCell, SimpleRNNCell
    cell = getattr(layer, "cell", None)
    if cell is not None and recurrent_kind(type(cell).__name__) is not None:
        return cell  # LSTM, GRU, SimpleRNN, or a keras.layers.RNN of one such cell
    return None


def slots_of(layer: Any) -> list[tuple[str, str]] | None:
    """``[(slot, layout type), ...]`` of a layer with several weight matrices (recurrent layers and cells,
    MultiHeadAttention), in canonical order; None for other layers. The layout type names the kind of
    matrix (``'LSTM'``, ``'GRUCell'``, ``'MultiHeadAttention(query)'``) for :func:`to_canonical`."""
    import keras

    if isinstance(layer, keras.layers.MultiHeadAttention):
        return [(slot, mha_layout_type(role)) for slot, role in zip(KERAS_MHA_SLOTS, MHA_ROLES)]
    cell = _cell(layer)
    if cell is None:
        return None
    kind = type(layer).__name__ if recurrent_kind(type(layer).__name__) is not None else type(cell).__name__
    return [(slot, kind) for slot in KERAS_RECURRENT_SLOTS]


def _slot_var(layer: Any, slot: str) -> Any:
    if slot in _MHA_DENSE:
        dense = getattr(layer, _MHA_DENSE[slot], None)
        return None if dense is None else _var(dense, "kernel")
    cell = _cell(layer)
    return None if cell is None else _var(cell, slot)


def resolve(layers: dict[str, Any], name: str) -> tuple[Any, str | None] | None:
    """``(layer, slot)`` a weight name of a mask file means: the layer of that path (``(layer, None)``), else
    ``'<layer>/<slot>'``, a matrix of a recurrent / attention layer; None when the model has neither. (An
    attention layer's ``'mha/query'`` is both: the projection's path, the same kernel.)"""
    if name in layers:
        return layers[name], None
    return slot_owner(layers, name)


def slot_owner(layers: dict[str, Any], name: str) -> tuple[Any, str] | None:
    """``(layer, slot)`` if ``name`` is ``'<layer>/<slot>'`` for a recurrent / attention layer, else None."""
    parent, _, slot = name.rpartition("/")
    if parent in layers and any(s == slot for s, _ in slots_of(layers[parent]) or ()):
        return layers[parent], slot
    return None


def weight_facts(layer: Any) -> dict[str, Any]:
    """``LayerInfo.extra`` facts of a layer: its own variables' size and whether a compressor can take a
    weight of it (for the note on what ``op_types: ['default']`` leaves out)."""
    own = list(getattr(layer, "_trainable_variables", ())) + list(getattr(layer, "_non_trainable_variables", ()))
    params = sum(math.prod(int(d) for d in v.shape) for v in own)
    return {"params": params, "weighted": weight_of(layer) is not None or slots_of(layer) is not None}


def _var(layer: Any, attr: str) -> Any:
    if not getattr(layer, "built", False):
        return None
    try:
        v = getattr(layer, attr, None)
    except (AttributeError, ValueError):
        return None
    return v if v is not None and hasattr(v, "assign") else None


def weight_of(layer: Any, slot: str | None = None) -> Any:
    """The layer's main weight variable (with ``slot``: that matrix of a recurrent / attention layer, see
    :func:`slots_of`), or None (unbuilt, or no known weight)."""
    if slot is not None:
        return _slot_var(layer, slot)
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
    if core_layouts.canonical_shape_from_keras(layer_type, [1] * ndim) is not None and layer_type != HEADS_VALUE:
        return "core"  # recurrent, embedding, attention matrices: core.layouts
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
    if kind == "core":
        return core_layouts.canonical_from_keras(_ops(), layer_type, x)
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
    if kind == "core":
        return core_layouts.keras_from_canonical(_ops(), layer_type, x, shape)
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
    if kind == "core":
        return core_layouts.canonical_shape_from_keras(layer_type, s)
    if kind == "heads_bias":
        return (s[0] * s[1],)
    if kind == "heads":
        return (s[1] * s[2], s[0])
    if kind == "depthwise":
        return (s[-2] * s[-1], 1, *s[:-2])
    return (s[-1], s[-2], *s[:-2])


def _ops() -> Any:
    from .ops import ops

    return ops


def channel_axis(layer: Any) -> int:
    """Output-channel axis of the layer's output (Keras: last unless ``data_format='channels_first'``)."""
    return 1 if getattr(layer, "data_format", "channels_last") == "channels_first" else -1
