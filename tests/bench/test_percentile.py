"""The lab's one percentile rule (`kvquota_lab.percentile`)."""

from __future__ import annotations

import statistics

import pytest

from kvquota_lab.percentile import percentile


def test_no_data_is_none_and_one_sample_is_itself() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 0) == percentile([3.0], 99) == 3.0


def test_linear_interpolation_between_order_statistics() -> None:
    values = [4.0, 1.0, 3.0, 2.0]  # unsorted on purpose
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5  # halfway between 2 and 3
    assert percentile(values, 99) == pytest.approx(3.97)  # rank 2.97


def test_the_rule_is_numpys_default_and_statistics_inclusive() -> None:
    numpy = pytest.importorskip("numpy")
    values = [float(v * v % 17) for v in range(1, 40)]
    quantiles = statistics.quantiles(values, n=100, method="inclusive")
    for q in (1, 10, 50, 90, 95, 99):
        assert percentile(values, q) == pytest.approx(float(numpy.percentile(values, q)))
        assert percentile(values, q) == pytest.approx(quantiles[q - 1])


def test_q_is_in_percent() -> None:
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], 101)
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], -1)
