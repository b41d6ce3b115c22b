"""benchmarks.vs_commit's report from made-up rounds: per level, each side's
median and the rounds' paired ratios this/base."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from benchmarks.vs_commit import build_report, markdown


def side(cpu_us: float, tokens_per_s: float) -> dict[str, Any]:
    return {"8": {"frontend_us_per_token": cpu_us, "tokens_per_s": tokens_per_s}}


def test_ratios_pair_each_rounds_two_servers() -> None:
    args = argparse.Namespace(tokens=64, concurrency=[8], repeats=3, batches=2)
    # The machine's speed drifts between rounds; within a round, "this" is 10% cheaper.
    rounds = [
        {"this": side(90, 200), "base": side(100, 200)},
        {"this": side(180, 210), "base": side(200, 200)},
        {"this": side(45, 190), "base": side(50, 200)},
    ]
    meta = {"code": {"commit": "abc1234", "uncommitted_server_files": []}, "base": "def5678"}
    report = build_report(args, rounds, meta, 1.0)
    cpu = report["levels"]["8"]["frontend_us_per_token"]
    assert (cpu["this"], cpu["base"]) == (90, 100)
    assert cpu["ratios"] == pytest.approx([0.9, 0.9, 0.9])
    assert report["levels"]["8"]["tokens_per_s"]["ratios"] == pytest.approx([1.0, 1.05, 0.95])
    text = markdown(report)
    assert "against commit def5678" in text
    assert "| 8 | 90.0 | 100.0 | 0.900 [0.900, 0.900], below 1x | 200.0 | 200.0 | 0.999 [" in text
