"""benchmarks.client_bound's table, from a made-up report."""

from __future__ import annotations

from benchmarks.client_bound import markdown


def test_each_level_has_its_medians_and_paired_ratio() -> None:
    report = {
        "tokens": 64,
        "rounds": 3,
        "levels": {
            "8": {
                "asyncllm_us_per_token": 62.5,
                "lean_us_per_token": 42.04,
                "lean_over_asyncllm": 0.671,
            },
            "32": {
                "asyncllm_us_per_token": 29.1,
                "lean_us_per_token": 17.7,
                "lean_over_asyncllm": 0.626,
            },
        },
    }
    text = markdown(report)
    assert "| 8 | 62.5 | 42.0 | 0.67x |" in text
    assert "| 32 | 29.1 | 17.7 | 0.63x |" in text
    assert "3 alternating rounds" in text
