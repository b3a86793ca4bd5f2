"""compressor/tf/calibration_data.py: calibration data of 0 samples, or a batch of 0 samples among others, is a
ConfigError naming the batch (or saying the data is empty), for the one-shot compressors and post-training
quantization alike, as on the torch side (tests/torch/test_calibration_empty_batches.py)."""

from __future__ import annotations

import numpy as np
import pytest

keras = pytest.importorskip("keras")
tf = pytest.importorskip("tensorflow")

from compressor.core.errors import ConfigError  # noqa: E402
from compressor.tf import PtqQuantizer, SparseGPTPruner  # noqa: E402

pytestmark = pytest.mark.tf

EMPTY = np.zeros((0, 4), np.float32)
GOOD = np.ones((2, 4), np.float32)


def _model():
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(2)])
    m(GOOD)
    return m


CASES = [
    (EMPTY, "no batch in the data; calibrate with at least one batch",
     "the calibration data is empty; give a few hundred calibration sequences"),
    ([EMPTY], "calibration batch 0 is empty (shape (0, 4)); calibrate with at least one batch",
     "calibration batch 0 is empty (shape (0, 4)); give a few hundred calibration sequences"),
    ([GOOD, EMPTY], "calibration batch 1 is empty (shape (0, 4)); calibrate with at least one batch",
     "calibration batch 1 is empty (shape (0, 4)); give a few hundred calibration sequences"),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_zero_samples_are_a_config_error_naming_the_batch(case):
    data, ptq_msg, oneshot_msg = CASES[case]
    model = _model()
    q = PtqQuantizer(model, [{"quant_types": ["weight", "output"], "quant_bits": 8, "op_types": ["Dense"]}])
    with pytest.raises(ConfigError) as e:
        q.calibrate(data)
    assert str(e.value) == f"PtqQuantizer.calibrate: {ptq_msg}"
    model = _model()
    kernels = [layer.kernel.numpy() for layer in model.layers]
    p = SparseGPTPruner(model, [{"sparsity": 0.5, "op_types": ["Dense"]}])
    with pytest.raises(ConfigError) as e:
        p.calibrate(data, progress=False)
    assert str(e.value) == f"SparseGPTPruner.calibrate: {oneshot_msg}"
    assert all(np.array_equal(k, layer.kernel.numpy()) for k, layer in zip(kernels, model.layers))
