"""Export of a quantized model: plain float state_dict, calibration config, ONNX with QDQ nodes.

* The model file is a ``state_dict`` of the model with the wrappers taken out, so it loads into the
  ORIGINAL model class; each quantized weight holds its quantized values (dequantized floats).
* The calibration config maps layer name -> ``{'quant_types', '<type>_bits', '<type>_scale',
  '<type>_zero_point', '<type>_qmin', '<type>_qmax', 'tracked_min_<type>', 'tracked_max_<type>'}`` (host
  floats/ints; scale and zero point are lists for per-channel schemes). Saved with ``torch.save``;
  load it with ``torch.load(path, weights_only=True)``.
* ONNX: each quantization with recorded scale/zero point becomes QuantizeLinear -> DequantizeLinear
  (see :func:`.fakequant.onnx_qdq`); quantizations without them (BNN's sign, DoReFa's transform) are
  exported as the ops they are (weights as constants holding the quantized values). The default
  (dynamo) exporter keeps the weights' QDQ pairs; the TorchScript one (``dynamo=False``, ~25x faster)
  folds them into constants holding the same values. onnxruntime with graph optimizations disabled
  reproduces the PyTorch outputs; with them (the default) it runs integer kernels between QDQ pairs and
  may differ by about one quantization step.
* Integer ONNX (``onnx_format='int8'``; the default ``'auto'`` picks it for a QAT_Quantizer whose
  quantizations are all 8-bit on Conv/Linear layers with quantized weights): int8/uint8 weight
  initializers + DequantizeLinear, QDQ activations, int32 biases, dynamic batch axis; onnxruntime fuses
  it into QLinearConv / QGemm / QLinearMatMul (see :mod:`.onnx_qdq`). ``onnx_format='fake_quant'`` keeps
  the form above (float weights; the input's fixed shapes when the graph has QDQ pairs, else dynamic
  batch / token sequence axes).
* ONNX inputs (both forms): ``dummy_input`` -- a tensor, a tuple, or a dict of keyword arguments such as
  ``{'input_ids': ids, 'attention_mask': mask}`` -- or ``input_shape`` (a random float tensor); the graph
  is run in onnxruntime before it is moved into place (outputs of any structure, see
  :mod:`compressor.torch.onnx_io`).
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import torch

from ...core.atomic import atomic_paths
from ...core.calibration import (
    calibration_record,
    check_calibration_layers,
    check_calibration_type,
    loadable_keys,
)
from ...core.errors import ConfigError
from ..pruning.export import save_file
from ..slots import slot_state_entries
from .fakequant import onnx_qdq
from .wrapper import QuantizerModuleWrapper, quant_axis

STATE_KEYS = ("scale", "zero_point")


def _host(t: torch.Tensor) -> Any:
    return t.detach().cpu().tolist()


def calibration_entry(wrapper: QuantizerModuleWrapper) -> dict[str, Any]:
    """Bits, scale, zero point, integer range and tracked ranges of every quant type of one layer."""

    def qparams(t: str) -> tuple[Any, Any, int, int] | None:
        qp = wrapper.qparams(t)
        if qp is None:
            return None
        s, z, qmin, qmax = qp
        return s.detach().cpu().double().numpy(), z.detach().cpu().double().numpy(), qmin, qmax

    def tracked(key: str) -> Any:
        b = wrapper._buffers.get(key)
        return None if b is None else _host(b)

    return calibration_record(wrapper.quant_types, wrapper.type, wrapper.quant_bits, qparams, tracked)


def _state_entries(quantizer: Any, wrapper: QuantizerModuleWrapper, weight: torch.Tensor,
                   bias: torch.Tensor | None) -> dict[str, torch.Tensor]:
    hook = getattr(quantizer, "export_state_entries", None)
    if hook is not None:
        out = hook(wrapper, weight, bias)
        if out is not None:
            return out
    prefix = f"{wrapper.name}.{wrapper._weight_path[: -len('weight')]}"
    out = {prefix + "weight": weight}
    if bias is not None:
        out[prefix + "bias"] = bias
    return out


def export_model(quantizer: Any, model_path: str | os.PathLike | None, calibration_path: str | os.PathLike | None = None,
                 onnx_path: str | os.PathLike | None = None, input_shape: tuple[int, ...] | None = None,
                 device: torch.device | str | None = None, dummy_input: Any = None,
                 **onnx_kwargs: Any) -> dict[str, dict[str, Any]]:
    """See :meth:`TorchQuantizer.export_model`. The model's train/eval mode is restored afterwards.
    ``model_path=None`` writes only the other targets (e.g. just the ONNX file); at least one is needed."""
    if model_path is None and calibration_path is None and onnx_path is None:
        raise ConfigError("export_model: nothing to write; give model_path, calibration_path or onnx_path")
    if onnx_path is not None and input_shape is None and dummy_input is None:
        raise ValueError("export_model: onnx_path needs input_shape (or dummy_input)")
    fmt = onnx_kwargs.pop("onnx_format", "auto")
    weight_dtype = onnx_kwargs.pop("onnx_weight_dtype", "auto")
    if weight_dtype not in ("auto", "int8", "uint8"):
        raise ConfigError(f"export_model: onnx_weight_dtype must be 'auto', 'int8' or 'uint8', got {weight_dtype!r}")
    if weight_dtype == "auto":  # exact integer kernels on THIS machine (see compressor.core.cpu)
        from ...core.cpu import exact_onnx_weight_dtype

        weight_dtype = exact_onnx_weight_dtype()
    if fmt not in ("auto", "int8", "fake_quant"):
        raise ValueError(f"export_model: onnx_format must be 'auto', 'int8' or 'fake_quant', got {fmt!r}")
    if onnx_path is not None and fmt != "fake_quant":
        from .onnx_qdq import check_int8_ready, float_layers, int8_export_problem

        problem = int8_export_problem(quantizer)
        if problem is None:
            check_int8_ready(quantizer)  # before anything is written
            fmt = "int8"
            left = _float_layer_note(quantizer, float_layers(quantizer))
            if left:
                warnings.warn(
                    f"export_model: the int8 ONNX graph keeps {len(left)} layer(s) in float (float weights and "
                    f"float compute; onnxruntime runs integer kernels only for Conv / Linear / Conv1D, as "
                    f"QLinearConv, QGemm, QLinearMatMul): {'; '.join(left)}", UserWarning, stacklevel=3)
        elif fmt == "int8":
            raise ValueError(f"export_model: onnx_format='int8': {problem}")
        else:
            fmt = "fake_quant"
            warnings.warn(f"export_model: writing the fake-quant ONNX form (float weights, no integer kernels), not "
                          f"int8: {problem}; onnx_format='fake_quant' selects it without this warning",
                          UserWarning, stacklevel=3)
    model = quantizer.bound_model
    wrappers: list[QuantizerModuleWrapper] = quantizer.get_modules_wrapper()
    args: tuple = ()
    kwargs: dict[str, Any] = {}
    if onnx_path is not None:
        from ..onnx_io import model_inputs

        dev = device if device is not None else next((p.device for p in model.parameters()), "cpu")
        args, kwargs = model_inputs(dummy_input, input_shape, dev)
    training = model.training
    model.eval()
    try:
        state, exported = quantized_state_dict(quantizer)
        with torch.no_grad():
            calibration = {w.name: quantizer.calibration(w) for w in wrappers}
        # all or nothing: temporary files moved into place once every artifact is written
        with atomic_paths(model_path, calibration_path, onnx_path, names=("model_path", "calibration_path",
                                                                          "onnx_path")) as (tmp_model, tmp_calib, tmp_onnx):
            if tmp_model is not None:
                save_file(state, tmp_model)
            if tmp_calib is not None:
                save_file(calibration, tmp_calib)
            if tmp_onnx is not None:
                if fmt == "int8":
                    from .onnx_qdq import export_int8_onnx

                    quantizer.onnx_int8_summary = export_int8_onnx(quantizer, exported, tmp_onnx,
                                                                   args[0] if len(args) == 1 and not kwargs
                                                                   else (args, kwargs), weight_dtype=weight_dtype,
                                                                   **onnx_kwargs)
                else:
                    export_onnx(quantizer, exported, tmp_onnx, args, kwargs, **onnx_kwargs)
    finally:
        model.train(training)
    return calibration


def _float_layer_note(quantizer: Any, left: list[QuantizerModuleWrapper]) -> list[str]:
    """One entry per model layer the int8 ONNX graph keeps in float: the quantized layers without an integer
    kernel (an LSTM's weight matrices grouped under the LSTM) and the recurrent layers the config left out
    (an LSTM is most of a recurrent model's compute: a file called int8 that runs it in float says so)."""
    from ..slots import slot_of

    groups: dict[str, tuple[str, list[str]]] = {}
    for w in left:
        slot = slot_of(w)
        name = slot.layer_name if slot is not None else w.name
        kind = type(slot.owner).__name__ if slot is not None else type(w.layer).__name__
        groups.setdefault(name, (kind, []))[1].append(slot.spec.key if slot is not None else "weight")
    out = [f"{name!r} ({kind}: quantized weight values {', '.join(keys)} stored as float, no activation "
           f"quantization)" for name, (kind, keys) in groups.items()]
    covered = set(groups) | {w.name for w in quantizer.get_modules_wrapper()}
    from ..slots import SlottedLayer

    for name, module in quantizer.bound_model.named_modules():
        if isinstance(module, SlottedLayer) or name in covered:
            continue
        if isinstance(module, (torch.nn.RNNBase, torch.nn.RNNCellBase)) and not any(
                name.startswith(c + ".") for c in covered):
            out.append(f"{name!r} ({type(module).__name__}: not in the config, float)")
    return out


def quantized_state_dict(quantizer: Any) -> tuple[dict[str, torch.Tensor], dict[str, tuple]]:
    """The state_dict of the model with ``quantizer``'s wrappers taken out, each quantized weight holding its
    quantized values, and ``{layer: (weight, bias)}`` as :meth:`TorchQuantizer.export_weight` gave them.
    Call it with the model in eval mode (as export does)."""
    model = quantizer.bound_model
    wrappers: list[QuantizerModuleWrapper] = quantizer.get_modules_wrapper()
    with torch.no_grad():
        exported = {w.name: quantizer.export_weight(w) for w in wrappers}
    quantizer._unwrap_model()
    try:
        state = dict(model.state_dict())
    finally:
        quantizer._wrap_model()
    for w in wrappers:
        weight, bias = exported[w.name]
        entries = slot_state_entries(state, w, weight)  # a matrix of a recurrent / attention layer
        if entries is None:
            entries = _state_entries(quantizer, w, weight, bias)
        for key, value in entries.items():
            if key not in state:
                raise RuntimeError(f"export_model: {key!r} is not in the unwrapped model's state_dict")
            state[key] = value.detach().clone().to(state[key].dtype)
    return state, exported


def export_onnx(quantizer: Any, exported: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                onnx_path: str | os.PathLike, args: Any, kwargs: dict[str, Any] | None = None,
                **onnx_kwargs: Any) -> None:
    """Run ``torch.onnx.export`` with the wrappers in export mode (QDQ nodes, quantized weights), dynamic
    batch (and token sequence) axes; see :func:`compressor.torch.onnx_io.export_onnx`."""
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - its ops must exist before the exporter's registry

    from ..onnx_io import export_onnx as export_graph

    if not isinstance(args, tuple):  # a single input tensor (older callers)
        args = (args,)
    model = quantizer.bound_model
    wrappers: list[QuantizerModuleWrapper] = quantizer.get_modules_wrapper()
    for w in wrappers:
        w.export_mode = True
        w._export_weight, w._export_bias = exported[w.name]
        w._export_plan = {t: _activation_plan(w, t) for t in w.quant_types if t != "weight"}
        w._export_qparams = {t: _frozen_qparams(w, t) for t in w.quant_types}
    # dynamic batch (and token sequence) axes on every graph: under torch.export the QDQ pairs are traced as
    # quantized_decomposed ops, which have shape functions (see .fakequant.onnx_qdq)
    try:
        # checked in onnxruntime for outputs (count, shapes); values are not compared: a float difference of
        # 1e-7 may move a value across a rounding boundary, one quantization step apart
        export_graph(model, onnx_path, args, kwargs, check=True, atol=None, **onnx_kwargs)
    finally:
        for w in wrappers:
            w.export_mode = False
            w._export_weight = w._export_bias = None
            w._export_plan = w._export_qparams = None


def _activation_plan(wrapper: QuantizerModuleWrapper, t: str) -> str:
    """'qdq' (recorded scale/zero point), 'call' (the quantizer's own op) or 'skip' (nothing to apply)."""
    if not wrapper.quant_active:
        return "skip"
    if wrapper.qparams(t) is None:
        return "call"
    observed = wrapper._buffers.get(f"{t}_observed")
    if observed is not None and not bool(observed):
        return "skip"
    return "qdq"


def _frozen_qparams(wrapper: QuantizerModuleWrapper, t: str) -> tuple | None:
    """Copies of one quantization's parameters for tracing (the model's buffers may change later)."""
    qp = wrapper.qparams(t)
    if qp is None:
        return None
    scale, zp, qmin, qmax = qp
    axis = quant_axis(wrapper.layer, t) if scale.dim() > 0 else None
    if axis is None and scale.numel() == 1:  # host numbers: torch.export traces a per-tensor QDQ pair of them
        return float(scale), float(zp), qmin, qmax, None
    return scale.detach().clone(), zp.detach().clone(), qmin, qmax, axis


def _qdq(wrapper: QuantizerModuleWrapper, t: str, x: torch.Tensor) -> torch.Tensor:
    scale, zp, qmin, qmax, axis = wrapper._export_qparams[t]
    return onnx_qdq(x, scale, zp, qmin, qmax, axis)


def export_forward(quantizer: Any, wrapper: QuantizerModuleWrapper, inputs: tuple, kwargs: dict[str, Any]) -> Any:
    """The wrapper's forward during ONNX export: stored parameters only, QDQ where possible."""

    def activation(t: str, x: torch.Tensor) -> torch.Tensor:
        plan = wrapper._export_plan[t]
        if plan == "qdq":
            return _qdq(wrapper, t, x)
        if plan == "call":
            return quantizer._call(t, x, wrapper)
        return x

    if wrapper._q_input and inputs:
        inputs = (activation("input", inputs[0]), *inputs[1:])
    if wrapper._q_weight:
        weight = wrapper._export_weight
        if wrapper.quant_active and wrapper._export_qparams["weight"] is not None:
            weight = _qdq(wrapper, "weight", weight)
        out = wrapper.forward_with_weight(weight, inputs, kwargs, bias=wrapper._export_bias)
    else:
        out = wrapper.module(*inputs, **kwargs)
    if wrapper._q_output:
        fused = getattr(wrapper, "fused_relu", False)
        if fused:
            out = torch.clamp(out, 0.0, 6.0) if fused == "relu6" else torch.relu(out)
        out = activation("output", out)
    return out


def load_calibration_config(quantizer: Any, calibration_config: dict[str, dict[str, Any]]) -> None:
    """Copy a calibration config into the wrappers; everything is checked before anything is written."""
    what = type(quantizer).__name__
    wrappers = {w.name: w for w in quantizer.get_modules_wrapper()}
    check_calibration_layers(what, calibration_config, wrappers)
    plan: list[tuple[torch.Tensor, torch.Tensor]] = []
    flags: list[torch.Tensor] = []
    frozen: list[QuantizerModuleWrapper] = []
    for name, entry in calibration_config.items():
        w = wrappers[name]
        for t in w.quant_types:
            qp = w.qparams(t)
            check_calibration_type(what, name, t, entry, w.quant_bits[t], None if qp is None else (qp[2], qp[3]))
            for key in loadable_keys(t):
                if key not in entry:
                    continue
                target = getattr(w, key, None)
                if not torch.is_tensor(target):
                    continue
                value = torch.as_tensor(entry[key], dtype=target.dtype, device=target.device)
                if value.shape != target.shape:
                    raise ConfigError(f"{what}: layer {name!r}: calibration {key} has shape {tuple(value.shape)}, "
                                      f"expected {tuple(target.shape)}")
                plan.append((target, value))
            observed = w._buffers.get(f"{t}_observed")
            if observed is not None and f"{t}_scale" in entry:
                flags.append(observed)
        if "weight" in w.quant_types and "weight_scale" in entry:
            frozen.append(w)
    with torch.no_grad():
        for target, value in plan:
            target.copy_(value)
        for flag in flags:
            flag.fill_(True)
    for w in frozen:
        w.frozen = True
