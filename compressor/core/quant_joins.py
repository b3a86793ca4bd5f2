"""The range rule at joins and pools: where an int8 graph re-quantizes and which tensors share one grid.

Quantized layers (Conv / Linear) have their own input and output ranges. Between them, a model joins and
reduces activations: residual adds, products (gates, squeeze-excitation), concatenations, average pooling.
The runtimes run these in int8 when every input comes from a dequantized tensor and the output is quantized
(onnxruntime: ``DQ -> Add -> Q`` becomes ``QLinearAdd``, likewise ``QLinearMul``, ``QLinearConcat``,
``QLinearAveragePool``, ``QLinearGlobalAveragePool``; TFLite's converter does the same from its calibrated
ranges). One rule for both backends, as onnxruntime's ``quantize_static`` and TFLite choose:

* ``add`` / ``mul`` / ``concat`` / ``global_avgpool``: the output gets its OWN calibrated range (the sum of
  two grids lies on neither); each input keeps its producer's grid (the integer kernels re-quantize);
* ``avgpool`` (a k x k window): the output takes the first input's grid (a mean of values in a range stays
  in it; onnxruntime's ``quantize_static`` shares it too), nothing to calibrate;
* a ReLU that is the only reader of a join's output folds into that output's range (the range is observed
  after the ReLU, so its zero point is the lowest code and the runtime drops the ReLU), as for layers;
* ``concat`` on TFLite: the kernel needs inputs and output on one grid; the converter re-quantizes
  inputs to the output's grid (``JoinRule.inputs_share_output['tflite']``); onnxruntime's QLinearConcat
  takes inputs on any grid;
* a join with an input on no grid (a float tensor, a parameter such as a position embedding, an
  attention mask) stays float: quantizing it would add a Q/DQ pair without an integer kernel.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["JOIN_KINDS", "JoinRule", "join_rule", "quantize_join"]


@dataclass(frozen=True)
class JoinRule:
    """How one kind of join is quantized: ``output`` is ``'own'`` (calibrated on the output) or ``'input'``
    (the output reuses input 0's scale and zero point); ``relu_folds``: a ReLU reading only the output is
    absorbed into its range; ``inputs_share_output``: runtimes whose kernel needs every input on the
    output's grid."""

    output: str
    relu_folds: bool = True
    inputs_share_output: dict[str, bool] = field(default_factory=dict)
    min_inputs: int = 1


JOIN_KINDS: dict[str, JoinRule] = {
    "add": JoinRule("own", min_inputs=2),
    "mul": JoinRule("own", min_inputs=2),
    "concat": JoinRule("own", inputs_share_output={"onnxruntime": False, "tflite": True}, min_inputs=2),
    "avgpool": JoinRule("input", relu_folds=False),
    "global_avgpool": JoinRule("own", relu_folds=False),
}


def join_rule(kind: str) -> JoinRule:
    """The :class:`JoinRule` of ``kind`` (one of :data:`JOIN_KINDS`); ValueError naming the kinds otherwise."""
    if kind not in JOIN_KINDS:
        raise ValueError(f"unknown join kind {kind!r}; known: {sorted(JOIN_KINDS)}")
    return JOIN_KINDS[kind]


def quantize_join(kind: str, inputs_on_grid: Sequence[bool]) -> JoinRule | None:
    """The rule to quantize a join of ``kind`` whose tensor inputs are (True) or are not (False) on a
    quantization grid, or None when it stays float (unknown kind, too few tensor inputs, or an input on no
    grid)."""
    rule = JOIN_KINDS.get(kind)
    if rule is None or len(inputs_on_grid) < rule.min_inputs or not all(inputs_on_grid):
        return None
    return rule
