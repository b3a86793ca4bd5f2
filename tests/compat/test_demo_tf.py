"""``compressor demo --quick`` on TensorFlow / Keras 3: the same checks as on PyTorch (the demo CNN has
the same layers, so the same exact per-layer pruned counts and byte counts)."""

from __future__ import annotations

import math

import pytest
import tensorflow as tf  # noqa: F401  (marks the module: collected only where tensorflow is installed)

from compressor import demo

LAYER_SIZES = {"conv1": 16 * 1 * 9, "conv2": 32 * 16 * 9, "fc1": 512 * 64, "fc2": 64 * 10}
# structured + speedup keeps 8 / 16 / 32 channels of conv1 / conv2 / fc1 (fc1 sees 16 * 4 * 4 inputs)
STRUCT_PARAMS = (8 * 9 + 8) + (16 * 8 * 9 + 16) + (256 * 32 + 32) + (32 * 10 + 10)
DENSE_MACS = 16 * 9 * 64 + 32 * 144 * 64 + 512 * 64 + 64 * 10
STRUCT_MACS = 8 * 9 * 64 + 16 * 72 * 64 + 256 * 32 + 32 * 10
BIASES = 16 + 32 + 64 + 10


@pytest.fixture(scope="module")
def quick_run():
    lines: list[str] = []
    results = demo.run_demo(["tf"], quick=True, progress=False, out=lines.append)
    return results[0], "\n".join(lines)


def test_sparsity_is_exactly_the_target(quick_run):
    r, _ = quick_run
    expected = {k: math.floor(n * demo.SPARSITY) / n for k, n in LAYER_SIZES.items()}
    assert r.layer_sparsity == pytest.approx(expected, abs=1e-12)
    total = sum(math.floor(n * demo.SPARSITY) for n in LAYER_SIZES.values()) / sum(LAYER_SIZES.values())
    assert r.sparsity == pytest.approx(total, abs=1e-12)


def test_accuracies_sizes_and_table(quick_run):
    r, text = quick_run
    assert r.backend == "tf"
    assert r.acc_dense > 0.85 and r.acc_pruned > 0.80 and r.acc_quant > 0.85
    n_weights = sum(LAYER_SIZES.values())
    assert r.dense_bytes == 4 * (n_weights + BIASES)
    assert r.mask_bytes == n_weights + BIASES
    assert r.int8_bytes == n_weights + 4 * BIASES + 8 * 9
    for t in (r.step_dense, r.step_pruned, r.step_quant):
        assert 0 < t < 5.0
    for value in (r.acc_dense, r.acc_pruned, r.acc_quant, r.sparsity):
        assert demo._pct(value) in text
    assert f"{r.dense_bytes:,} fp32" in text and f"{r.int8_bytes:,} int8 export" in text
    assert f"({r.pruned_overhead:.2f}x)" in text
    assert "== tf: small CNN on digits 8x8" in text


def test_structured_speedup_column_is_really_smaller(quick_run):
    r, text = quick_run
    dense_params = sum(LAYER_SIZES.values()) + 16 + 32 + 64 + 10
    assert r.params == {"dense": dense_params, "pruned": dense_params, "quant": dense_params, "struct": STRUCT_PARAMS}
    assert r.macs == {"dense": DENSE_MACS, "pruned": DENSE_MACS, "quant": DENSE_MACS, "struct": STRUCT_MACS}
    assert r.struct_channels == {"conv1": (16, 8), "conv2": (32, 16), "fc1": (64, 32)}
    assert r.struct_bytes == 4 * STRUCT_PARAMS
    assert set(r.file_bytes) == {"dense", "pruned", "quant", "struct"}
    assert r.file_bytes["struct"] < 0.5 * r.file_bytes["dense"]
    assert r.acc_struct > 0.80
    assert set(r.infer) == {"dense", "pruned", "quant", "struct"} and all(0 < t < 5.0 for t in r.infer.values())
    assert 0 < r.step_struct < 5.0
    assert "structured (50% ch.) + speedup" in text
    assert f"{STRUCT_PARAMS:,} ({STRUCT_PARAMS / dense_params:.2f}x)" in text
    assert f"{STRUCT_MACS:,} ({STRUCT_MACS / DENSE_MACS:.2f}x)" in text
    assert demo._pct(r.acc_struct) in text and f"{r.file_bytes['struct']:,} B" in text
    assert "structured channels kept: conv1 16->8, conv2 32->16, fc1 64->32" in text
    assert "masks speed nothing up" not in text
