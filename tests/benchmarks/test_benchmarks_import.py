"""Every benchmark module imports and builds its command line: `make bench`
runs for 20 minutes before reaching the last one, so a broken import must
fail here instead."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from ..conftest import ROOT

MODULES = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__",))


@pytest.mark.parametrize("name", MODULES)
def test_benchmark_module_imports(name: str) -> None:
    importlib.import_module(f"benchmarks.{name}")


@pytest.mark.parametrize("name", [m for m in MODULES if not m.startswith("_")])
def test_benchmark_help(name: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{name}", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert "usage:" in run.stdout
