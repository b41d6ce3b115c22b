"""benchmarks.stream_interval's report from made-up rounds: each side's medians
and the rounds' paired ratios N/1."""

from __future__ import annotations

from benchmarks._compare import paired_levels
from benchmarks.stream_interval import markdown

SIDES = ("interval 4", "interval 1")


def a_round(grouped: float, every: float) -> dict[str, dict[str, dict[str, float]]]:
    return {
        "interval 4": {"8": {"frontend_us_per_token": grouped, "tokens_per_s": 200.0}},
        "interval 1": {"8": {"frontend_us_per_token": every, "tokens_per_s": 100.0}},
    }


def test_paired_ratios_and_medians_per_side() -> None:
    rounds = [a_round(40, 80), a_round(60, 100), a_round(50, 90)]
    levels = paired_levels(rounds, [8], SIDES)
    cpu = levels["8"]["frontend_us_per_token"]
    assert cpu["ratios"] == [0.5, 0.6, 50 / 90]
    assert (cpu["interval 4"], cpu["interval 1"]) == (50, 90)
    assert levels["8"]["tokens_per_s"]["ratios"] == [2.0, 2.0, 2.0]
    report = {
        "interval": 4,
        "code": {"commit": "abc1234", "uncommitted_server_files": []},
        "tokens": 64,
        "repeats": 3,
        "batches": 2,
        "levels": levels,
    }
    text = markdown(report, SIDES)
    assert "`response.stream_interval` 4 against 1" in text
    assert "| concurrency | frontend CPU interval 4 (µs/token) | interval 1 |" in text
    assert "| 8 | 50.0 | 90.0 | 0.550 [" in text
