"""``QuantizerModuleWrapper``: quantizes a layer's input, weight and output in its forward.

The float weight stays the layer's trainable ``Parameter`` (so optimizers built before or after
``compress()`` see the same parameters); the forward computes the quantized weight and calls the
layer's functional form with it (``F.linear`` / ``_conv_forward`` for Linear and Conv; any other layer
through ``torch.func.functional_call``), so nothing is written into the weight. Quantizer state
(ranges, scales, zero points) lives in buffers of the wrapper, updated in place (DataParallel safe)
and saved as ``<name>.<buffer>`` in the model's state_dict.

Which quant types run is fixed at construction from ``config['quant_types']`` (inputs: the first
positional input is quantized).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..modules import innermost_module, torch_base_type
from ..pruning.wrapper import ReadThrough, effective_weight
from .grad import QuantType

_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d)
_TRANSPOSED = (nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


def _is_hf_conv1d(layer: nn.Module) -> bool:
    from ..layout import is_hf_conv1d

    return is_hf_conv1d(layer)


def weight_channel_axis(layer: nn.Module) -> int:
    """Axis of the output channels in ``layer.weight`` (1 for transposed convolutions and HF Conv1D,
    whose weight is stored ``[in, out]``; else 0). See :mod:`compressor.torch.layout`."""
    from ..layout import out_axis

    return out_axis(layer)


def activation_channel_axis(layer: nn.Module) -> int:
    """Channel axis of a layer's inputs/outputs: 1 for convolutions (NCHW), the last one otherwise."""
    return 1 if isinstance(layer, (*_CONV, *_TRANSPOSED)) else -1


def quant_axis(layer: nn.Module, quant_type: str) -> int:
    """Channel axis that per-channel scales of ``quant_type`` refer to."""
    return weight_channel_axis(layer) if quant_type == "weight" else activation_channel_axis(layer)


class QuantizerModuleWrapper(ReadThrough):
    """Wraps ``module`` (called ``module_name``, of type ``module_type``) for ``quantizer`` with ``config``.

    Attributes the quantizers use: ``module`` (the wrapped module), ``name``, ``type``, ``config``,
    ``quant_types`` (list of str), ``quant_bits`` ({type: bits}), ``layer`` (the original layer, also
    inside nested wrappers), ``weight`` / ``bias`` (the layer's float parameters), ``quantizer``.
    """

    def __init__(self, module: nn.Module, module_name: str, module_type: str, config: dict[str, Any], quantizer: Any):
        super().__init__()
        self.module = module
        self.name = module_name
        self.type = module_type
        self.config = config
        self.quant_types: list[str] = list(config.get("quant_types", ()))
        self.quant_bits: dict[str, int] = dict(config.get("quant_bits", {}))
        layer = innermost_module(module)
        object.__setattr__(self, "quantizer", quantizer)
        self._q_input = QuantType.QUANT_INPUT in self.quant_types
        self._q_weight = QuantType.QUANT_WEIGHT in self.quant_types
        self._q_output = QuantType.QUANT_OUTPUT in self.quant_types
        #: (qmin, qmax) per quant type whose scale/zero point the quantizer keeps in ``<type>_scale`` /
        #: ``<type>_zero_point`` (used by QuantGrad's clipped STE, export and calibration)
        self.qranges: dict[str, tuple[int, int]] = {}
        #: set by the quantizer's step counter (quant_start_step)
        self.quant_active = True
        #: True after load_calibration_config: use the loaded weight scale/zero point until the next optimizer step
        self.frozen = False
        #: optional ``fn(wrapper, inputs, kwargs) -> output`` replacing the quantized-weight forward (BN folding)
        self.weight_forward = None
        #: the layer's output feeds only a ReLU: quantize relu(output) (set by ``fuse_relu``); the model's own
        #: ReLU then changes nothing, and the whole uint8 range covers values >= 0
        self.fused_relu = False
        #: set by export to run the ONNX-exportable (QDQ) forward
        self.export_mode = False
        self._export_weight: torch.Tensor | None = None
        # functional forms of the common layers; others go through functional_call
        kind = type(layer)
        base = torch_base_type(layer)  # a subclass without a forward of its own runs as its torch.nn class
        if base is not None:
            kind = getattr(nn, base, kind)
        if kind is nn.Linear:
            self._fn = "linear"
        elif kind in _CONV:
            self._fn = "conv"
        elif _is_hf_conv1d(layer):
            self._fn = "conv1d"  # HF GPT-2's Conv1D: weight [in, out], y = x @ W + b
        else:
            self._fn = "generic"
        self._weight_path = "weight"
        m: nn.Module = module
        while m is not layer:
            self._weight_path = "module." + self._weight_path
            m = m.module

    # ---------------------------------------------------------------- views
    @property
    def layer(self) -> nn.Module:
        """The original layer (inside nested wrappers). Looked up each time, so DataParallel replicas
        see their own copy."""
        return innermost_module(self.module)

    @property
    def weight(self) -> torch.Tensor:
        """The wrapped layer's float weight (the trainable Parameter). Under torch.compile, inside a pruner
        wrapper: the weight masked out of place (compiled code cannot re-mask in place; see
        :mod:`compressor.torch.pruning.wrapper`)."""
        inner = self._compiled_pruner()
        if inner is not None:
            return inner.masked_weight()
        if torch.compiler.is_compiling():  # a slot's weight may be substituted by an outer pruner wrapper
            return effective_weight(self.layer)
        return self.layer.weight

    @property
    def bias(self) -> torch.Tensor | None:
        inner = self._compiled_pruner()
        return getattr(self.layer, "bias", None) if inner is None else inner.masked_bias()

    def _compiled_pruner(self) -> Any:
        """The pruner wrapper directly inside this wrapper while torch.compile traces, else None."""
        if not torch.compiler.is_compiling():
            return None
        inner = self.module
        return inner if hasattr(inner, "masked_weight") else None

    @property
    def weight_channel_axis(self) -> int:
        return weight_channel_axis(self.layer)

    def qparams(self, quant_type: str) -> tuple[torch.Tensor, torch.Tensor, int, int] | None:
        """``(scale, zero_point, qmin, qmax)`` the quantizer recorded for ``quant_type``, else None."""
        t = str(quant_type)
        rng = self.qranges.get(t)
        if rng is None:
            return None
        return getattr(self, f"{t}_scale"), getattr(self, f"{t}_zero_point"), rng[0], rng[1]

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()  # torch.save(model): do not pickle the quantizer (and its optimizer)
        state["quantizer"] = None
        return state

    def __deepcopy__(self, memo: dict[int, Any]) -> QuantizerModuleWrapper:
        """A deep copy shares the quantizer (its methods are stateless; state lives in the copied buffers)."""
        new = type(self).__new__(type(self))
        memo[id(self)] = new
        for key, value in self.__dict__.items():
            new.__dict__[key] = value if key == "quantizer" else copy.deepcopy(value, memo)
        return new

    # ---------------------------------------------------------------- forward
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        q = self.quantizer
        if q is None:
            raise RuntimeError(
                f"{self.name}: this quantized layer was pickled or copied without its quantizer; export it with "
                f"quantizer.export_model() (plain float weights) or wrap the model again"
            )
        if self.export_mode:
            return q._export_forward(self, inputs, kwargs)
        if self._q_input and inputs:
            inputs = (q._quantize(QuantType.QUANT_INPUT, inputs[0], self), *inputs[1:])
        if self._q_weight:
            inner = self.module
            if hasattr(inner, "refresh"):
                inner.refresh()  # an inner pruner wrapper masks its weights in place BEFORE they are quantized
            if self.weight_forward is not None:
                out = self.weight_forward(self, inputs, kwargs)
            else:
                out = self.forward_with_weight(q._quantize(QuantType.QUANT_WEIGHT, self.weight, self), inputs, kwargs)
        else:
            out = self.module(*inputs, **kwargs)
        if self._q_output:
            if self.fused_relu:
                out = torch.clamp(out, 0.0, 6.0) if self.fused_relu == "relu6" else torch.relu(out)
            out = q._quantize(QuantType.QUANT_OUTPUT, out, self)
        return out

    def forward_with_weight(self, weight: torch.Tensor, inputs: tuple, kwargs: dict[str, Any],
                            bias: torch.Tensor | None = None) -> Any:
        """Run the wrapped layer with ``weight`` (and ``bias`` if given) in place of its own."""
        module = self.module
        layer = self.layer
        if module is not layer and hasattr(module, "refresh"):
            module.refresh()  # an inner pruner wrapper masks its weights in place
        if self._fn == "linear" and not kwargs:
            return F.linear(inputs[0], weight, self.bias if bias is None else bias)
        if self._fn == "conv" and not kwargs:
            return layer._conv_forward(inputs[0], weight, self.bias if bias is None else bias)
        if self._fn == "conv1d" and not kwargs:  # Conv1D.forward with another weight (traceable: no functional_call)
            x = inputs[0]
            b = self.bias if bias is None else bias
            y = torch.addmm(b, x.reshape(-1, x.shape[-1]), weight) if b is not None else x.reshape(
                -1, x.shape[-1]) @ weight
            return y.reshape(*x.shape[:-1], weight.shape[-1])
        if isinstance(layer, nn.Embedding) and not kwargs:  # (traceable by the TorchScript exporter)
            return F.embedding(inputs[0], weight, layer.padding_idx, layer.max_norm, layer.norm_type,
                               layer.scale_grad_by_freq, layer.sparse)
        params = {self._weight_path: weight}
        if bias is not None:
            params[self._weight_path[: -len("weight")] + "bias"] = bias
        return torch.func.functional_call(module, params, inputs, kwargs)

    def extra_repr(self) -> str:
        bits = ", ".join(f"{t}={b}" for t, b in self.quant_bits.items())
        return f"name={self.name!r}, type={self.type!r}, bits: {bits}"
