"""``model.fit`` with ``steps_per_execution > 1`` and ``jit_compile=True`` keeps the compression schedule
exact: the masks (AGP, per epoch) and the quantizer's step clock are those of the step-by-step run."""

from __future__ import annotations

import keras
import numpy as np
import pytest

from compressor.tf import AGPPruner, CompressionCallback, QAT_Quantizer

pytestmark = pytest.mark.tf

EPOCHS, STEPS, BATCH = 4, 8, 4
AGP = [{"initial_sparsity": 0.0, "final_sparsity": 0.75, "start_epoch": 0, "end_epoch": 4, "frequency": 1,
        "op_types": ["Dense"]}]
AGP_ZEROS = [0, 67, 92, 96]  # floor(128 * s), s = 0, 0.5278, 0.7222, 0.75 (as tests/torch/test_callbacks.py)
QAT = [{"quant_types": ["weight"], "quant_bits": 8, "quant_start_step": 12, "op_types": ["Dense"]}]


def fit(make, steps_per_execution: int, jit_compile: bool) -> list[tuple]:
    """Per epoch end: (pruned kernel entries, quantizer steps or None, quant_active or None)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8)])
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  steps_per_execution=steps_per_execution, jit_compile=jit_compile)
    compressor = make(model)
    compressor.compress()
    seen: list[tuple] = []

    class Probe(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            kernel = model.layers[0].kernel.numpy()
            if isinstance(compressor, QAT_Quantizer):
                seen.append((compressor.steps, bool(np.asarray(compressor.get_modules_wrapper()[0].quant_active))))
            else:
                seen.append((int((kernel == 0).sum()),))

    rng = np.random.default_rng(0)
    x = rng.standard_normal((STEPS * BATCH, 16)).astype("float32")
    y = rng.integers(0, 8, STEPS * BATCH)
    model.fit(x, y, epochs=EPOCHS, batch_size=BATCH, shuffle=False, verbose=0,
              callbacks=[CompressionCallback(compressor), Probe()])
    return seen


@pytest.mark.parametrize(("steps_per_execution", "jit_compile"), [(4, True), (4, False), (3, True)])
def test_agp_masks_per_epoch_match_step_by_step(steps_per_execution, jit_compile):
    reference = fit(lambda m: AGPPruner(m, AGP), 1, False)
    assert reference == [(z,) for z in AGP_ZEROS]
    assert fit(lambda m: AGPPruner(m, AGP), steps_per_execution, jit_compile) == reference


def test_qat_step_clock_with_steps_per_execution_and_xla():
    reference = fit(lambda m: QAT_Quantizer(m, QAT), 1, False)
    assert reference == [(8, False), (16, True), (24, True), (32, True)]  # fake quant from update 12
    assert fit(lambda m: QAT_Quantizer(m, QAT), 4, True) == reference
