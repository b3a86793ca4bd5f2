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
  attention mask) stays float: quantizing it would add a Q/DQ pair without an integer kernel;
* except (``requantize_inputs``, residual ``add`` only, opt-in per backend): an add with at least one input on a
  grid whose other inputs are activations made by a float op that can take a range of their own (a LayerNorm's
  output, a float join's output: not a parameter, a constant, a model input or a model output) gets each such
  input quantized at its producer (its own calibrated range; every reader of that tensor shares it), so the add
  runs integer. This is the transformer residual stream (``dense(x) + LayerNorm(...)`` in BERT, ``attention(x) +
  embeddings`` in ViT), which ``quantize_static`` runs as QLinearAdd; it rounds the residual path to 8 bits, which
  costs agreement with the float model (see :func:`requantized_join_inputs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

__all__ = ["JOIN_KINDS", "JoinRule", "join_rule", "quantize_join", "requantized_join_inputs"]


@dataclass(frozen=True)
class JoinRule:
    """How one kind of join is quantized: ``output`` is ``'own'`` (calibrated on the output) or ``'input'``
    (the output reuses input 0's scale and zero point); ``relu_folds``: a ReLU reading only the output is
    absorbed into its range; ``inputs_share_output``: runtimes whose kernel needs every input on the
    output's grid; ``requantize_inputs``: a float activation input may be given a range of its own at its
    producer so the join runs integer (:func:`requantized_join_inputs`)."""

    output: str
    relu_folds: bool = True
    inputs_share_output: dict[str, bool] = field(default_factory=dict)
    min_inputs: int = 1
    requantize_inputs: bool = False


JOIN_KINDS: dict[str, JoinRule] = {
    "add": JoinRule("own", min_inputs=2, requantize_inputs=True),
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


def requantized_join_inputs(kind: str, inputs_on_grid: Sequence[bool],
                            inputs_can_take_range: Sequence[bool]) -> list[int] | None:
    """Indices of the inputs of a join of ``kind`` to quantize at their producers (own calibrated range) so that
    the join runs integer: ``[]`` when every input is already on a grid, the off-grid inputs when the kind allows
    it (``requantize_inputs``), at least one input is on a grid and every off-grid input ``can_take_range`` (an
    activation made by a float op such as LayerNorm or a float join; not a parameter, a constant or a model
    input); None when the join stays float."""
    rule = JOIN_KINDS.get(kind)
    if rule is None or len(inputs_on_grid) < rule.min_inputs:
        return None
    off = [i for i, on in enumerate(inputs_on_grid) if not on]
    if not off:
        return []
    if not rule.requantize_inputs or len(off) == len(inputs_on_grid):
        return None
    return off if all(inputs_can_take_range[i] for i in off) else None
