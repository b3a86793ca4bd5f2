"""Keras layers with several weight matrices (LSTM / GRU / SimpleRNN and their cells, MultiHeadAttention)
compressed one matrix at a time (mirror of :mod:`compressor.torch.slots`).

A selected layer of these types becomes one *slot* per matrix, named ``<layer path>/<slot>``
(``lstm/kernel``, ``lstm/recurrent_kernel``; ``mha/query``, ``mha/key``, ``mha/value``,
``mha/attention_output``), whose type is the matrix's layout type (:func:`compressor.tf.layout.slots_of`).
Each slot gets its own wrapper on the SAME Keras layer: the wrappers' ``weight`` is the slot's
variable, they are attached as ``_compressor_<kind>__<slot>`` and their calls chain (each quantizer
wrapper substitutes its own matrix through ``keras.StatelessScope``, so the layer's whole call, the
fused / cuDNN recurrent paths included, reads the quantized matrices). Recurrent layers are wrapped at
the layer (not at the cell), attention layers at the attention layer.
"""

from __future__ import annotations

from typing import Any

from ..core.layouts import check_slot_config
from ..core.matching import LayerInfo
from . import layout

__all__ = ["expand_slots", "slot_attr"]


def slot_attr(base: str, layer_info: LayerInfo) -> str:
    """The layer attribute holding the wrapper of ``layer_info`` (``base``, plus ``__<slot>`` for a slot)."""
    slot = layer_info.extra.get("slot")
    return base if slot is None else f"{base}__{slot}"


def expand_slots(what: str, selected: list[tuple[LayerInfo, dict[str, Any]]],
                 by_name: dict[str, Any]) -> list[tuple[LayerInfo, dict[str, Any]]]:
    """Replace each selected multi-weight layer by its slots (added to ``by_name``, mapping to the layer);
    layers nested in a selected multi-weight layer (its cell, its EinsumDense projections) are dropped:
    the slots cover their weights. Checks what these layers cannot take. Changes nothing."""
    multi = [info.name for info, _ in selected if layout.slots_of(by_name[info.name]) is not None]
    out: list[tuple[LayerInfo, dict[str, Any]]] = []
    for info, cfg in selected:
        if any(info.name.startswith(m + "/") for m in multi):
            continue
        layer = by_name[info.name]
        check_slot_config(what, info.name, info.type, cfg)
        slots = layout.slots_of(layer)
        if slots is None:
            out.append((info, cfg))
            continue
        for slot, layout_type in slots:
            name = f"{info.name}/{slot}"
            by_name[name] = layer
            out.append((LayerInfo(name, layout_type, {**info.extra, "slot": slot}), cfg))
    return out
