import pytest

from compressor.core.schedules import (
    agp_should_update,
    agp_span,
    agp_sparsity,
    lottery_keep_ratio,
    lottery_sparsity,
)


def test_agp_reference_values():
    expect = [0, 0.2381, 0.4236, 0.5630, 0.6628, 0.7298, 0.7704, 0.7912, 0.7989, 0.8]
    got = [agp_sparsity(e, 0.0, 0.8, 0, 10, 1) for e in range(10)]
    assert got == pytest.approx(expect, abs=5e-5)
    assert agp_sparsity(25, 0.0, 0.8, 0, 10, 1) == 0.8


def test_agp_frequency_and_span():
    # start 0, end 16, freq 2: span 14, final sparsity at epoch 14, updates on even epochs only
    assert agp_span(0, 16, 2) == 14
    assert [e for e in range(20) if agp_should_update(e, 0, 16, 2)] == [0, 2, 4, 6, 8, 10, 12, 14]
    assert agp_sparsity(14, 0.05, 0.6, 0, 16, 2) == 0.6
    assert agp_sparsity(0, 0.05, 0.6, 0, 16, 2) == 0.05
    assert agp_sparsity(7, 0.05, 0.6, 0, 16, 2) == pytest.approx(0.6 + (0.05 - 0.6) * (1 - 7 / 14) ** 3)
    assert not agp_should_update(1, 2, 10, 1)


def test_agp_guards():
    assert agp_sparsity(0, 0.5, 0.5, 0, 10, 1) == 0.5
    assert agp_sparsity(3, 0.0, 0.7, 5, 5, 1) == 0.7
    assert agp_sparsity(3, 0.0, 0.7, 0, 1, 1) == 0.7  # span 0


def test_agp_monotone():
    vals = [agp_sparsity(e, 0.1, 0.9, 2, 30, 3) for e in range(40)]
    assert all(a <= b for a, b in zip(vals, vals[1:]))


def test_lottery():
    keep = lottery_keep_ratio(0.8, 5)
    assert keep == pytest.approx(0.2 ** 0.2)
    assert lottery_sparsity(0, 0.8, 5) == 0.0
    assert lottery_sparsity(1, 0.8, 5) == pytest.approx(1 - keep)
    assert lottery_sparsity(5, 0.8, 5) == 0.8
    with pytest.raises(ValueError):
        lottery_keep_ratio(0.8, 0)
