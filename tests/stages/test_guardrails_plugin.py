"""A custom filter through the `tokenwire.guardrails` entry point group: a
real distribution (dist-info with entry_points.txt) on the path, found by
importlib.metadata, in this process and in a `tokenwire serve` subprocess."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from tokenwire.client import connect
from tokenwire.stages.filters import Block, GuardrailError, load_filter

from ..conftest import spawn_server

PLUGIN = '''
class NoWord:
    """Blocks one word, given as the guardrail's ARG; async, like a classifier."""

    name = "noword"
    lookahead = 0

    def __init__(self, word):
        self.word = word

    async def check(self, window, final):
        from tokenwire.stages.filters import ALLOW, Block

        at = window.find(self.word)
        return ALLOW if at < 0 else Block("noword", at)


def make(arg):
    if not arg:
        raise ValueError("noword needs a word")
    return NoWord(arg)
'''


def install_plugin(root: Path) -> Path:
    (root / "tw_noword.py").write_text(PLUGIN)
    dist = root / "tw_noword-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tw-noword\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text("[tokenwire.guardrails]\nnoword = tw_noword:make\n")
    return root


async def test_an_entry_point_filter_loads_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.syspath_prepend(str(install_plugin(tmp_path)))
    f = load_filter("noword:banana")
    assert f.name == "noword"
    assert await f.check("a banana split", True) == Block("noword", 2)  # type: ignore[misc]
    with pytest.raises(GuardrailError, match="needs a word"):
        load_filter("noword")
    with pytest.raises(GuardrailError, match=r"unknown guardrail 'nosuch'.*noword"):
        load_filter("nosuch")


async def test_a_server_runs_an_entry_point_filter(tmp_path: Path) -> None:
    root = install_plugin(tmp_path)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])
    )
    args = (
        "--engine",
        "scripted",
        "--scripted-tokens-per-s",
        "200",
        "--guardrail",
        "noword:banana",
    )
    with spawn_server(*args, env=env, log_path=tmp_path / "server.log") as spawned:
        async with await connect(spawned.url) as tw:
            assert tw.session["guardrails"] == ["noword"]
            response = (
                await tw.create_response()
                if await tw.add_message("one two three banana four five six seven eight")
                else None
            )
            assert response is not None
            done = await asyncio.wait_for(response.done(), 10)
            assert done["status_details"] == {"type": "incomplete", "reason": "content_filter"}
            assert done["output"][0]["content"] == "You said: one two three "
