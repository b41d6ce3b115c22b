"""The docs name what clients and operators meet: every error code, event,
metric and `serve` flag the code has is in docs/protocol.md or the README, so
an addition without its documentation fails here."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from prometheus_client.metrics import MetricWrapperBase

from tokenwire import metrics
from tokenwire.cli import build_parser
from tokenwire.core import events
from tokenwire.core.errors import ErrorCode

ROOT = Path(__file__).resolve().parent.parent
PROTOCOL = (ROOT / "docs" / "protocol.md").read_text()
README = (ROOT / "README.md").read_text()


def test_every_error_code_is_in_the_protocol() -> None:
    missing = [c.value for c in ErrorCode if f"`{c.value}`" not in PROTOCOL]
    assert not missing


def test_every_event_type_is_in_the_protocol() -> None:
    names = [v for k, v in vars(events).items() if k.isupper() and isinstance(v, str)]
    assert len(names) > 20
    assert not [n for n in names if f"`{n}`" not in PROTOCOL]


def test_every_metric_is_in_the_protocol() -> None:
    names = [m._name for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)]
    assert len(names) > 15
    # Counters are exposed with `_total`, which prometheus_client strips from _name.
    documented = set(re.findall(r"`(tokenwire_[a-z_]+)", PROTOCOL))
    missing = [n for n in names if n not in documented and f"{n}_total" not in documented]
    assert not missing


def test_every_serve_flag_is_in_the_readme() -> None:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = [
        opt
        for action in sub.choices["serve"]._actions
        for opt in action.option_strings
        if opt.startswith("--") and opt != "--help"
    ]
    # BooleanOptionalAction's `--no-x` is documented with its `--x`.
    flags = [f for f in flags if not (f.startswith("--no-") and f"--{f[5:]}" in flags)]
    assert len(flags) > 40
    assert not [f for f in flags if f"`{f}" not in README]
