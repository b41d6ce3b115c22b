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
# Frontend CPU per process, the API server last: 450 = 270 + 180 for the lone
# gateway, 550 = 2 x 200 + redis 50 + 100 for the pair.
EACH = {"tokenwire": [270.0, 180.0], "vllm": [500.0], "tokenwire_x2": [200.0, 200.0, 50.0, 100.0]}


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


def run_report(split: bool) -> dict[str, Any]:
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
    if split:
        for rd in measured["rounds"]:
            for side in SIDES:
                for c in LEVELS:
                    rd[side][str(c)]["frontend_us_per_token_each"] = EACH[side]
    return build_report(args, measured, meta, 60.0)


def test_the_report_compares_each_gateway_with_sse() -> None:
    report = run_report(split=False)
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


def test_the_gateways_own_cpu_is_split_from_vllms_server_behind_it() -> None:
    report = run_report(split=True)
    q = report["vs_sse"]["tokenwire"]["8"]
    assert q["gateway_us_per_token"] == 270.0 and q["api_behind_us_per_token"] == 180.0
    assert q["gateway_vs_api_rounds"] == pytest.approx([0.54] * 3)
    pair = report["vs_sse"]["tokenwire_x2"]["1"]
    assert pair["gateway_us_per_token"] == 450.0  # both instances and redis
    text = markdown(report)
    assert "| 8 | tokenwire remote | 270 | 180 | 500 | 0.540 [" in text
    assert "| 1 | 2 tokenwire + Redis | 450 | 100 | 500 | 0.900 [" in text
    assert "gateway / vLLM API server (SSE)" not in markdown(run_report(split=False))
