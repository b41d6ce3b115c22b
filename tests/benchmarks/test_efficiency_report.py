"""benchmarks.efficiency's target table, from made-up results: each target
is read from the right field and judged in the right direction."""

from __future__ import annotations

from typing import Any

from benchmarks.efficiency import table


def results(kib_idle: float, returned: float, ceiling_1k: float, cpu_8: float) -> dict[str, Any]:
    rounds = [
        {
            "kib_per_connection_connected": kib_idle,
            "kib_per_connection_streaming": 27.0,
            "rss_closed_kib": 300_000,
            "rss_returned_kib": returned,
        }
    ]
    return {
        "connections": {
            "machine": {"commit": "abc1234", "cpu": "Test CPU"},
            "rss_idle_kib": 60_000,
            "rounds": rounds,
        },
        "gateway_ceiling": {
            "machine": {"commit": "abc1234"},
            "ratios": [
                {"mode": "max", "sessions": n, "tokens_per_s": r}
                for n, r in ((100, 0.95), (1000, ceiling_1k), (10_000, 1.02))
            ]
            + [{"mode": "paced", "sessions": 1000, "tokens_per_s": 0.1}],
        },
        "vs_vllm": {
            "code": {"commit": "abc1234"},
            "ratios": {
                "8": {"frontend_us_per_token": cpu_8, "frontend_above_floor": 0.45},
                "32": {"frontend_us_per_token": 0.4, "frontend_above_floor": 0.6},
            },
        },
    }


def row(text: str, start: str) -> list[str]:
    [line] = [line for line in text.splitlines() if line.startswith(f"| {start}")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_each_target_is_judged_in_its_direction() -> None:
    text = table(results(15.0, 66_000, 0.88, 0.77), results(55.0, 700_000, 0.53, 0.77))
    assert row(text, "RSS per connected idle")[2:] == ["15.00 KiB", "yes", "55.00 KiB"]
    assert row(text, "RSS after a wave")[2:] == ["1.10 x", "yes", "11.67 x"]
    # 'at least' for the ceiling: the paced row is not the max one
    judged = {
        "gateway ceiling, tokenwire / bare websockets, 1,000": ["0.88 x", "**no**"],
        "gateway ceiling, tokenwire / bare websockets, 10,000": ["1.02 x", "yes"],
        "frontend CPU per output token, tokenwire / vLLM, c=8": ["0.77 x", "**no**"],
        "frontend CPU per output token, tokenwire / vLLM, c=32": ["0.40 x", "yes"],
        "the same above the floor (each server's own work), c=8": ["0.45 x", "yes"],
        "the same above the floor (each server's own work), c=32": ["0.60 x", "**no**"],
    }
    for start, expected in judged.items():
        assert row(text, start)[2:4] == expected, start
    assert "measured at abc1234, Test CPU" in text


def test_frontend_cpu_is_paired_per_round_where_the_report_has_rounds() -> None:
    after = results(15.0, 66_000, 0.95, 0.77)
    # Medians' ratio 0.77; the rounds' own ratios have geometric mean 0.60.
    after["vs_vllm"]["ratios"]["8"]["frontend_us_per_token_rounds"] = [0.5, 0.72]
    text = table(after, results(55.0, 700_000, 0.53, 0.9))
    assert row(text, "frontend CPU per output token, tokenwire / vLLM, c=8")[2:] == [
        "0.60 x",
        "**no**",
        "0.90 x",  # a report without rounds: the medians' ratio
    ]


def test_the_grouped_run_has_rows_of_its_own() -> None:
    after = results(15.0, 66_000, 0.95, 0.77)
    after["vs_vllm-interval4"] = {
        "code": {"commit": "def5678"},
        "ratios": {"8": {"frontend_us_per_token": 0.48}, "32": {"frontend_us_per_token": 0.55}},
    }
    text = table(after, {})
    grouped = "the same, both servers at 4 tokens per delta (`stream_interval`)"
    assert row(text, f"{grouped}, c=8")[2:4] == ["0.48 x", "yes"]
    assert row(text, f"{grouped}, c=32")[2:4] == ["0.55 x", "**no**"]
    assert row(text, "frontend CPU per output token, tokenwire / vLLM, c=8")[2] == "0.77 x"
    assert "`benchmarks.vs_vllm --stream-interval 4`: measured at def5678" in text


def test_a_benchmark_that_has_not_run_shows_a_dash() -> None:
    after = results(15.0, 66_000, 0.95, 0.4)
    del after["vs_vllm"]
    text = table(after, {})
    assert row(text, "frontend CPU per output token, tokenwire / vLLM, c=8")[2:] == [
        "- x",
        "-",
        "- x",
    ]
    assert "`benchmarks.vs_vllm`: measured at not run" in text


def test_each_allocator_has_its_row_and_the_note_names_it() -> None:
    after = results(15.0, 66_000, 0.95, 0.4)
    after["connections"]["allocator"] = "mimalloc"
    for allocator, returned in (("pymalloc", 84_000), ("malloc", 70_000)):
        after[f"connections-{allocator}"] = {
            **results(15.0, returned, 0.95, 0.4)["connections"],
            "allocator": allocator,
        }
    after["gateway_ceiling-pymalloc"] = {
        "machine": {"commit": "abc1234"},
        "allocator": "pymalloc",
        "ratios": [
            {"mode": "max", "sessions": n, "tokens_per_s": r}
            for n, r in ((100, 1.2), (1000, 0.85), (10_000, 1.05))
        ],
    }
    text = table(after, {})
    assert row(text, "the same, server on pymalloc")[2:4] == ["1.40 x", "**no**"]
    assert row(text, "the same, 1,000 sessions, server on pymalloc")[2:4] == ["0.85 x", "**no**"]
    assert row(text, "the same, 10,000 sessions, server on pymalloc")[2:4] == ["1.05 x", "yes"]
    assert (
        "`benchmarks.gateway_ceiling --allocator pymalloc`: measured at abc1234, allocator" in text
    )
    assert row(text, "the same, server on glibc malloc")[2:4] == ["1.17 x", "**no**"]
    assert "`benchmarks.connections`: measured at abc1234, Test CPU, allocator mimalloc" in text
    assert "`benchmarks.connections --allocator pymalloc`: measured at" in text
