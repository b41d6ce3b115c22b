"""Streaming guardrails (stages/guardrails.py, stages/filters.py): the window,
the built-in filters, async checks with a timeout, and the server wiring (per-key
sets, session.created, raw frames), on the scripted engine."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest
from websockets.asyncio.client import connect as ws_connect

from tokenwire.client import connect
from tokenwire.config import ServerConfig
from tokenwire.core.stages import CONTENT_FILTER, StageContext
from tokenwire.engines.base import EngineDelta, GenerationRequest, ToolCallDelta
from tokenwire.server.admission import KeyStore
from tokenwire.stages.filters import ALLOW, Block, Blocklist, GuardrailError, Pii, Redact, Verdict
from tokenwire.stages.guardrails import (
    GuardrailPolicy,
    GuardrailStage,
    Window,
    build_guardrails,
)

from ..conftest import _scripted_server
from ..helpers.wait import until

CONTEXT = StageContext("anonymous", "sess_1", "resp_1")
REQUEST = GenerationRequest("req_1", [])


class Source:
    """An engine stream of given deltas; remembers whether it was closed."""

    def __init__(self, pieces: Sequence[str], finish: str = "stop") -> None:
        self.deltas = [
            EngineDelta(p, 1, finish if i == len(pieces) - 1 else None, token_ids=[i])
            for i, p in enumerate(pieces)
        ]
        self.closed = False
        self.sent = 0

    async def __call__(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        try:
            for d in self.deltas:
                self.sent += 1
                yield d
        finally:
            self.closed = True


def stage(*filters: object, lookahead: int = 32, closed: bool = True) -> GuardrailStage:
    return GuardrailStage(filters, {}, GuardrailPolicy(0.05, closed), lookahead)  # type: ignore[arg-type]


async def run(s: GuardrailStage, source: Source) -> list[EngineDelta]:
    return [d async for d in s.stream(REQUEST, CONTEXT, source)]


def words(text: str) -> list[str]:
    """The scripted engine's tokens: a word with its leading space."""
    first, *rest = text.split(" ")
    return [first] + [" " + w for w in rest]


def delivered(out: list[EngineDelta]) -> str:
    return "".join(d.text for d in out)


async def test_a_phrase_split_over_deltas_is_blocked_before_any_of_it_leaves() -> None:
    source = Source(["The", " top", " sec", "ret", " plan", " is", " here"])
    out = await run(stage(Blocklist(["top secret"]), lookahead=4), source)
    assert out[-1].finish_reason == CONTENT_FILTER
    assert delivered(out) == "The "  # the text before the phrase, nothing of it
    assert source.closed and source.sent == 5  # the engine stopped right after " plan"


async def test_words_match_whole_and_case_insensitively_regexes_as_written() -> None:
    b = Blocklist(["# a comment", "", "Secret", r"re:\bcode-\d+"])
    assert b.check("no secrets here", final=True) is ALLOW
    assert b.check("a SECRET!", final=True) == b.check("a SECRET!", final=True)
    assert b.check("a SECRET!", final=True).at == 2  # type: ignore[union-attr]
    assert b.check("use code-42 now", final=True).at == 4  # type: ignore[union-attr]
    # At the window's end a word may still grow ("secret" -> "secrets"): not yet.
    assert b.check("the secret", final=False) is ALLOW
    assert b.check("the secret", final=True) != ALLOW
    with pytest.raises(GuardrailError):
        Blocklist(["re:(unclosed"])


async def test_a_catastrophic_regex_times_out_instead_of_stalling() -> None:
    b = Blocklist([r"re:(a|aa)+$"])  # exponential backtracking on a run of a's
    evil = "a" * 40 + "!"
    # regex's timeout raises; the policy then applies (closed: block).
    out = await run(stage(b, lookahead=4), Source(words(evil + " more text here")))
    assert out[-1].finish_reason == CONTENT_FILTER


async def test_a_regex_longer_than_the_lookahead_is_held_until_decided() -> None:
    """A regex entry has no length for a lookahead: its start, partial or
    undecided at the window's end, is held, so none of a match leaves."""
    key = "BEGIN OPENSSH PRIVATE KEY b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQ"
    pieces = words(f"Here it is: {key} and more text follows here")
    b = Blocklist([r"re:BEGIN OPENSSH PRIVATE KEY \S+"])
    source = Source(pieces)
    out = await run(stage(b, lookahead=4), source)
    assert out[-1].finish_reason == CONTENT_FILTER
    assert delivered(out) == "Here it is: "
    assert source.sent < len(pieces)  # stopped as soon as it was decided
    # Without a match the same stream goes through whole, and streams.
    out = await run(stage(b, lookahead=4), Source(words("Here it is: BEGIN nothing else to see")))
    assert delivered(out) == "Here it is: BEGIN nothing else to see"
    assert len(out) > 2


@pytest.mark.parametrize(
    ("sent", "pieces", "expect"),
    [
        # A phrase split by a pause: its first word went out before it.
        ("Call it top", [" secret", " plans", " are", " here", " now"], ""),
        # A phone number split by a pause: its start is out, the rest is held back.
        ("Call 555", [" 123", " 4567", " today", " ok"], ""),
        # Nothing to find: the resumed text goes out as it comes.
        ("Call it top", [" sunny", " days", " are", " here", " now"], " sunny days are here now"),
    ],
)
async def test_a_resumed_generation_is_checked_with_the_text_already_sent(
    sent: str, pieces: list[str], expect: str
) -> None:
    source = Source(pieces)
    request = GenerationRequest("req_2", [], resume_token_ids=(1, 2), resumed_text=sent)
    s = stage(Blocklist(["top secret"]), Pii(), lookahead=8)
    out = [d async for d in s.stream(request, CONTEXT, source)]
    assert delivered(out) == expect
    assert out[-1].finish_reason == (CONTENT_FILTER if not expect else "stop")


async def test_the_sent_text_is_checked_only_next_to_the_held_text() -> None:
    """Once part of a resumed generation is released, what is held no longer
    follows the sent text: filters see it on its own, as in any window (else
    "was top" + a later " secret" would look like a phrase)."""
    seen: list[str] = []

    class Recorder:
        name, lookahead = "recorder", 0

        def check(self, window: str, final: bool) -> Verdict:
            seen.append(window)
            return ALLOW

    pieces = words("sunny days are here and then secret plans follow")
    request = GenerationRequest("req_3", [], resume_token_ids=(1,), resumed_text="was top")
    s = stage(Recorder(), Blocklist(["top secret"]), lookahead=8)
    out = [d async for d in s.stream(request, CONTEXT, Source(pieces))]
    assert delivered(out) == "".join(pieces) and out[-1].finish_reason == "stop"
    assert seen[0].startswith("was top")
    first_without = next(i for i, w in enumerate(seen) if not w.startswith("was top"))
    assert all(not w.startswith("was top") for w in seen[first_without:])


async def test_pii_is_redacted_across_deltas_and_usage_stays_whole() -> None:
    pieces = ["Mail", " bob", ".smith@", "exam", "ple.com", " or", " call", " +1", " 555",
              " 123", " 4567", " today", " please", " ok"]  # fmt: skip
    source = Source(pieces)
    out = await run(stage(Pii()), source)
    assert delivered(out) == "Mail [email] or call [phone] today please ok"
    assert sum(d.output_tokens for d in out) == len(pieces)
    assert [i for d in out for i in d.token_ids or []] == list(range(len(pieces)))
    assert out[-1].finish_reason == "stop"


async def test_releases_are_whole_deltas_cut_between_words() -> None:
    pieces = words("one two three four five six seven eight nine ten eleven twelve")
    out = await run(stage(Blocklist(["zebra"]), lookahead=10), Source(pieces))
    assert delivered(out) == "".join(pieces)
    for d in out:  # each released delta is exactly the text of its tokens
        assert d.text == "".join(pieces[i] for i in d.token_ids or [])
        assert d.output_tokens == len(d.token_ids or [])
    assert len(out) > 2  # it streamed, holding back only the window


async def test_text_without_spaces_streams_too() -> None:
    """Chinese, Japanese or Thai has no space between words: it is cut between
    two of its characters, not held to the end (and rescanned at each delta)."""
    text = "这是一个很长的回答，我们一个字一个字地生成它，看看它是否在结束之前就流出来了。"
    pieces = list(text)
    out = await run(stage(Blocklist(["re:秘密"]), lookahead=10), Source(pieces))
    assert delivered(out) == text
    assert len(out) > 10  # it streamed, holding back only the window
    for d in out[:-1]:
        assert d.finish_reason is None
    # A blocked phrase is still caught before any of it leaves.
    blocked = await run(
        stage(Blocklist(["re:秘密"]), lookahead=10), Source(list("这是秘密文件内容"))
    )
    assert "秘" not in delivered(blocked)
    assert blocked[-1].finish_reason == CONTENT_FILTER
    # Latin text next to such a script is still cut only between words.
    mixed = list("中文abc中文") + list("defghijklmnopqrstuvwxyz")
    out = await run(stage(Blocklist(["zebra"]), lookahead=5), Source(mixed))
    released_ends = [len(delivered(out[: i + 1])) for i in range(len(out) - 1)]
    # Only between two of the ideographs: never next to or inside "abc" or the rest.
    assert released_ends and set(released_ends) <= {1, 6}


async def test_tool_calls_pass_after_the_checked_text() -> None:
    call = ToolCallDelta(0, "lookup", "{}")
    source = Source(["Let", " me", " check"], finish="stop")
    source.deltas[-1].tool_calls = [call]
    out = await run(stage(Blocklist(["zebra"])), source)
    assert delivered(out) == "Let me check"
    assert out[-1].tool_calls == [call] and out[-1].finish_reason == "stop"


class SlowClassifier:
    """An async filter that answers too late."""

    name = "classifier"
    lookahead = 0

    async def check(self, window: str, final: bool) -> Verdict:
        await asyncio.sleep(1)
        return ALLOW


@pytest.mark.parametrize("closed", [True, False])
async def test_an_async_filter_that_times_out_fails_open_or_closed(closed: bool) -> None:
    source = Source(words("hello there my friend"))
    out = await run(stage(SlowClassifier(), closed=closed, lookahead=4), source)
    if closed:
        assert out[-1].finish_reason == CONTENT_FILTER and delivered(out) == ""
        assert source.closed
    else:
        assert delivered(out) == "hello there my friend" and out[-1].finish_reason == "stop"


def test_build_guardrails_checks_sets_and_keys(tmp_path: Path) -> None:
    words_file = tmp_path / "words.txt"
    words_file.write_text("secret\n")
    keys = KeyStore(["a guardrails=strict", "b guardrails=none", "c"])
    config = ServerConfig(guardrail=("pii",), guardrail_set=(f"strict=blocklist:{words_file}",
                                                            "strict=pii"))  # fmt: skip
    built = build_guardrails(config, keys)
    assert built is not None
    from tokenwire.server.admission import key_id

    assert built.session_info(key_id("a")) == {"guardrails": ["blocklist", "pii"]}
    assert built.session_info(key_id("b")) == {"guardrails": []}
    assert built.session_info(key_id("c")) == {"guardrails": ["pii"]}
    assert build_guardrails(ServerConfig(), None) is None  # nothing configured: no stage
    with pytest.raises(GuardrailError, match="no --guardrail-set defines"):
        build_guardrails(ServerConfig(guardrail=("pii",)), KeyStore(["a guardrails=lax"]))
    with pytest.raises(GuardrailError, match="unknown guardrail"):
        build_guardrails(ServerConfig(guardrail=("nosuchfilter",)), None)
    with pytest.raises(GuardrailError, match="blocklist"):
        build_guardrails(ServerConfig(guardrail=(f"blocklist:{tmp_path / 'missing'}",)), None)


async def test_the_server_redacts_blocks_and_tells_each_key_its_filters(tmp_path: Path) -> None:
    words_file = tmp_path / "words.txt"
    words_file.write_text("launch codes\n")
    config = ServerConfig(
        engine="scripted",
        port=0,
        scripted_tokens_per_s=1000.0,
        api_keys="plain-key,strict-key guardrails=strict,free-key guardrails=none",
        guardrail=("pii",),
        guardrail_set=(f"strict=blocklist:{words_file}", "strict=pii"),
    )
    async with _scripted_server(config) as running:
        async with await connect(running.url, api_key="plain-key") as tw:
            assert tw.session["guardrails"] == ["pii"]
            # The scripted engine says it back one word a token: the address is split.
            answer = await tw.ask("write to ann.lee@example.org or 555-123-4567 today")
            assert answer == "You said: write to [email] or [phone] today"
        async with await connect(running.url, api_key="free-key") as tw:
            assert tw.session["guardrails"] == []
            assert "ann@example.org" in await tw.ask("ann@example.org")
        # Raw frames, not the client's parsed text: nothing blocked was ever sent.
        headers = {"Authorization": "Bearer strict-key"}
        async with ws_connect(
            running.url, subprotocols=["tokenwire.v1.json"], additional_headers=headers
        ) as ws:
            frames = [await ws.recv()]
            assert json.loads(frames[0])["session"]["guardrails"] == ["blocklist", "pii"]
            for event in (
                {"type": "conversation.item.create", "item": {"type": "message", "role": "user",
                 "content": "the launch codes are 1234 and more words follow here"}},
                {"type": "response.create"},
            ):  # fmt: skip
                await ws.send(json.dumps(event))
            while '"response.done"' not in frames[-1]:
                frames.append(await asyncio.wait_for(ws.recv(), 10))
        done = json.loads(frames[-1])["response"]
        assert done["status_details"] == {"type": "incomplete", "reason": CONTENT_FILTER}
        assert done["output"][0]["content"] == "You said: the "
        # (The user's own item echoes the words: only what the model said counts.)
        said = [f for f in frames if json.loads(f)["type"].startswith("response.")]
        assert said and not any("launch" in str(f) or "codes" in str(f) for f in said)
        await until(lambda: running.server.engine.load().running == 0, "the engine freed")


@pytest.mark.parametrize(
    "text",
    [
        "You said: İİİİİİİİİİ secret",  # the block was placed past the text: the loop never ended
        "You said: İİİİİ secret",  # "secre" leaked before the block
        "You said:" + " İ" * 40 + " secret",  # the match looked unfinished and was released
    ],
)
async def test_letters_that_lower_to_two_characters_move_no_match(text: str) -> None:
    """`"İ".lower()` is two characters: positions come from the text as it is."""
    source = Source(words(text))
    out = await asyncio.wait_for(run(stage(Blocklist(["secret"]), lookahead=4), source), 5)
    assert out[-1].finish_reason == CONTENT_FILTER
    assert "secre" not in delivered(out) and "ecret" not in delivered(out)
    assert delivered(out) == text[: text.index(" secret")] + " "


async def test_a_phrase_spread_over_whitespace_is_blocked_whole() -> None:
    """Any whitespace between a phrase's words matches: the window holds a
    run of it as one character, so "top" is not released before "secret"."""
    source = Source(["The", " top", *["\n"] * 40, " secret", " plan", " is", " here"])
    out = await run(stage(Blocklist(["top secret"]), lookahead=4), source)
    assert out[-1].finish_reason == CONTENT_FILTER
    assert delivered(out) == "The "
    regex_like = Source(["The", " top", *["\n"] * 40, "-secret", " plan"])
    out = await run(stage(Blocklist(["top -secret"]), lookahead=4), regex_like)
    assert out[-1].finish_reason == CONTENT_FILTER and "top" not in delivered(out)


async def test_the_stage_leaves_the_engines_deltas_as_they_were() -> None:
    """Deltas may be shared (the response cache's flight keeps them for the
    requests that follow it): the guardrail changes copies only."""
    call = ToolCallDelta(0, "lookup", "{}")
    source = Source(["Let", " me", " check"], finish="stop")
    source.deltas[-1].tool_calls = [call]
    before = [(d.text, d.finish_reason, d.tool_calls) for d in source.deltas]
    out = await run(stage(Pii(), Blocklist(["zebra"])), source)
    assert out[-1].tool_calls == [call]
    assert [(d.text, d.finish_reason, d.tool_calls) for d in source.deltas] == before


async def test_behind_the_guardrail_the_cache_stores_and_followers_get_the_calls() -> None:
    """The guardrail ends its stream at the finish: the cache inside it stores
    the answer all the same, and a twin request in flight gets the same
    deltas, tool calls included."""
    from tokenwire.stages.cache import ResponseCache
    from tokenwire.stages.cache_store import MemoryStore

    call = ToolCallDelta(0, "lookup", "{}")

    class Slow(Source):  # a step between deltas: the twin arrives mid-flight
        async def __call__(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
            async for d in super().__call__(request):
                await asyncio.sleep(0.01)
                yield d

    def engine() -> Source:
        made = Slow(["Let", " me", " check"], finish="stop")
        made.deltas[-1].tool_calls = [call]
        return made

    store = MemoryStore(1 << 20, 60)
    cache = ResponseCache(store, "m")
    guard = stage(Blocklist(["zebra"]))

    async def ask(response_id: str, source: Source) -> list[EngineDelta]:
        context = StageContext("anonymous", "sess_1", response_id)
        messages = [{"role": "user", "content": response_id}]
        request = GenerationRequest(f"{response_id}-1", messages, temperature=0.0)
        inner = lambda r: cache.stream(r, context, source)  # noqa: E731
        return [d async for d in guard.stream(request, context, inner)]

    twin_engine = engine()
    leader, twin = await asyncio.gather(ask("resp_1", engine()), ask("resp_1", twin_engine))
    assert twin_engine.sent == 0  # it followed the leader's flight
    for out in (leader, twin):
        assert delivered(out) == "Let me check"
        assert out[-1].tool_calls == [call] and out[-1].finish_reason == "stop"
    # Answers with calls are not stored; a text answer is, behind the guardrail.
    assert delivered(await ask("resp_2", Source(["Plain", " text"]))) == "Plain text"
    await until(lambda: not cache.flights, "the entry written")
    assert len(store.entries) == 1


async def test_one_blocked_generation_is_one_block_in_the_metrics() -> None:
    """The blocklist checks phrases before regexes, so its block may not be
    the leftmost; the text before it is checked again, and a second block
    there is the same generation's: counted once."""
    from prometheus_client import REGISTRY

    def blocks() -> float:
        return (
            REGISTRY.get_sample_value("tokenwire_guardrail_blocks_total", {"filter": "blocklist"})
            or 0.0
        )

    before = blocks()
    source = Source(["call 555-1234 about the secret plan"])
    out = await run(stage(Blocklist(["secret", r"re:\d{3}-\d{4}"])), source)
    assert out[-1].finish_reason == CONTENT_FILTER
    assert delivered(out) == "call "
    assert blocks() == before + 1


class Recorder:
    """A filter that lets everything through and remembers each window."""

    name, lookahead = "recorder", 0

    def __init__(self) -> None:
        self.seen: list[str] = []

    def check(self, window: str, final: bool) -> Verdict:
        self.seen.append(window)
        return ALLOW


async def test_text_with_nowhere_to_cut_streams_and_the_window_stays_bounded() -> None:
    """A run with no space ("-----", base64) was held to the end, and every
    token rescanned all of it: memory and CPU grew with the generation."""
    recorder = Recorder()
    pieces = ["-=" * 8] * 500 + [" done"]  # 8,000 characters, no space
    out = await run(stage(recorder, Blocklist(["zebra"]), Pii()), Source(pieces))
    assert delivered(out) == "".join(pieces)
    assert len(out) > 5 and out[-1].finish_reason == "stop"
    bound = Window(32).max_chars
    assert max(len(w) for w in recorder.seen) <= bound + 16 + 32
    # Released at the boundary nearest the bound, whole tokens as ever.
    for d in out:
        assert d.output_tokens == len(d.token_ids or [])


async def test_a_match_across_a_forced_cut_is_still_seen() -> None:
    """A cut inside a long word keeps the end of what left next to the held
    text: an address split by it cannot leave half redacted."""
    pieces = ["a" * 50] * 30 + ["@example", ".com", " is", " mine"]
    out = await run(stage(Pii()), Source(pieces))
    assert out[-1].finish_reason == CONTENT_FILTER
    assert "@" not in delivered(out) and "example" not in delivered(out)
    assert delivered(out)  # what went before the address had streamed


@pytest.mark.parametrize("closed", [True, False])
async def test_a_regex_undecided_past_the_bound_follows_the_timeout_policy(closed: bool) -> None:
    """A `re:` match that stays open (`\\S+` over a long blob) would hold the
    window without end: past its bound it is a check that cannot decide."""
    from prometheus_client import REGISTRY

    labels = {"filter": "blocklist", "kind": "undecided"}
    before = REGISTRY.get_sample_value("tokenwire_guardrail_failures_total", labels) or 0.0
    blob = ["QUJD" * 10] * 40  # 1,600 characters that a match of `BEGIN \S+` takes in
    pieces = ["Here", " it", " is:", " BEGIN", " ", *blob, " and", " more", " text"]
    source = Source(pieces)
    out = await run(stage(Blocklist([r"re:BEGIN \S+END"]), closed=closed), source)
    after = REGISTRY.get_sample_value("tokenwire_guardrail_failures_total", labels)
    assert after == before + 1
    if closed:
        assert out[-1].finish_reason == CONTENT_FILTER
        assert delivered(out) == "Here it is: "
        assert source.sent < len(pieces)
    else:
        assert delivered(out) == "".join(pieces) and out[-1].finish_reason == "stop"
        assert len(out) > 3  # the blob streamed, not held to the end


def test_blocklist_words_in_scripts_without_spaces_match_inside_running_text() -> None:
    b = Blocklist(["机密", "ลับมาก", "secret"])
    found = b.check("这是机密文件的内容", final=True)
    assert isinstance(found, Block) and found.at == 2
    found = b.check("นี่คือเอกสารลับมากนะ", final=True)
    assert isinstance(found, Block) and found.at == 12
    assert b.check("这是公开文件", final=True) is ALLOW
    assert b.check("no secrets here", final=True) is ALLOW  # Latin words stay whole


def test_pii_finds_numbers_and_addresses_next_to_other_scripts() -> None:
    assert Pii().check("电话555 123 4567。", final=True) == Redact("电话[phone]。")
    assert Pii().check("邮箱bob@example.com。", final=True) == Redact("邮箱[email]。")
    # Still not inside an ASCII word or number.
    assert Pii().check("x555 123 4567 and 1555 123 4567", final=True) is ALLOW
