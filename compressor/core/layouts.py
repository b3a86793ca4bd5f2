"""Recurrent, embedding and attention weights: which matrices a layer has, and their canonical layout.

A layer of these kinds holds several weight matrices; each is compressed on its own ("per weight
matrix": a matrix of n weights at sparsity s loses exactly ``floor(n * s)``, its own quantization
range), so a layer becomes one *slot* per matrix. Both backends name the same matrices differently and
store them in different layouts; core math sees every matrix in ONE canonical layout, PyTorch's, so flat
indices, tie-breaks and hence masks are identical on both backends for the same weights:

===========================  ================================  =====================================
matrix (canonical shape)     PyTorch                           Keras 3
===========================  ================================  =====================================
input  ``[G*H, in]``         ``weight_ih_l{k}[_reverse]``       cell ``kernel`` ``[in, G*H]``
recurrent ``[G*H, H]``       ``weight_hh_l{k}[_reverse]``       cell ``recurrent_kernel`` ``[H, G*H]``
LSTM projection ``[P, H]``   ``weight_hr_l{k}[_reverse]``       (none)
embedding ``[num, dim]``     ``Embedding.weight``              ``Embedding.embeddings`` (same layout)
attention query/key/value    ``in_proj_weight`` row blocks     ``query``/``key``/``value`` EinsumDense
``[heads*head_dim, in]``     (or ``q/k/v_proj_weight``)        kernels ``[in, heads, head_dim]``
attention output             ``out_proj.weight``               ``attention_output`` kernel
``[out, heads*head_dim]``                                      ``[heads, head_dim, out]``
===========================  ================================  =====================================

``G`` gates are packed along the output axis in blocks of ``H`` rows, in PyTorch's gate order:
LSTM (i, f, g, o), Keras (i, f, c, o): the same order (Keras' c is torch's g, the cell candidate);
GRU torch (r, z, n), Keras (z, r, h): reset and update are swapped, so Keras' blocks are permuted
into torch's order (:func:`gate_order_from_keras`). Keras GRUs must use ``reset_after=True`` (the
default) to compute what torch's GRU computes; the layout is the same either way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .errors import ConfigError
from .ops import Array, ArrayOps

__all__ = [
    "ATTENTION_TYPES", "EMBEDDING_TYPES", "KERAS_MHA_SLOTS", "KERAS_RECURRENT_SLOTS", "MHA_ROLES", "MULTI_WEIGHT_TYPES",
    "NORM_TYPES", "RECURRENT_TYPES", "is_norm_type", "TORCH_MHA_SLOTS", "canonical_from_keras", "canonical_shape_from_keras",
    "check_slot_config", "gate_order_from_keras", "is_multi_weight", "keras_from_canonical", "mha_layout_type",
    "mha_role", "recurrent_kind", "torch_recurrent_weights",
]

#: recurrent layer and cell class names of both backends -> their kind (gate structure)
RECURRENT_TYPES: dict[str, str] = {
    "LSTM": "LSTM", "LSTMCell": "LSTM",
    "GRU": "GRU", "GRUCell": "GRU",
    "RNN": "RNN", "RNNCell": "RNN", "SimpleRNN": "RNN", "SimpleRNNCell": "RNN",
}
#: gates per recurrent kind
GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
_TORCH_GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("r", "z", "n"), "RNN": ("h",)}
_KERAS_GATES = {"LSTM": ("i", "f", "g", "o"), "GRU": ("z", "r", "n"), "RNN": ("h",)}  # Keras' c = g, h = n

ATTENTION_TYPES = ("MultiheadAttention", "MultiHeadAttention")
EMBEDDING_TYPES = ("Embedding",)
#: layer types compressed one weight matrix (slot) at a time
MULTI_WEIGHT_TYPES = frozenset(RECURRENT_TYPES) | frozenset(ATTENTION_TYPES)

#: attention matrices in canonical order, and their names on each backend
MHA_ROLES = ("query", "key", "value", "output")
TORCH_MHA_SLOTS = ("q_proj", "k_proj", "v_proj", "out_proj")
KERAS_MHA_SLOTS = ("query", "key", "value", "attention_output")
#: a Keras recurrent layer's (or cell's) matrices, in canonical order
KERAS_RECURRENT_SLOTS = ("kernel", "recurrent_kernel")

#: normalisation layers: weighted, but not what 'default' is about (see matching.default_skip_warning)
NORM_TYPES = frozenset({
    "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "BatchNormalization", "LayerNorm",
    "LayerNormalization", "GroupNorm", "GroupNormalization", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d",
    "RMSNorm", "RMSNormalization", "UnitNormalization", "LocalResponseNorm", "Normalization",
})


def is_norm_type(layer_type: str) -> bool:
    """A normalisation layer by its type name: the known ones, and model-family norms named like them
    (``LlamaRMSNorm``, ``ConvNextLayerNorm``, ConvNeXt V2's ``...GRN``, global response norm)."""
    return layer_type in NORM_TYPES or layer_type.endswith(("Norm", "Normalization", "GRN"))


def recurrent_kind(layer_type: str) -> str | None:
    """'LSTM', 'GRU' or 'RNN' for a recurrent layer or cell type name, else None."""
    return RECURRENT_TYPES.get(layer_type)


def is_multi_weight(layer_type: str) -> bool:
    """True for the layer types compressed one weight matrix at a time (recurrent, attention)."""
    return layer_type in MULTI_WEIGHT_TYPES


def mha_layout_type(role: str) -> str:
    """Layout type name of one attention matrix (``'MultiHeadAttention(query)'``, ...)."""
    if role not in MHA_ROLES:
        raise ValueError(f"unknown attention matrix {role!r}; known: {list(MHA_ROLES)}")
    return f"MultiHeadAttention({role})"


def mha_role(layout_type: str) -> str | None:
    """The attention matrix role of a :func:`mha_layout_type` name, else None."""
    for role in MHA_ROLES:
        if layout_type == f"MultiHeadAttention({role})":
            return role
    return None


def torch_recurrent_weights(num_layers: int, bidirectional: bool, proj_size: int = 0) -> list[str]:
    """Weight matrix names of a torch ``nn.LSTM``/``nn.GRU``/``nn.RNN``, in torch's ``_flat_weights`` order."""
    names = []
    for k in range(num_layers):
        for suffix in ("", "_reverse") if bidirectional else ("",):
            names += [f"weight_ih_l{k}{suffix}", f"weight_hh_l{k}{suffix}"]
            if proj_size > 0:
                names.append(f"weight_hr_l{k}{suffix}")
    return names


def gate_order_from_keras(kind: str) -> tuple[int, ...]:
    """Block ``i`` of the canonical gate axis is Keras' block ``order[i]`` (GRU: (1, 0, 2))."""
    keras_gates = _KERAS_GATES[kind]
    return tuple(keras_gates.index(g) for g in _TORCH_GATES[kind])


def _permute_blocks(ops: ArrayOps, x: Array, order: Sequence[int]) -> Array:
    if list(order) == sorted(order):
        return x
    n = ops.shape(x)[0]
    size = n // len(order)
    blocks = ops.split(x, [size] * len(order), 0)
    return ops.concat([blocks[i] for i in order], 0)


def _inverse(order: Sequence[int]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, j in enumerate(order):
        inv[j] = i
    return tuple(inv)


def canonical_from_keras(ops: ArrayOps, layout_type: str, x: Array) -> Array | None:
    """A Keras-layout recurrent / embedding / attention weight (or mask) in the canonical layout, or
    None when ``layout_type`` is not one of these kinds (the caller handles Dense/Conv itself)."""
    nd = len(ops.shape(x))
    if layout_type in EMBEDDING_TYPES:
        return x
    kind = recurrent_kind(layout_type)
    if kind is not None and nd == 2:
        return _permute_blocks(ops, ops.transpose(x, (1, 0)), gate_order_from_keras(kind))
    role = mha_role(layout_type)
    if role is not None and nd == 3:
        s = ops.shape(x)
        if role == "output":  # [heads, head_dim, out] -> [heads*head_dim, out] -> [out, heads*head_dim]
            return ops.transpose(ops.reshape(x, (s[0] * s[1], s[2])), (1, 0))
        return ops.transpose(ops.reshape(x, (s[0], s[1] * s[2])), (1, 0))  # [in, h, d] -> [h*d, in]
    return None


def keras_from_canonical(ops: ArrayOps, layout_type: str, x: Array, keras_shape: Sequence[int]) -> Array | None:
    """Inverse of :func:`canonical_from_keras` for a weight of Keras shape ``keras_shape``."""
    shape = [int(d) for d in keras_shape]
    if layout_type in EMBEDDING_TYPES:
        return ops.reshape(x, shape)
    kind = recurrent_kind(layout_type)
    if kind is not None and len(shape) == 2:
        return ops.transpose(_permute_blocks(ops, x, _inverse(gate_order_from_keras(kind))), (1, 0))
    role = mha_role(layout_type)
    if role is not None and len(shape) == 3:
        return ops.reshape(ops.transpose(x, (1, 0)), shape)
    return None


def canonical_shape_from_keras(layout_type: str, keras_shape: Sequence[int]) -> tuple[int, ...] | None:
    """The shape :func:`canonical_from_keras` gives (static), or None for other kinds."""
    s = [int(d) for d in keras_shape]
    if layout_type in EMBEDDING_TYPES:
        return tuple(s)
    if recurrent_kind(layout_type) is not None and len(s) == 2:
        return (s[1], s[0])
    role = mha_role(layout_type)
    if role is not None and len(s) == 3:
        return (s[2], s[0] * s[1]) if role == "output" else (s[1] * s[2], s[0])
    return None


def check_slot_config(what: str, layer_name: str, layer_type: str, config: dict[str, Any]) -> None:
    """Refuse, before anything changes, what cannot apply to a recurrent / attention / embedding layer:

    * input / output quantization of a recurrent or attention layer (its inputs and outputs are tuples
      and states; only its weight matrices are quantized);
    * input quantization of an Embedding (its input is token indices);
    * per-channel weight schemes (the channel axis of these matrices differs between the backends'
      conventions, so the result would not be the same model on both).
    """
    types = list(config.get("quant_types", ()))
    multi = is_multi_weight(layer_type)
    where = f"{what}: layer {layer_name!r} ({layer_type})"
    if multi and any(t != "weight" for t in types):
        raise ConfigError(f"{where}: quant_types {types} is not supported; recurrent and attention layers "
                          f"quantize their weight matrices only (quant_types: ['weight'])")
    if layer_type in EMBEDDING_TYPES and "input" in types:
        raise ConfigError(f"{where}: 'input' quantization is not supported (an Embedding's input is token "
                          f"indices); use quant_types ['weight'] and/or ['output']")
    if (multi or layer_type in EMBEDDING_TYPES) and "weight" in types:
        scheme = config.get("quant_scheme")
        scheme = scheme.get("weight") if isinstance(scheme, dict) else scheme
        if isinstance(scheme, str) and scheme.startswith("per_channel"):
            raise ConfigError(f"{where}: quant_scheme {scheme!r} is not supported for its weights; use "
                              f"'per_tensor_affine' or 'per_tensor_symmetric'")
