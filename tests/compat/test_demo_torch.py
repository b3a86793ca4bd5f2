"""``compressor demo --quick`` on PyTorch: the table carries the measured numbers, the exported pruned
model is exactly 80 % sparse per layer (floor(n * 0.8) weights), accuracies are sane, errors are clean."""

from __future__ import annotations

import math

import pytest
import torch  # noqa: F401  (marks the module: collected only where torch is installed)

from compressor import cli, demo

# weights per layer of the demo CNN on 8x8 digits
LAYER_SIZES = {"conv1": 16 * 1 * 9, "conv2": 32 * 16 * 9, "fc1": 512 * 64, "fc2": 64 * 10}
# structured + speedup keeps 8 / 16 / 32 channels of conv1 / conv2 / fc1 (fc1 sees 16 * 4 * 4 inputs)
STRUCT_PARAMS = (8 * 9 + 8) + (16 * 8 * 9 + 16) + (256 * 32 + 32) + (32 * 10 + 10)
DENSE_MACS = 16 * 9 * 64 + 32 * 144 * 64 + 512 * 64 + 64 * 10
STRUCT_MACS = 8 * 9 * 64 + 16 * 72 * 64 + 256 * 32 + 32 * 10


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    lines: list[str] = []
    plot = tmp_path_factory.mktemp("demo") / "demo.png"
    results = demo.run_demo(["torch"], quick=True, plot=str(plot), progress=False, out=lines.append)
    return results, "\n".join(lines), plot


def test_sparsity_is_exactly_the_target(quick_run):
    (r,), _, _ = quick_run
    expected = {k: math.floor(n * demo.SPARSITY) / n for k, n in LAYER_SIZES.items()}
    assert r.layer_sparsity == pytest.approx(expected, abs=1e-12)
    total = sum(math.floor(n * demo.SPARSITY) for n in LAYER_SIZES.values()) / sum(LAYER_SIZES.values())
    assert r.sparsity == pytest.approx(total, abs=1e-12)
    assert abs(r.sparsity - 0.8) < 1e-3


def test_accuracies_and_sizes(quick_run):
    (r,), _, _ = quick_run
    assert r.backend == "torch" and r.data == "digits"
    assert r.acc_dense > 0.85 and r.acc_pruned > 0.80 and r.acc_quant > 0.85
    n_weights = sum(LAYER_SIZES.values())
    n_params = n_weights + 16 + 32 + 64 + 10
    assert r.dense_bytes == 4 * n_params
    assert r.mask_bytes == n_weights + (16 + 32 + 64 + 10)  # bool weight and bias masks, 1 byte each
    # int8: 1 byte per weight, 4 per bias, scale+zero point (8 bytes) per quantized tensor: 4 weights,
    # 4 outputs, 1 input (conv1)
    assert r.int8_bytes == n_weights + 4 * (16 + 32 + 64 + 10) + 8 * 9
    for t in (r.step_dense, r.step_pruned, r.step_quant):
        assert 0 < t < 5.0


def test_table_shows_the_numbers(quick_run):
    (r,), text, _ = quick_run
    for value in (r.acc_dense, r.acc_pruned, r.acc_quant, r.sparsity):
        assert demo._pct(value) in text
    assert f"{r.dense_bytes:,} fp32" in text and f"+{r.mask_bytes:,} bool masks" in text
    assert f"{r.int8_bytes:,} int8 export" in text
    assert f"({r.pruned_overhead:.2f}x)" in text and f"({r.quant_overhead:.2f}x)" in text
    assert "== torch: small CNN on digits 8x8" in text


def test_plot_is_written(quick_run):
    _, text, plot = quick_run
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"figure saved to {plot}" in text


def test_int8_bytes_per_channel_and_tf_names():
    params = {"cnn/fc1/kernel": 100, "cnn/fc1/bias": 10, "cnn/fc2/kernel": 20, "cnn/fc2/bias": 2}
    calib = {"fc1": {"quant_types": ["weight"], "weight_bits": 4, "weight_scale": [0.1] * 10},
             "fc2": {"quant_types": ["output"], "output_bits": 8, "output_scale": 0.5}}
    # fc1 kernel packed at 4 bits (50 B) + 10 scales/zero points (80 B); the rest float32; fc2 output 8 B
    assert demo.int8_export_bytes(params, calib) == 50 + 80 + 8 + 4 * (10 + 20 + 2)


def test_cli_errors_are_one_line(capsys, tmp_path):
    assert cli.main(["demo", "--data", "mnist"]) == 2
    assert "--data mnist needs --data-dir" in capsys.readouterr().err
    assert cli.main(["demo", "--backend", "torch", "--data", "mnist", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("compressor demo: error: MNIST directory") and "lacks train-images-idx3-ubyte.gz" in err
    assert len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as info:
        cli.main(["demo", "--backend", "jax"])
    assert info.value.code == 2


def test_structured_speedup_column_is_really_smaller(quick_run):
    (r,), text, _ = quick_run
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
