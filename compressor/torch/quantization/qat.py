"""``QAT_Quantizer``: quantization-aware training (Jacob et al. 2018).

* weights: min/max of the current weight at every forward -> scale/zero point
  (:func:`compressor.core.quant.qparams`), fake-quantized with torch's fused kernel;
* inputs/outputs: min/max tracked with an EMA (decay 0.99; the first observation seeds it) in
  training mode; eval mode uses the stored scale and zero point (a layer never observed passes its
  activations through unchanged);
* ``quant_start_step``: until that many optimizer steps, tensors pass unchanged (ranges still tracked);
* keys ``quant_dtype`` ('int' | 'uint') and ``quant_scheme`` (per_tensor/per_channel x affine/symmetric),
  a value or a dict per quant type; defaults in :mod:`.settings` (uint, per_tensor_affine);
* ``bn_fold=True`` (or NNI's ``dummy_input=...``): each Conv2d followed only by a BatchNorm2d trains
  with the BN folded into its weight (see :mod:`.bn_fold`).
* ``fuse_relu=True`` (default False here, True for PtqQuantizer): a quantized layer whose output (after
  its folded BN) feeds only a ReLU quantizes ``relu(output)``, as deployment runtimes do (TFLite and
  onnxruntime fuse Conv+ReLU and quantize after the ReLU): the whole 8-bit range then covers values >= 0
  instead of wasting the codes below zero, and the exported int8 graph needs no separate ReLU. Found with
  ``torch.fx``; the model's own ReLU stays (it changes nothing).

State per layer, saved in the state_dict: ``<type>_scale``, ``<type>_zero_point`` and for activations
``tracked_min_<type>``, ``tracked_max_<type>``, ``<type>_observed``. All updates are in place, on device,
without host synchronisation (so they survive ``nn.DataParallel``: its first replica shares the original's
buffers, like BatchNorm's running statistics; the other replicas' chunks are not observed).

Under torch.distributed (DDP) the per-batch activation min/max are reduced over the ranks (MIN / MAX)
before the EMA, so every rank tracks the same ranges: those of the global batch, as one process on the
concatenated batch would. This makes a training-mode forward of a quantized layer a collective: all ranks
must run it (DDP does); evaluate in ``eval()`` mode, or set ``quantizer.sync_ranks = False``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...core import quant as cq
from ...core.errors import ConfigError
from ...core.matching import LayerInfo
from ..distributed import all_reduce_max, all_reduce_min
from .bn_fold import BNFolding, find_fused_activations
from .fakequant import fake_quant, observe_minmax, ops
from .quantizer import TorchQuantizer, builtin_ste
from .settings import QuantSpec, layer_device, resolve_spec
from .wrapper import QuantizerModuleWrapper

__all__ = ["QAT_Quantizer"]


class QAT_Quantizer(TorchQuantizer):  # noqa: N801  (NNI's public name)
    """Quantization-aware training with fake quantization of weights, inputs and outputs."""

    config_keys = ("quant_dtype", "quant_scheme")
    handles_start_step = True
    integer_onnx = True

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], optimizer: torch.optim.Optimizer | None = None,
                 dummy_input: Any = None, bn_fold: bool | None = None, ema_decay: float = 0.99,
                 fuse_relu: bool = False):
        if not 0.0 <= ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {ema_decay!r}")
        if not isinstance(fuse_relu, bool):
            raise ConfigError(f"{type(self).__name__}: fuse_relu must be True or False, got {fuse_relu!r}")
        if bn_fold is not None and not isinstance(bn_fold, bool):
            raise ConfigError(f"{type(self).__name__}: bn_fold must be True, False or None, got {bn_fold!r}")
        self.ema_decay = float(ema_decay)
        fold = bn_fold if bn_fold is not None else dummy_input is not None
        example = None
        if dummy_input is not None:  # runs the model once where torch.fx cannot trace it (see .dataflow)
            from ..onnx_io import model_inputs

            example = model_inputs(dummy_input, what=type(self).__name__)
        # finds Conv2d -> BatchNorm2d pairs (model untouched)
        self._bn = BNFolding(model, example) if fold else None
        fused = find_fused_activations(model, folded=self._bn is not None, example=example) if fuse_relu else {}
        super().__init__(model, config_list, optimizer)
        for w in self.modules_wrapper:  # True: a ReLU; 'relu6': a ReLU6 (clamp to [0, 6]) is applied before quantizing
            w.fused_relu = fused.get(w.name, False) if "output" in w.quant_types else False
        if self._bn is not None:
            self._bn.install(self.modules_wrapper)  # after the wrappers are in place: BN slots become Identity

    # ------------------------------------------------------------------ construction
    def _specs(self, layer: nn.Module, name: str, config: dict[str, Any]) -> dict[str, QuantSpec]:
        return {t: resolve_spec(config, t, layer, name, what=type(self).__name__) for t in config["quant_types"]}

    def validate_layer(self, layer_info: LayerInfo, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        self._specs(module, layer_info.name, config)

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        specs = self._specs(wrapper.layer, wrapper.name, wrapper.config)
        wrapper.qat_specs = specs
        dev = layer_device(wrapper.layer)
        for t, spec in specs.items():
            shape = () if spec.channels is None else (spec.channels,)
            wrapper.register_buffer(f"{t}_scale", torch.ones(shape, device=dev))
            wrapper.register_buffer(f"{t}_zero_point", torch.zeros(shape, device=dev))
            if t != "weight":
                wrapper.register_buffer(f"tracked_min_{t}", torch.zeros(shape, device=dev))
                wrapper.register_buffer(f"tracked_max_{t}", torch.zeros(shape, device=dev))
                wrapper.register_buffer(f"{t}_observed", torch.zeros((), dtype=torch.bool, device=dev))
            wrapper.qranges[t] = (spec.qmin, spec.qmax)
        if self._bn is not None:
            self._bn.attach(wrapper)

    # ------------------------------------------------------------------ quantization
    @builtin_ste
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        spec = wrapper.qat_specs["weight"]
        if wrapper.frozen:
            scale, zp = wrapper.weight_scale, wrapper.weight_zero_point
        else:
            with torch.no_grad():
                rmin, rmax = observe_minmax(weight.detach(), spec.axis)
                scale, zp = cq.qparams(ops, rmin, rmax, spec.qmin, spec.qmax, spec.symmetric)
                wrapper.weight_scale.copy_(scale)
                wrapper.weight_zero_point.copy_(zp)
        if not wrapper.quant_active:
            return weight
        return fake_quant(weight, scale, zp, spec.qmin, spec.qmax, spec.axis)

    @builtin_ste
    def quantize_input(self, inputs: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return self._activation("input", inputs, wrapper)

    @builtin_ste
    def quantize_output(self, output: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        return self._activation("output", output, wrapper)

    def _activation(self, t: str, x: torch.Tensor, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        spec = wrapper.qat_specs[t]
        axis = spec.axis
        buf = wrapper._buffers
        scale, zp, observed = buf[f"{t}_scale"], buf[f"{t}_zero_point"], buf[f"{t}_observed"]
        if wrapper.training:
            with torch.no_grad():
                rmin, rmax = observe_minmax(x.detach(), axis)
                if self.sync_ranks:  # the global batch's range on every rank (no-op when not distributed)
                    all_reduce_min(rmin)
                    all_reduce_max(rmax)
                tmin, tmax = buf[f"tracked_min_{t}"], buf[f"tracked_max_{t}"]
                tmin.copy_(torch.where(observed, cq.ema(ops, tmin, rmin, self.ema_decay), rmin))
                tmax.copy_(torch.where(observed, cq.ema(ops, tmax, rmax, self.ema_decay), rmax))
                observed.fill_(True)
                s, z = cq.qparams(ops, tmin, tmax, spec.qmin, spec.qmax, spec.symmetric)
                scale.copy_(s)
                zp.copy_(z)
            if not wrapper.quant_active:
                return x
            return fake_quant(x, s, z, spec.qmin, spec.qmax, axis)
        if not wrapper.quant_active:
            return x
        return torch.where(observed, fake_quant(x, scale, zp, spec.qmin, spec.qmax, axis), x)

    # ------------------------------------------------------------------ export
    def _unwrap_model(self) -> nn.Module:
        if self._bn is not None:
            self._bn.uninstall(self.modules_wrapper)
        return super()._unwrap_model()

    def _wrap_model(self) -> nn.Module:
        model = super()._wrap_model()
        if self._bn is not None:
            self._bn.install(self.modules_wrapper)
        return model

    def export_weight(self, wrapper: QuantizerModuleWrapper) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._bn is not None and self._bn.has(wrapper):
            return self._bn.export_weight(self, wrapper)
        return super().export_weight(wrapper)

    def export_state_entries(self, wrapper: QuantizerModuleWrapper, weight: torch.Tensor,
                             bias: torch.Tensor | None) -> dict[str, torch.Tensor] | None:
        """A folded pair exports as conv(folded quantized weight, zero bias) + BN adding the folded bias."""
        if self._bn is None or not self._bn.has(wrapper):
            return None
        out = {f"{wrapper.name}.weight": weight}
        if wrapper.bias is not None:
            out[f"{wrapper.name}.bias"] = torch.zeros_like(wrapper.bias)
        for key, value in BNFolding.identity_state(wrapper.bn_module, bias).items():
            out[f"{wrapper.bn_name}.{key}"] = value
        return out
