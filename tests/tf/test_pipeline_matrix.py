"""The whole pipeline on real Keras architectures (issue 23), the fast CI subset of
benchmarks/pipeline_matrix.py: dependency-aware L1 filter pruning at 50 % with ``op_types: ['default']`` ->
strict ``speedup_model`` -> one epoch of ``fit`` -> ``PtqQuantizer`` calibrated on 8 batches -> full-integer
TFLite, checked on the artifact in the TFLite interpreter. The full matrix is ``python -m
benchmarks.pipeline_matrix [--extra]``; its table is in benchmarks/RESULTS.md."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.mark.parametrize("name", ["keras-text-transformer", "keras-lstm", "keras-mobilenetv3small"])
def test_pipeline_runs_clean_on_the_artifact(name, tmp_path):
    from benchmarks.pipeline_matrix import run_one

    row = run_one(name, workdir=str(tmp_path))
    assert not row.failed, f"{row.failed}: {row.error}"
    assert row.params_ratio < 1 and row.macs_ratio < 1, (row.params_ratio, row.macs_ratio)
    assert row.zeros_left == 0                     # every pruned channel was removed, none left as zeros
    assert row.blocking_floats == [] and row.int_kernels > 0, row.float_kernels  # int8 CONV_2D / FULLY_CONNECTED
    assert row.dynamic_batch                       # batch 16 and batch 1 both ran
    assert row.agreement >= 0.9, (row.agreement, row.rel_error)
    assert 0 < row.size_int8 < row.size_pruned_float, (row.size_int8, row.size_pruned_float)
    assert row.clean
