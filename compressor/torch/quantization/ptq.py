"""``PtqQuantizer``: post-training (static) quantization, calibrated on a few batches, no training.

A subclass of :class:`~.qat.QAT_Quantizer`, so its wrappers, buffers (``<type>_scale``,
``<type>_zero_point``, ``tracked_min_<type>``, ``tracked_max_<type>``, ``<type>_observed``), fake
quantization, BN folding, state_dict and export (integer QDQ ONNX included) are the same. Differences:

* defaults: weights ``'int'`` / ``'per_channel_symmetric'`` (int8 = [-127, 127], one scale per output
  channel), inputs/outputs ``'uint'`` / ``'per_tensor_affine'``; config keys override them as for QAT;
* ranges come from :mod:`compressor.core.observers` in :meth:`PtqQuantizer.calibrate`: the model runs in
  eval mode under ``torch.no_grad()`` in FLOAT (nothing quantized while calibrating), activation observers
  (``observer``: 'minmax', 'moving_average_minmax', 'percentile', 'mse') record every quantized layer's
  input/output, each weight is observed once (``weight_observer``, default 'minmax', per channel), then
  every scale and zero point is computed and only then written into the buffers (frozen);
* after calibration the weights are fake-quantized with the FROZEN weight scale (QAT recomputes it from
  the current min/max each forward) and activations with the frozen scales in train and eval mode alike
  (PTQ never updates ranges; re-run :meth:`calibrate` to recalibrate). Before calibration a quantized
  forward or an export raises, naming ``calibrate()``;
* ``bn_fold=True`` (default): QAT's :class:`~.bn_fold.BNFolding` (each Conv2d followed only by a
  BatchNorm2d; in eval mode it computes ``conv(x, fq(w * f)) + beta + (b - mean) * f`` with
  ``f = gamma / sqrt(running_var + eps)``); the weight observed is the folded ``w * f``. A model that
  ``torch.fx`` cannot trace is quantized without folding (with a warning).
* ``fuse_relu=True`` (default): an output feeding only a ReLU is observed and quantized after the ReLU
  (see :class:`~.qat.QAT_Quantizer`), so its uint8 range starts at 0 as in onnxruntime's and TFLite's
  own quantizers; also disabled with a warning when ``torch.fx`` cannot trace the model.
* int32 bias: once calibrated, a Conv (or a Linear on a 2-D input) that quantizes its input and weight adds
  its bias (the folded bias ``beta + (b - mean) * f`` of a folded pair in eval mode) rounded to the grid
  ``input_scale * weight_scale``, as the integer kernels of the int8 ONNX graph (and TFLite) do; see
  :func:`int32_bias_forward`. Without it the fake-quant model and the artifact differ in one code at ~0.1 % of
  the outputs of every layer (outputs within 1e-3 steps of a rounding tie), which a deep network with high
  gain (a random-weight MobileNetV2: 8-bit noise alone moves its logits by ~80 %) amplifies into a
  different prediction. Activations are fake-quantized as onnxruntime's QuantizeLinear computes them,
  ``round(x / s) + zp`` (see :meth:`PtqQuantizer._activation`).
* ``share_ranges=True`` (default): a layer's quantized input that is another quantized layer's quantized
  output passed only through ReLU / max pooling / flatten / reshape takes that output's scale and zero
  point (one grid per tensor, as onnxruntime and TFLite quantize), so it is not quantized twice; in the
  int8 ONNX graph the two Q/DQ pairs then cancel and e.g. a max-pool runs on uint8 between two
  QLinearConv. Same rule on the Keras backend.
* ``quantize_joins=True`` (default): residual adds, products, concatenations, average / global average pooling
  (``adaptive_avg_pool2d(x, 1)``, ``x.mean((2, 3))``) whose inputs are all quantized outputs get an output
  range of their own (observed after the ReLU that is their only reader; an average pool reuses its input's),
  so the int8 ONNX graph runs them as QLinearAdd / QLinearMul / QLinearConcat / QLinearAveragePool /
  QLinearGlobalAveragePool, as onnxruntime's ``quantize_static`` does; layers reading such an output share its
  grid. The rule is :mod:`compressor.core.quant_joins`; the mechanism :mod:`.joins` (planned from one recorded
  forward on the first calibration batch). ``join_report`` lists every join seen and whether it is integer.
  The join ranges live on the quantizer (not in the model's ``state_dict``): re-run :meth:`calibrate` after
  loading one.
* ``activation='dynamic'`` (default ``'static'``): dynamic int8 for Linear / HF Conv1D layers: weights int8 per
  output channel (frozen at construction: no calibration needed), inputs quantized at run time per token (one
  scale per row of the last axis, as llmcompressor's W8A8 dynamic scheme: each row divided by its max |x|, then
  ``DynamicQuantizeLinear``'s uint8 grid, then multiplied back: :func:`dynamic_fake_quant`), outputs and biases
  float. The int8 ONNX graph is ``Abs -> ReduceMax -> Div -> DynamicQuantizeLinear -> MatMulInteger -> Cast ->
  Mul -> Mul(row max)`` per layer; onnxruntime fuses the middle into ``DynamicQuantizeMatMul`` (its
  ``quantize_dynamic`` is the same without the row division: one scale per tensor, which an outlier token makes
  coarse for every other token). A config quantizing ``'output'`` or a Conv layer is refused (ConfigError).
* int8 embedding tables (either mode): select ``nn.Embedding`` layers with ``quant_types: ['weight']`` (e.g.
  ``{'op_types': ['Embedding'], 'quant_types': ['weight'], 'quant_bits': 8}``; one scale per row by default,
  ``quant_scheme: 'per_tensor_symmetric'`` for one): the int8 ONNX graph stores the table as int8 codes and
  gathers rows of codes, dequantizing only those rows (a BERT's word embeddings are most of its file). Not in
  ``op_types: ['default']`` (which means the layers with integer kernels): the embedding's rounding changes every
  token's vector, so it is a choice, as in onnxruntime's ``quantize_static`` / ``quantize_dynamic`` where it is
  on by default; a table tied to an output head stays float.

State: the buffers, plus ``weight_observed`` per layer quantizing weights, so a model ``state_dict``
saved after calibration restores a calibrated quantizer.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from ...core import observers as cobs
from ...core.errors import ConfigError, ConfigWarning, ModelError
from .bn_fold import (
    _GRID_MODULES,
    find_conv_bn_pairs,
    find_input_sources,
    find_relu_followers,
    fold_factor,
    folded_forward,
)
from .fakequant import fake_quant, ops
from .qat import QAT_Quantizer
from .quantizer import builtin_ste
from .settings import QuantSpec, resolve_spec
from .wrapper import QuantizerModuleWrapper

__all__ = ["PtqQuantizer"]

#: defaults per quant type when the config does not say: (quant_dtype, quant_scheme)
PTQ_DEFAULTS = {"weight": ("int", "per_channel_symmetric"), "input": ("uint", "per_tensor_affine"),
                "output": ("uint", "per_tensor_affine")}

_NO_DATA = "calibrate with at least one batch"
_INT32_MAX = 2**31 - 1


def int32_bias(wrapper: QuantizerModuleWrapper, bias: torch.Tensor) -> torch.Tensor:
    """``bias`` on the int32 grid of scale ``input_scale * weight_scale`` (per output channel), computed as the
    int8 ONNX export writes it (float64 product rounded to float32, round half to even) and as onnxruntime's
    DequantizeLinear reads it back (``float32(code) * scale``); unchanged when a code does not fit int32 (the
    export then keeps that bias in float). Straight-through gradient."""
    scale = (wrapper.input_scale.double() * wrapper.weight_scale.double()).float()
    codes = torch.round(bias.detach().double() / scale.double())
    fits = (codes.abs() <= _INT32_MAX).all()  # a graph op: no host round trip
    snapped = torch.where(fits, codes.float() * scale, bias.detach().float()).to(bias.dtype)
    return bias + (snapped - bias).detach()


def int32_bias_forward(wrapper: QuantizerModuleWrapper, inputs: tuple, kwargs: dict[str, Any]) -> Any:
    """The quantized-weight forward of a calibrated PtqQuantizer layer with the bias the integer kernels add
    (see :func:`int32_bias`); while calibrating, before calibration, in a folded pair whose BatchNorm is in
    training mode (batch statistics), or for a Linear on a >2-D input (exported as MatMul + float Add), the
    forward without it."""
    q = wrapper.quantizer
    folded = q._bn is not None and q._bn.has(wrapper)
    x = inputs[0] if inputs else None
    plain = (q._calibrating or not wrapper.quant_active or kwargs or x is None
             or (folded and wrapper.bn_module.training) or (wrapper._fn == "linear" and x.dim() != 2))
    if plain:
        if folded:
            return folded_forward(wrapper, inputs, kwargs)
        return wrapper.forward_with_weight(q._quantize("weight", wrapper.weight, wrapper), inputs, kwargs)
    if folded:
        bn = wrapper.bn_module
        f = fold_factor(bn)
        qw = q._quantize("weight", wrapper.weight * f.reshape(-1, 1, 1, 1), wrapper)
        b = wrapper.bias if wrapper.bias is not None else torch.zeros_like(bn.running_mean)
        beta = bn.bias if bn.bias is not None else torch.zeros_like(bn.running_mean)
        return wrapper.layer._conv_forward(x, qw, int32_bias(wrapper, beta + (b - bn.running_mean) * f))
    qw = q._quantize("weight", wrapper.weight, wrapper)
    bias = wrapper.bias
    return wrapper.forward_with_weight(qw, inputs, kwargs, bias=None if bias is None else int32_bias(wrapper, bias))


#: the row scale of a row of zeros (any positive value: the row quantizes to zeros)
_TINY = float(torch.finfo(torch.float32).tiny)


def dynamic_fake_quant(x: torch.Tensor, qmin: int = 0, qmax: int = 255) -> torch.Tensor:
    """``x`` quantized per token (one scale per row of the last axis), as the int8 ONNX graph computes it: each
    row is divided by its own ``m = max|x_row|``, the rows (now within [-1, 1]) go through onnxruntime's
    ``DynamicQuantizeLinear`` grid (``scale = (max(x', 0) - min(x', 0)) / (qmax - qmin)``, ``zp =
    clip(round(qmin - min(x', 0) / scale))``, codes ``clip(round(x' / scale) + zp)``, round half to even) and
    are multiplied back by ``m``. Row ``r``'s step is ``m_r * scale <= 2 * m_r / (qmax - qmin)``: its error is at
    most ``m_r / 255`` whatever the other rows hold (an outlier token does not coarsen the others, as a scale per
    tensor would). Graph ops only; straight-through gradient (the range covers ``x``)."""
    with torch.no_grad():
        xd = x.detach()
        m = torch.clamp(xd.abs().amax(-1, keepdim=True), min=_TINY) if xd.dim() else torch.ones_like(xd)
        xn = xd / m
        lo = torch.clamp(xn.min(), max=0.0)
        hi = torch.clamp(xn.max(), min=0.0)
        scale = (hi - lo) / float(qmax - qmin)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
        zp = torch.clamp(torch.round(qmin - lo / scale), qmin, qmax)
        y = (torch.clamp(torch.round(xn / scale) + zp, qmin, qmax) - zp) * scale * m
    return x + (y - x).detach()


def _describe(args: tuple, kwargs: dict[str, Any]) -> str:
    def one(v: Any) -> str:
        return f"shape {tuple(v.shape)}, dtype {v.dtype}" if torch.is_tensor(v) else type(v).__name__

    parts = [one(a) for a in args] + [f"{k}: {one(v)}" for k, v in kwargs.items()]
    return "; ".join(parts)


class PtqQuantizer(QAT_Quantizer):
    """Post-training quantization: ``PtqQuantizer(model, config_list).calibrate(loader)``, then evaluate
    or ``export_model(...)``."""

    def __init__(self, model: nn.Module, config_list: list[dict[str, Any]], observer: str = "minmax",
                 percentile: float = 99.99, grid_size: int = 100, bn_fold: bool = True, dummy_input: Any = None,
                 weight_observer: str = "minmax", optimizer: torch.optim.Optimizer | None = None,
                 fuse_relu: bool = True, share_ranges: bool = True, quantize_joins: bool = True,
                 activation: str = "static"):
        if activation not in ("static", "dynamic"):
            raise ConfigError(f"PtqQuantizer: activation must be 'static' (calibrated ranges) or 'dynamic' (ranges "
                              f"of each batch at run time), got {activation!r}")
        self.activation = activation
        if activation == "dynamic":  # nothing to fold, fuse or share: inputs are quantized per token
            bn_fold, fuse_relu, share_ranges, quantize_joins = False, False, False, False
        for what, method in (("observer", observer), ("weight_observer", weight_observer)):
            if method not in cobs.OBSERVERS:
                raise ConfigError(f"PtqQuantizer: unknown {what} {method!r}; allowed: {sorted(cobs.OBSERVERS)}")
        # validated here (the core checks), before the model is touched
        cobs.PercentileObserver(ops, percentile=percentile)
        cobs.MseObserver(ops, grid_size=grid_size)
        self.observer = observer
        self.weight_observer = weight_observer
        self.percentile = float(percentile)
        self.grid_size = int(grid_size)
        self.dummy_input = dummy_input
        self._calibrating = False
        self._act_observers: dict[tuple[str, str], cobs.Observer] = {}
        example = None
        if dummy_input is not None:  # runs the model once where torch.fx cannot trace it (see .dataflow)
            from ..onnx_io import model_inputs

            example = model_inputs(dummy_input, what="PtqQuantizer")
        for flag, value in (("share_ranges", share_ranges), ("bn_fold", bn_fold),
                            ("quantize_joins", quantize_joins)):
            if not isinstance(value, bool):
                raise ConfigError(f"PtqQuantizer: {flag} must be True or False, got {value!r}")
        self.quantize_joins = quantize_joins
        self._joins: Any = None  # the JoinRunner of the last calibration (see .joins)
        self._join_inputs: dict[str, int] = {}
        self.join_report: list[dict[str, Any]] = []
        # the three graph features need torch.fx; a model it cannot trace (most Hugging Face models) gets ONE
        # warning, and only for the features the model has modules for (no BatchNorm2d: nothing to fold)
        types = {type(m) for m in model.modules()}
        wanted = {"bn_fold": bool(bn_fold) and any(issubclass(t, nn.BatchNorm2d) for t in types),
                  # ReLU: an nn.ReLU, or no activation module at all (then it may be functional, fx would see it)
                  "fuse_relu": fuse_relu is True and (nn.ReLU in types or not any(
                      t.__module__ in ("torch.nn.modules.activation", "transformers.activations") for t in types)),
                  "share_ranges": share_ranges and bool(types & set(_GRID_MODULES) - {nn.Identity})}
        self._input_sources: dict[str, str] = {}
        failed = None
        try:
            if bn_fold:
                find_conv_bn_pairs(model, example)
            if fuse_relu is True and not bn_fold:
                find_relu_followers(model, folded=False, example=example)
            if share_ranges:
                self._input_sources = find_input_sources(model, folded=bool(bn_fold), example=example)
        except ConfigError as e:
            failed = str(e).split(": ", 1)[-1].split("); ")[0] + ")"
            bn_fold, fuse_relu, self._input_sources = False, (False if fuse_relu is True else fuse_relu), {}
        lost = [k for k, v in wanted.items() if v]
        if failed and lost:
            what = {"bn_fold": "Conv2d -> BatchNorm2d pairs are quantized unfolded (bn_fold)",
                    "fuse_relu": "outputs feeding a ReLU are quantized before it (fuse_relu)",
                    "share_ranges": "each quantized input gets its own range (share_ranges)"}
            hint = "" if example is not None else ("Pass dummy_input= (a model input) to find them by running "
                                                   "the model once instead, or ")
            warnings.warn(f"PtqQuantizer: {failed}; so {'; '.join(what[k] for k in lost)}. "
                          f"{hint or 'Pass '}{', '.join(f'{k}=False' for k in lost)} to quantize so without this "
                          f"warning", ConfigWarning, stacklevel=2)
        super().__init__(model, config_list, optimizer, dummy_input=dummy_input, bn_fold=bool(bn_fold),
                         fuse_relu=fuse_relu)
        if activation == "dynamic":
            self._freeze_dynamic()

    # ------------------------------------------------------------------ construction
    def _specs(self, layer: nn.Module, name: str, config: dict[str, Any]) -> dict[str, QuantSpec]:
        what = type(self).__name__
        return {t: resolve_spec(config, t, layer, name, default_dtype=PTQ_DEFAULTS[t][0],
                                default_scheme=PTQ_DEFAULTS[t][1], what=what) for t in config["quant_types"]}

    def validate_layer(self, layer_info: Any, module: nn.Module, config: dict[str, Any]) -> None:
        super().validate_layer(layer_info, module, config)
        if getattr(self, "activation", "static") != "dynamic":
            return
        from ..layout import is_hf_conv1d

        types = config.get("quant_types", [])
        if isinstance(module, nn.Embedding) and list(types) == ["weight"]:
            return  # an int8 table (weight only: nothing to quantize at run time)
        if sorted(types) != ["input", "weight"]:
            raise ConfigError(f"PtqQuantizer(activation='dynamic'): layer {layer_info.name!r}: quant_types {types!r}; "
                              f"dynamic quantization takes ['input', 'weight'] (inputs are quantized per token at run "
                              f"time, outputs stay float)")
        if not (isinstance(module, nn.Linear) or is_hf_conv1d(module)):
            raise ConfigError(f"PtqQuantizer(activation='dynamic'): layer {layer_info.name!r} is a "
                              f"{type(module).__name__}; dynamic quantization takes Linear and Hugging Face Conv1D "
                              f"layers (onnxruntime's DynamicQuantizeMatMul); use activation='static' for others")

    def _freeze_dynamic(self) -> None:
        """Weight scales from the weights (no data needed); activation scales are computed per token at run time."""
        plan = []
        for w in self.modules_wrapper:
            for t, spec in w.qat_specs.items():
                buf = w._buffers
                if t == "weight":
                    obs = self.make_observer(spec, self.weight_observer)
                    obs.observe(self.float_weight(w))
                    scale, zp = obs.qparams()
                    plan += [(buf["weight_scale"], scale), (buf["weight_zero_point"], zp)]
                plan.append((buf[f"{t}_observed"], torch.ones((), dtype=torch.bool)))
        with torch.no_grad():
            for target, value in plan:
                target.copy_(value)
        for w in self.modules_wrapper:
            w.frozen = True

    def init_wrapper(self, wrapper: QuantizerModuleWrapper) -> None:
        super().init_wrapper(wrapper)
        if "weight" in wrapper.qat_specs:
            wrapper.register_buffer("weight_observed",
                                    torch.zeros((), dtype=torch.bool, device=wrapper.weight_scale.device))
        specs = wrapper.qat_specs
        if ("input" in specs and "weight" in specs and specs["input"].channels is None
                and wrapper._fn in ("conv", "linear") and self.activation == "static"):  # the layers whose bias the int8 export makes int32
            wrapper.weight_forward = int32_bias_forward

    # ------------------------------------------------------------------ state
    @property
    def calibrated(self) -> bool:
        """True when every quantized tensor of every layer has a frozen scale and zero point."""
        return all(bool(w._buffers[f"{t}_observed"]) for w in self.modules_wrapper for t in w.qat_specs)

    def _require_calibrated(self, wrapper: QuantizerModuleWrapper, t: str) -> None:
        observed = wrapper._buffers[f"{t}_observed"]
        msg = (f"PtqQuantizer: layer {wrapper.name!r} has no {t} scale yet; call quantizer.calibrate(data) (a "
               f"DataLoader or batches of model inputs) before running or exporting the quantized model")
        if torch.compiler.is_compiling():
            # the same check as a graph op (reading the flag on the host would break the graph); raises
            # RuntimeError(msg) when the compiled forward runs (a device-side assert on accelerators)
            torch._assert_async(observed, msg)
        elif not bool(observed):
            raise RuntimeError(msg)

    # ------------------------------------------------------------------ quantization
    @builtin_ste
    def quantize_weight(self, weight: torch.Tensor, wrapper: QuantizerModuleWrapper, **kwargs: Any) -> torch.Tensor:
        if self._calibrating:
            return weight  # float forward while calibrating (weights are observed apart from it)
        self._require_calibrated(wrapper, "weight")
        if not wrapper.quant_active:
            return weight
        spec = wrapper.qat_specs["weight"]
        return fake_quant(weight, wrapper.weight_scale, wrapper.weight_zero_point, spec.qmin, spec.qmax, spec.axis)

    def _activation(self, t: str, x: torch.Tensor, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        if self._calibrating:
            obs = self._act_observers.get((wrapper.name, t))
            if obs is not None:
                obs.observe(x.detach())
            return x
        self._require_calibrated(wrapper, t)
        if not wrapper.quant_active:
            return x
        spec = wrapper.qat_specs[t]
        if self.activation == "dynamic":
            return dynamic_fake_quant(x, spec.qmin, spec.qmax)
        buf = wrapper._buffers
        scale, zp = buf[f"{t}_scale"], buf[f"{t}_zero_point"]
        out = fake_quant(x, scale, zp, spec.qmin, spec.qmax, spec.axis)
        if spec.channels is not None or x.dtype != torch.float32:
            return out
        # the value onnxruntime's QuantizeLinear computes, round(x / s) + zp (a division, then the zero point);
        # fake_quant computes round(x * (1 / s) + zp), which lands on the other side of a rounding tie for
        # ~1e-5 of the values: enough to change the prediction of a deep network with high gain. Same
        # gradient (fake_quant's clipped STE)
        with torch.no_grad():
            z = zp.round()
            runtime = (torch.clamp(torch.round(x / scale) + z, spec.qmin, spec.qmax) - z) * scale
        return out + (runtime - out).detach()

    # ------------------------------------------------------------------ observers
    def _observer_kwargs(self, method: str) -> dict[str, Any]:
        if method == "percentile":
            return {"percentile": self.percentile}
        if method == "mse":
            return {"grid_size": self.grid_size}
        return {}

    def make_observer(self, spec: QuantSpec, method: str) -> cobs.Observer:
        """The core observer of ``method`` for one tensor's spec (bits, dtype, scheme, channel axis)."""
        return cobs.OBSERVERS[method].from_spec(ops, spec, **self._observer_kwargs(method))

    def float_weight(self, wrapper: QuantizerModuleWrapper) -> torch.Tensor:
        """The float weight that gets quantized: ``w * f`` for a BN-folded conv, else the layer's weight."""
        w = wrapper.weight.detach()
        if self._bn is not None and self._bn.has(wrapper):
            w = w * fold_factor(wrapper.bn_module).detach().reshape(-1, *([1] * (w.dim() - 1)))
        return w

    @contextlib.contextmanager
    def float_mode(self) -> Iterator[None]:
        """Run the wrapped model in float (nothing quantized, BN still folded; nothing observed)."""
        saved = self._calibrating, self._act_observers
        self._calibrating, self._act_observers = True, {}
        try:
            yield
        finally:
            self._calibrating, self._act_observers = saved

    # ------------------------------------------------------------------ calibration
    def _batches(self, data: Any, num_batches: int | None, num_samples: int | None = None) -> Iterator[tuple[int, Any]]:
        """``(index, (args, kwargs))`` per batch, by the shared calibration-data rule
        (:func:`compressor.torch.calibration_data.calibration_batches`; NaN / inf inputs are refused)."""
        from ..calibration_data import calibration_batches

        for i, args, kwargs in calibration_batches(
                data, "PtqQuantizer.calibrate", num_batches=num_batches, num_samples=num_samples,
                positional=self._positional(), expected=self._expected(), tuple_is_batch=False,
                hint=f"{_NO_DATA} (a DataLoader, an iterable of tensors, dicts or (x, y) tuples, or one tensor / dict)"):
            yield i, (args, kwargs)

    def _positional(self) -> int:
        d = self.dummy_input
        return len(d) if isinstance(d, (tuple, list)) and len(d) >= 2 else 1

    def _forward_inputs(self, i: int, batch: Any) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of the forward for one batch. The rule: a tensor is the one positional input; a
        dict (or Hugging Face ``BatchEncoding``) holds keyword inputs; a tuple / list is ``(inputs, *targets)``
        -- its first element is the input (a tensor, a dict, or a tuple of positional inputs), the rest (labels)
        is ignored -- except when ``dummy_input`` is a tuple of n >= 2 positional inputs: then its first n
        elements are the positional inputs."""
        from ..calibration_data import forward_inputs

        return forward_inputs(batch, i, "PtqQuantizer.calibrate", self._positional(), self._expected())

    def _expected(self) -> str:
        d = self.dummy_input
        if torch.is_tensor(d):
            return f"a model input like dummy_input (shape {tuple(d.shape)}, dtype {d.dtype})"
        if isinstance(d, Mapping):
            return f"a dict of keyword inputs like dummy_input (keys {sorted(d)})"
        if isinstance(d, (tuple, list)) and len(d) >= 2:
            return f"a tuple of {len(d)} positional inputs like dummy_input"
        return "a model input: a tensor, a dict of keyword inputs, or an (x, y) tuple"

    def calibrate(self, data: Any, num_batches: int | None = None, num_samples: int | None = None) -> PtqQuantizer:
        """Observe ``data`` (DataLoader / iterable of tensors, dicts / ``BatchEncoding`` or ``(x, y, ...)``
        tuples / one tensor or dict; at most ``num_batches`` batches and ``num_samples`` samples) in eval mode
        without gradients, then freeze every scale and zero point.

        ConfigError for no data; ModelError when a batch cannot run through the model; either way the
        quantizer's buffers are left as they were. The modules' train/eval modes are restored. Returns self.
        """
        model = self.bound_model
        modes = {m: m.training for m in model.modules()}
        wrappers = list(self.modules_wrapper)
        self._act_observers = {(w.name, t): self.make_observer(spec, self.observer)
                               for w in wrappers for t, spec in w.qat_specs.items() if t != "weight"}
        seen = 0
        old_joins = self._joins, self._join_inputs, self.join_report
        ok = False
        try:
            model.eval()
            self._calibrating = True
            with torch.no_grad():
                for i, (args, kwargs) in self._batches(data, num_batches, num_samples):
                    if i == 0 and self.quantize_joins:
                        self._plan_joins(wrappers, args, kwargs)
                    try:
                        model(*args, **kwargs)
                    except Exception as e:  # noqa: BLE001  (any failure of the user's model on this batch)
                        raise ModelError(
                            f"PtqQuantizer.calibrate: batch {i} ({_describe(args, kwargs)}) failed in the model; "
                            f"expected {self._expected()}: {type(e).__name__}: {e}") from e
                    seen += 1
            if seen == 0:
                raise ConfigError(f"PtqQuantizer.calibrate: the data yielded no batch; {_NO_DATA}")
            plan, join_qparams = self._plan(wrappers)
            ok = True
        finally:
            self._calibrating = False
            self._act_observers = {}
            for m, mode in modes.items():
                m.training = mode
            if not ok and self._joins is not old_joins[0]:  # failed: the previous calibration's joins stay
                if self._joins is not None:
                    self._joins.remove()
                self._joins, self._join_inputs, self.join_report = old_joins
                if self._joins is not None:
                    self._joins.install(model, wrappers)
        with torch.no_grad():
            for target, value in plan:
                target.copy_(value)
        if self._joins is not None:
            self._joins.qparams = join_qparams
        for w in wrappers:
            w.frozen = True
        self.calibration_batches = seen
        return self

    def _plan_joins(self, wrappers: list[QuantizerModuleWrapper], args: tuple, kwargs: dict[str, Any]) -> None:
        """Record one float forward on the first calibration batch and plan the quantized joins (see .joins)."""
        from .dataflow import record_flow
        from .joins import JoinRunner, call_kind, plan_joins, wrapper_input_sites

        if self._joins is not None:
            self._joins.remove()
            self._joins = None
        self._join_inputs, self.join_report = {}, []
        specs = [w.qat_specs["output"] for w in wrappers if "output" in w.qat_specs
                 and w.qat_specs["output"].channels is None]
        if not specs:
            return
        saved = self._act_observers
        try:
            with self.float_mode():
                flow = record_flow(self.bound_model, args, kwargs, classify=call_kind)
        except Exception:  # noqa: BLE001  (the model fails on this batch: the calibration forward reports it)
            return
        self.bound_model.eval()
        self._act_observers = saved
        names = {w.name for w in wrappers}
        spec = specs[0]
        outs = {w.name for w in wrappers if "output" in w.qat_specs and w.qat_specs["output"].channels is None
                and (w.qat_specs["output"].qmin, w.qat_specs["output"].qmax) == (spec.qmin, spec.qmax)}
        sites, self.join_report = plan_joins(flow, names, outs)
        if not sites:
            return
        runner = JoinRunner(self, sites, spec)
        for s in sites:
            if s.output == "own":
                self._act_observers[runner.observer_key(s)] = self.make_observer(spec, self.observer)
        by_name = {w.name: w for w in wrappers}
        for name, index in wrapper_input_sites(flow, sites, names).items():
            a = by_name[name].qat_specs.get("input")
            if a is not None and a.channels is None and (a.qmin, a.qmax) == (spec.qmin, spec.qmax):
                self._join_inputs[name] = index
        runner.install(self.bound_model, wrappers)
        self._joins = runner

    def shared_inputs(self) -> dict[str, str]:
        """``{layer: producer layer}`` for every layer whose quantized input reuses the producer's output
        scale and zero point (``share_ranges``): same bits, integer range and per-tensor scheme."""
        by_name = {w.name: w for w in self.modules_wrapper}
        out = {}
        for name, src in self._input_sources.items():
            w, p = by_name.get(name), by_name.get(src)
            if w is None or p is None or "input" not in w.qat_specs or "output" not in p.qat_specs:
                continue
            a, b = w.qat_specs["input"], p.qat_specs["output"]
            if (a.qmin, a.qmax, a.channels, b.channels) == (b.qmin, b.qmax, None, None):
                out[name] = src
        return out

    def _plan(self, wrappers: list[QuantizerModuleWrapper]) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], dict]:
        """Every ``(buffer, value)`` to write, and the joins' ``{index: (scale, zero point)}``, computed before
        anything is written."""
        values: dict[tuple[str, str], tuple] = {}  # (layer, type) -> (scale, zp, (min, max) or None)
        for w in wrappers:
            for t, spec in w.qat_specs.items():
                if t == "weight":
                    obs = self.make_observer(spec, self.weight_observer)
                    obs.observe(self.float_weight(w))
                    rng = None
                else:
                    obs = self._act_observers[(w.name, t)]
                    if not obs.calibrated:
                        raise ModelError(f"PtqQuantizer.calibrate: layer {w.name!r} was never called by the model "
                                         f"on the calibration data, so its {t} range is unknown")
                    rng = obs.range()
                scale, zp = obs.qparams()
                values[(w.name, t)] = (scale, zp, rng)
        for name, src in self.shared_inputs().items():  # one grid per tensor
            values[(name, "input")] = values[(src, "output")]
        joins: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        if self._joins is not None:
            runner = self._joins

            def join_value(ref: Any) -> tuple:
                kind, key = ref
                if kind == "layer":
                    return values[(key, "output")]
                site = runner.sites[key]
                if site.output != "own":
                    return join_value(site.output)
                obs = self._act_observers[runner.observer_key(site)]
                if not obs.calibrated:
                    raise ModelError(f"PtqQuantizer.calibrate: the {site.kind} in {site.scope or 'the model'!r} was "
                                     f"not reached on the calibration data, so its range is unknown")
                return (*obs.qparams(), obs.range())

            for index, site in runner.sites.items():
                if site.output == "own":
                    scale, zp, _ = join_value(("site", index))
                    joins[index] = (scale.detach().clone(), zp.detach().clone())
            for name, index in self._join_inputs.items():
                values[(name, "input")] = join_value(("site", index))
        plan: list[tuple[torch.Tensor, torch.Tensor]] = []
        for w in wrappers:
            buf = w._buffers
            for t in w.qat_specs:
                scale, zp, rng = values[(w.name, t)]
                if rng is not None:
                    plan += [(buf[f"tracked_min_{t}"], rng[0]), (buf[f"tracked_max_{t}"], rng[1])]
                target = buf[f"{t}_scale"]
                if tuple(scale.shape) != tuple(target.shape):
                    raise ModelError(f"PtqQuantizer.calibrate: layer {w.name!r}: {t} scale of shape "
                                     f"{tuple(scale.shape)}, expected {tuple(target.shape)}")
                plan += [(target, scale), (buf[f"{t}_zero_point"], zp),
                         (buf[f"{t}_observed"], torch.ones((), dtype=torch.bool))]
        return plan, joins

    # ------------------------------------------------------------------ export
    def export_model(self, model_path: str, calibration_path: str | None = None, onnx_path: str | None = None,
                     input_shape: tuple[int, ...] | None = None, device: torch.device | str | None = None,
                     **onnx_kwargs: Any) -> dict[str, dict[str, Any]]:
        if not self.calibrated:
            missing = [f"{w.name}.{t}" for w in self.modules_wrapper for t in w.qat_specs
                       if not bool(w._buffers[f"{t}_observed"])]
            raise RuntimeError(f"PtqQuantizer.export_model: not calibrated ({', '.join(missing)} have no scale); "
                               f"call quantizer.calibrate(data) first; nothing was written")
        if onnx_path is not None and input_shape is None and "dummy_input" not in onnx_kwargs \
                and self.dummy_input is not None:
            onnx_kwargs["dummy_input"] = self.dummy_input
        if self._joins is not None:
            self._joins.exporting = True
        try:
            return super().export_model(model_path, calibration_path, onnx_path, input_shape, device, **onnx_kwargs)
        finally:
            if self._joins is not None:
                self._joins.exporting = False
