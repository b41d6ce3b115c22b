"""benchmarks.remote's report, from made-up measurements: a key error there
would only show after a quarter of an hour of measuring."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from benchmarks.remote import LABELS, SIDES, build_report, markdown

LEVELS = [1, 8]
# tokens/s and TTFT p50 of each side, per round: the gateways at 0.9x and 1.1x
# of SSE, with TTFT 10 ms later and 20 ms earlier.
RATES = {"tokenwire": (0.9, 10.0), "vllm": (1.0, 0.0), "tokenwire_x2": (1.1, -20.0)}


def level(side: str, c: int, r: int) -> dict[str, Any]:
    rate, ttft = RATES[side]
    return {
        "tokens_per_s": rate * 10 * c * (1 + r / 10),
        "ttft_p50_ms": 200.0 * c + ttft,
        "ttft_p99_ms": 300.0 * c + ttft,
        "itl_p50_ms": 50.0,
        "itl_p99_ms": 80.0,
        "frontend_us_per_token": 500.0 * rate,
        "other_cores": 0.1,
        "attempts": [{}],
    }


def test_the_report_compares_each_gateway_with_sse() -> None:
    args = argparse.Namespace(
        tokens=64,
        concurrency=LEVELS,
        repeats=3,
        batches=1,
        cancel_trials=4,
        wait_deltas=5,
        quiet_cores=0.15,
        retries=0,
    )
    measured = {
        "startup_s": {side: 1.0 for side in SIDES},
        "prefix_cache": {"hits": 0.0, "queries": 1000.0},
        "rounds": [
            {side: {str(c): level(side, c, r) for c in LEVELS} for side in SIDES} for r in range(3)
        ],
        "cancel": {side: [{"slot_freed_ms": 100.0 + t} for t in range(4)] for side in SIDES},
    }
    meta = {
        "code": {"tokenwire_source": "x", "commit": "abc1234", "uncommitted_server_files": []},
        "vllm_version": "0.32.0",
    }
    report = build_report(args, measured, meta, 60.0)
    q = report["vs_sse"]["tokenwire"]["8"]
    assert q["tokens_per_s"] == pytest.approx(0.9)
    assert q["tokens_per_s_rounds"] == pytest.approx([0.9] * 3)
    assert q["ttft_p50_diff_ms"] == pytest.approx(10.0)
    assert report["vs_sse"]["tokenwire_x2"]["1"]["ttft_p50_diff_ms"] == pytest.approx(-20.0)
    assert report["cancel"]["vllm"]["slot_freed_p50_ms"] == pytest.approx(101.5)
    assert report["cancel"]["vllm"]["slot_freed_p90_ms"] == 103.0

    text = markdown(report)
    for side in SIDES:
        assert f"| 8 | {LABELS[side]} |" in text
    assert "| 1 | **tokenwire remote vs SSE** | **0.900x** | **+10** |" in text
    assert "| 8 | **2 tokenwire + Redis vs SSE** | **1.100x** | **-20** |" in text
