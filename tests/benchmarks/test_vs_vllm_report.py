"""benchmarks.vs_vllm's report from made-up rounds: the frontend floor (vLLM's
AsyncLLM client alone) is taken off both servers' CPU before their ratio, and
the written floor (that client plus a socket write per delta) is set against
vLLM's whole frontend."""

from __future__ import annotations

import argparse
from typing import Any

from benchmarks.vs_vllm import build_report, chat_body, markdown, stem


def level(cpu_us: float) -> dict[str, Any]:
    return {
        "tokens_per_s": 100.0,
        "ttft_p50_ms": 200.0,
        "ttft_p99_ms": 250.0,
        "itl_p50_ms": 50.0,
        "itl_p99_ms": 70.0,
        "other_cores": 0.01,
        "attempts": [{}],
        "frontend_us_per_token": cpu_us,
    }


def a_round(tw: float, vllm: float, floor: float, written: float) -> dict[str, Any]:
    return {
        "tokenwire": {"startup_s": 20.0, "levels": {"8": level(tw)}},
        "vllm": {"startup_s": 20.0, "levels": {"8": level(vllm)}},
        "floor": {
            "8": {"frontend_us_per_token": floor, "written_us_per_token": written, "tokens": 1024}
        },
    }


def settings(**given: Any) -> argparse.Namespace:
    """vs_vllm's command line, as a run at c=8 gives it."""
    made = {"tokens": 64, "concurrency": [8], "batches": 2, "quiet_cores": 0.15, "retries": 1}
    return argparse.Namespace(**{**made, "stream_interval": 1, **given})


def test_the_floor_comes_off_both_servers_before_their_ratio() -> None:
    args = settings(repeats=3)
    # Medians over rounds: tokenwire 180, vLLM 280, floor 100, written floor 140.
    rounds = [
        a_round(180, 280, 100, 150),
        a_round(170, 300, 90, 140),
        a_round(200, 270, 110, 120),
    ]
    report = build_report(args, rounds, {"code": {}, "vllm_version": "test"}, 1.0)
    assert report["floor"] == {"8": 100}
    q = report["ratios"]["8"]
    assert q["frontend_us_per_token"] == 180 / 280
    assert q["frontend_above_floor"] == (180 - 100) / (280 - 100)
    text = markdown(report)
    assert "| 8 | vLLM's AsyncLLM client alone (floor) | - | - | - | - | - | 100 | |" in text
    assert "c=8: 0.44x." in text
    assert report["floor_written"] == {"8": 140}
    assert q["written_floor"] == 140 / 280
    assert "| 8 | the floor + one socket write per delta (written floor) | - |" in text
    assert "vLLM's whole frontend: c=8: 0.50x." in text
    assert q["frontend_above_written_floor"] == (180 - 140) / (280 - 140)
    assert "Above the written floor, tokenwire / vLLM: c=8: 0.29x." in text
    # Paired per round too, against the 0.5x target.
    assert q["frontend_us_per_token_rounds"] == [180 / 280, 170 / 300, 200 / 270]
    assert "against #19's 0.5x target: c=8: 0.64, 0.57, 0.74 (0.646 [" in text
    assert "tokens per delta" not in text and stem(report["stream_interval"]) == "vs_vllm"


def test_a_grouped_run_asks_both_sides_alike_and_says_so() -> None:
    args = settings(repeats=1, stream_interval=4)
    report = build_report(args, [a_round(90, 200, 50, 60)], {"code": {}, "vllm_version": "t"}, 1.0)
    assert "ignore_eos, temperature 0, 4 tokens per delta" in markdown(report)
    assert stem(report["stream_interval"]) == "vs_vllm-interval4"  # beside, not over, the default
    assert chat_body("hi", 64, interval=4)["stream_interval"] == 4
    assert "stream_interval" not in chat_body("hi", 64)
