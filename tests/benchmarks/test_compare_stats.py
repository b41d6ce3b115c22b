"""The statistics the side-by-side benchmarks print their verdict with."""

from __future__ import annotations

import math

import pytest
from benchmarks._compare import paired_interval, pooled, verdict


def test_the_interval_of_paired_ratios() -> None:
    mean, low, high = paired_interval([1.004, 1.016, 1.011, 0.996, 1.014])
    assert mean == pytest.approx(1.0082, abs=1e-4)
    # t(0.975, 4) = 2.776 on the logs' standard error.
    logs = [math.log(r) for r in (1.004, 1.016, 1.011, 0.996, 1.014)]
    sd = math.sqrt(sum((x - sum(logs) / 5) ** 2 for x in logs) / 4)
    assert math.log(high / mean) == pytest.approx(2.776 * sd / math.sqrt(5), rel=1e-3)
    assert low < 1.0 < high
    assert verdict(low, high) == "no difference from it detectable"


def test_verdicts() -> None:
    assert verdict(*paired_interval([1.05, 1.06, 1.04, 1.05])[1:]) == "at least 1x shown"
    assert verdict(*paired_interval([0.90, 0.91, 0.92])[1:]) == "below 1x"
    assert verdict(0.99, 1.01, target=0.95) == "at least 0.95x shown"
    mean, low, high = paired_interval([1.1])  # one round: no interval
    assert mean == pytest.approx(1.1) and low == 0.0 and high == math.inf


def test_pooled_batches_keep_each_processs_cpu() -> None:
    def measured(tokens: int, each: list[float]) -> dict:
        result = {"sent": 0.0, "stamps": [0.1, 0.2], "tokens": tokens}
        attempt = {"other_cores": 0.0}
        return {
            "results": [result],
            "wall": 1.0,
            "attempts": [attempt],
            "other_cores": 0.0,
            "frontend_cpu_s": sum(each),
            "frontend_cpu_s_each": each,
        }

    level = pooled([measured(100, [0.003, 0.001]), measured(300, [0.005, 0.003])])
    assert level["frontend_us_per_token"] == pytest.approx(30.0)  # 12 ms over 400 tokens
    assert level["frontend_us_per_token_each"] == pytest.approx([20.0, 10.0])
