"""The whole pipeline on real architectures (issue 23), the fast CI subset of benchmarks/pipeline_matrix.py:
dependency-aware L1 filter pruning at 50 % with ``op_types: ['default']`` -> strict ``speedup_model`` ->
3 fine-tune steps -> ``PtqQuantizer`` calibrated on 8 batches -> int8 ONNX, checked on the artifact in
onnxruntime. The full matrix (7 + 8 named architectures, 8 + 7 others) is ``python -m
benchmarks.pipeline_matrix [--extra]``; its table is in benchmarks/RESULTS.md."""

from __future__ import annotations

import importlib

import pytest

from tests.conftest import in_ci

pytestmark = pytest.mark.filterwarnings("ignore")


def _need(mod: str):
    if in_ci():
        return importlib.import_module(mod)  # a missing test dependency fails in CI
    return pytest.importorskip(mod)


@pytest.mark.parametrize("name", ["hf-resnet", "hf-gpt2", "lstm"])
def test_pipeline_runs_clean_on_the_artifact(name, tmp_path):
    for mod in ("transformers", "onnx", "onnxruntime"):
        _need(mod)
    from benchmarks.pipeline_matrix import run_one

    row = run_one(name, workdir=str(tmp_path))
    assert not row.failed, f"{row.failed}: {row.error}"
    assert row.params_ratio < 1 and row.macs_ratio < 1, (row.params_ratio, row.macs_ratio)
    assert row.zeros_left == 0                     # every pruned channel was removed, none left as zeros
    assert row.blocking_floats == [] and row.int_kernels > 0, row.float_kernels  # integer Conv / Gemm / MatMul
    assert row.dynamic_batch                       # batch 16 and batch 1 both ran
    assert row.agreement >= 0.9, (row.agreement, row.rel_error)
    assert 0 < row.size_int8 < row.size_pruned_float, (row.size_int8, row.size_pruned_float)
    assert row.clean
