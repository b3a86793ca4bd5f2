"""One-shot weight-only quantizers for language models: :class:`GptqQuantizer`,
:class:`RtnQuantizer` (round to nearest, the baseline) and :class:`AwqQuantizer`.

``q = GptqQuantizer(model, [{'quant_bits': 4, 'group_size': 128, 'op_types': ['default']}]); q.calibrate(batches)``
runs the model block by block (:mod:`compressor.torch.sequential`), quantizes each layer's weight with the core
math (:mod:`compressor.core.oneshot`) and writes the DEQUANTIZED weight (what the method settled on; AWQ:
``Q(W s) / s``) into the layer, which sits in a :class:`QuantizerModuleWrapper` as with every quantizer.
The integer form is kept on the wrapper for a low-bit export, in the canonical ``[out, in]`` layout:
``weight_codes`` (int8 symmetric / uint8 affine; at 4 bits or fewer two codes per byte, ``[out, ceil(in / 2)]``:
:func:`compressor.core.oneshot.store_codes`; :func:`oneshot_codes` gives them back one per entry), ``weight_group_scale`` (float32 ``[out, groups]``),
``weight_group_zero_point`` (int32 ``[out, groups]``; 0 when symmetric), AWQ's ``awq_scales`` (float32
``[in]``: the codes quantize ``W * s``); ``oneshot_calibrated`` says whether they are filled.

Config keys: ``quant_bits`` (2..8; ``quant_types`` defaults to ``['weight']``, the only type), ``group_size``
(input columns per group; default one group per output channel), ``quant_scheme`` (``'symmetric'``
(default) / ``'affine'``, or the ``per_channel_*`` names); GPTQ ``damp``, ``block_size``, ``act_order``; AWQ
``n_grid``, ``duo_scaling``, ``apply_clip``. A layer already pruned by a pruner (its wrapper under the quantizer's) keeps its
zeros. RTN needs no calibration data: ``RtnQuantizer(model, config).calibrate()``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from ...core.errors import ConfigError
from ...core.oneshot import (
    QUANT_SCHEME_KEY,
    AwqMethod,
    GptqMethod,
    LayerResult,
    RtnMethod,
    quant_spec_of,
    store_codes,
    stored_code_width,
    weight_only_config,
)
from ..layout import canonical_shape
from ..modules import is_wrapper
from ..sequential import OneShotMixin, OneShotReport, oneshot_key_specs
from .quantizer import TorchQuantizer, builtin_ste
from .wrapper import QuantizerModuleWrapper

__all__ = ["GptqQuantizer", "RtnQuantizer", "AwqQuantizer"]


def _packs_loaded_codes(bits: int, n_in: int) -> Any:
    """A load_state_dict pre-hook: a state saved before codes were kept two per byte (``weight_codes`` of ``n_in``
    columns, one code per entry) loads as the packed form."""
    def hook(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        key = prefix + "weight_codes"
        v = state_dict.get(key)
        if torch.is_tensor(v) and v.dim() == 2 and v.shape[1] == n_in and v.dtype in (torch.int8, torch.uint8):
            state_dict[key] = torch.from_numpy(store_codes(v.detach().cpu().numpy(), bits)).to(v.device)
    return hook


class _OneShotQuantizer(OneShotMixin, TorchQuantizer):
    required_keys = ("quant_bits",)
    supported_quant_types = ("weight",)
    config_keys: tuple[Any, ...] = (QUANT_SCHEME_KEY, *oneshot_key_specs("group_size", "quant_range"))

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], sequential_targets: Any = None):
        self._init_oneshot(model, sequential_targets)
        super().__init__(model, weight_only_config(config_list))

    def validate_config(self, config_list: list[dict[str, Any]]) -> None:
        for i, c in enumerate(config_list):
            if c["exclude"]:
                continue
            if c.get("quant_types") != ["weight"]:
                raise ConfigError(f"config_list[{i}]: {type(self).__name__} quantizes weights only: quant_types must be "
                                  f"['weight'] (or left out), got {c.get('quant_types')}")
            quant_spec_of(c, type(self).__name__)

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        # the layer's grid, resolved once: the one-shot run and the checkpoint export read it from here
        spec = wrapper.quant_spec = quant_spec_of(wrapper.config, type(self).__name__)
        n_out, n_in = canonical_shape(wrapper.layer, wrapper.layer.weight.shape)  # (not flagged a wrapper yet)
        groups = math.ceil(n_in / spec.group_width(n_in))
        dev = wrapper.weight.device
        wrapper.register_buffer("weight_codes", torch.zeros((n_out, stored_code_width(n_in, spec.bits)), device=dev,
                                                            dtype=torch.int8 if spec.symmetric else torch.uint8))
        wrapper.register_buffer("weight_group_scale", torch.zeros((n_out, groups), dtype=torch.float32, device=dev))
        wrapper.register_buffer("weight_group_zero_point", torch.zeros((n_out, groups), dtype=torch.int32, device=dev))
        if self.method_class is AwqMethod:
            wrapper.register_buffer("awq_scales", torch.ones(n_in, dtype=torch.float32, device=dev))
        wrapper.register_buffer("oneshot_calibrated", torch.zeros((), dtype=torch.bool, device=dev))
        if stored_code_width(n_in, spec.bits) != n_in:
            wrapper.register_load_state_dict_pre_hook(_packs_loaded_codes(spec.bits, n_in))

    @builtin_ste
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return weight  # calibrate() wrote the dequantized weight into the layer

    def _oneshot_mask(self, wrapper: nn.Module) -> torch.Tensor | None:
        inner = wrapper.module
        return inner.weight_mask if is_wrapper(inner) and isinstance(getattr(inner, "weight_mask", None),
                                                                    torch.Tensor) else None

    def _oneshot_write(self, wrapper: nn.Module, result: LayerResult) -> None:
        q = result.quantized
        buf = wrapper._buffers
        if q.scale.shape != tuple(buf["weight_group_scale"].shape):
            raise ConfigError(f"{type(self).__name__}: layer {wrapper.name!r}: {q.scale.shape[1]} groups, expected "
                              f"{buf['weight_group_scale'].shape[1]}")
        with torch.no_grad():
            buf["weight_codes"].copy_(torch.from_numpy(store_codes(q.codes, q.spec.bits)))
            buf["weight_group_scale"].copy_(torch.from_numpy(q.scale))
            buf["weight_group_zero_point"].copy_(torch.from_numpy(q.zero_point).to(torch.int32))
            if result.scales is not None:
                buf["awq_scales"].copy_(torch.from_numpy(result.scales))
            buf["oneshot_calibrated"].fill_(True)
        inner = wrapper.module
        if is_wrapper(inner) and hasattr(inner, "apply_masks"):
            inner.apply_masks()

    def report(self) -> OneShotReport:
        """One row per quantized layer from the last :meth:`calibrate`: ``layer``, ``block``, ``method``,
        ``bits``, ``group_size`` and the method's numbers (GPTQ's ``error``, AWQ's ``alpha``)."""
        return OneShotReport(self.oneshot_rows)


class GptqQuantizer(_OneShotQuantizer):
    """GPTQ (Frantar et al. 2022): weight-only quantization column by column with OBS error feedback from each
    layer's Hessian ``X^T X``; ``group_size``, symmetric / affine, ``act_order``, ``damp``, ``block_size``."""

    method_class = GptqMethod
    config_keys = (*_OneShotQuantizer.config_keys, *oneshot_key_specs("damp", "block_size", "act_order"))


class RtnQuantizer(_OneShotQuantizer):
    """Round to nearest per group, weight-only (the baseline of GPTQ and AWQ; no calibration data)."""

    method_class = RtnMethod


class AwqQuantizer(_OneShotQuantizer):
    """AWQ (Lin et al. 2023): per-input-channel scales ``s = mean|X|^alpha`` (grid over alpha, by the layer's
    output error on the calibration data), then round to nearest of ``W * s``; the layer computes with
    ``Q(W s) / s``; with ``apply_clip`` (default) the scaled weight's range is clipped per group first (AutoAWQ's
    clipping search)."""

    method_class = AwqMethod
    config_keys = (*_OneShotQuantizer.config_keys, *oneshot_key_specs("n_grid", "duo_scaling", "awq_search",
                                                                          "search_samples", "apply_clip"))
