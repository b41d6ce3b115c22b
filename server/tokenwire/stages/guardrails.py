"""Streaming guardrails: a stage that holds back the newest text until every
filter has cleared it (stages/filters.py has the filters).

The window. Deltas are held, whole, until at least `lookahead` characters
follow them and the release point falls between two words; so a phrase split
over deltas is still seen whole, and nothing a filter will block has been
sent. Whole deltas keep text, `output_tokens` and `token_ids` together: a
paused generation resumes after exactly the tokens whose text was delivered.
A redaction merges the held deltas into one (its text rewritten). At the
generation's end (a finish reason) everything held is checked as final and
released. Tool-call deltas are not checked: the text before one is checked
as final and released, then the call passes through.

The window is bounded (`Window.max_chars`), or it and every check of it
would grow with the generation. Text with no place to cut (a long run with
no space) is released at a delta boundary anyway once the window passes the
bound, and the end of what left is checked with the held text after it, as
after a pause. A filter's `Hold` longer than `Window.max_held` is a check
that cannot decide: `--guardrail-on-timeout` says what it does.

A block closes the engine's stream at once (the request is cancelled) and
ends the generation with `content_filter`; if the filter said where the
blocked text starts, the text before it is checked again and delivered.

Policy is the server's: `--guardrail` is the set every tenant gets, and an
API key's `guardrails=NAME` picks `--guardrail-set NAME=SPEC` instead.
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import replace
from typing import Any, Protocol

from .. import metrics
from ..config import ServerConfig
from ..core.stages import CONTENT_FILTER, Source, StageContext
from ..engines.base import EngineDelta, GenerationRequest
from ..logs import get_logger
from .filters import (
    ALLOW,
    UNSPACED,
    Block,
    Filter,
    GuardrailError,
    Hold,
    Redact,
    Verdict,
    load_filter,
)

log = get_logger("tokenwire.guardrails")

NO_GUARDRAILS = "none"  # `guardrails=none` on a key: the operator exempts it


class GuardrailPolicy:
    """How filters run: the timeout of an async check, and what its failure means."""

    def __init__(self, timeout_s: float, fail_closed: bool) -> None:
        self.timeout_s = timeout_s
        self.fail_closed = fail_closed

    async def run(
        self,
        filters: Sequence[Filter],
        window: str,
        final: bool,
        count: bool = True,
        max_held: int | None = None,
    ) -> tuple[str, Block | None, int]:
        """The window after every filter's redactions, the first block, and
        how many of its last characters a filter holds (`Hold`). `count`:
        off for a re-check of text whose block was counted already. A hold
        longer than `max_held` is a check that cannot decide: the policy's."""
        text, held = window, 0
        for f in filters:
            try:
                verdict = f.check(text, final)
                if inspect.isawaitable(verdict):
                    verdict = await asyncio.wait_for(verdict, self.timeout_s)
            except TimeoutError as exc:
                verdict = self._failed(f, "timeout", type(exc).__name__)
            except Exception as exc:  # a classifier that is down: the same policy
                verdict = self._failed(f, "error", type(exc).__name__)
            if isinstance(verdict, Hold) and max_held is not None:
                if len(text) - verdict.at > max_held:
                    verdict = self._failed(f, "undecided", f"over {max_held}", verdict.at)
            if isinstance(verdict, Block):
                if count:
                    metrics.GUARDRAIL_BLOCKS.labels(f.name).inc()
                return text, verdict, held
            if isinstance(verdict, Hold):
                # Counted from the end: a later filter's redaction before it keeps it.
                held = max(held, len(text) - verdict.at)
            elif isinstance(verdict, Redact):
                if count:
                    metrics.GUARDRAIL_REDACTIONS.labels(f.name).inc()
                text = verdict.text
        return text, None, held

    def _failed(self, f: Filter, kind: str, error: str, at: int | None = None) -> Verdict:
        metrics.GUARDRAIL_FAILURES.labels(f.name, kind).inc()
        log.warning("guardrail_failed", filter=f.name, kind=kind, error=error)
        return Block(f"{f.name}: {kind}", at) if self.fail_closed else ALLOW


def _merge(held: list[EngineDelta], text: str, finish: str | None = None) -> EngineDelta:
    """One delta for several held ones: their tokens and usage, this text."""
    first = held[0]
    if len(held) == 1:
        if first.text == text and first.finish_reason == finish:
            return first  # unchanged: no copy per released token
        # A copy: the engine's delta may be shared (the response cache's flight).
        return replace(first, text=text, finish_reason=finish)
    ids: list[int] | None = None
    prompt = cached = wait = None
    for d in held:
        if d.token_ids:
            ids = (ids or []) + d.token_ids
        if d.prompt_tokens is not None:  # consumers add up wherever it is set
            prompt = (prompt or 0) + d.prompt_tokens
            cached = (cached or 0) + (d.cached_tokens or 0)
        if d.queue_wait_s is not None:
            wait = (wait or 0.0) + d.queue_wait_s
    return EngineDelta(
        text,
        sum(d.output_tokens for d in held),
        finish,
        prompt_tokens=prompt,
        cached_tokens=cached,
        token_ids=ids,
        queue_wait_s=wait,
        cached_response=any(d.cached_response for d in held),
    )


_WHITESPACE_RUN = re.compile(r"\s{2,}")
# At least this many characters may be held; more if the lookahead is longer.
WINDOW_MAX_CHARS = 1024


def _cuttable(text: str, at: int) -> bool:
    """Between two words: next to whitespace, or between two characters of a
    script written without spaces."""
    before, after = text[at - 1], text[at]
    if before.isspace() or after.isspace():
        return True
    return bool(UNSPACED.match(before) and UNSPACED.match(after))


def _inside_word(text: str, at: int) -> bool:
    return text[at - 1].isalnum() and text[at].isalnum()


def _held_from(text: str, n: int) -> int:
    """Where the last `n` characters of `text` start, a run of whitespace
    counting as one; 0 if it has fewer."""
    i = len(text)
    while n > 0 and i > 0:
        i -= 1
        while text[i].isspace() and i > 0 and text[i - 1].isspace():
            i -= 1
        n -= 1
    return i if n == 0 else 0


class Window:
    """The held deltas of one generation and where they may be cut.

    `sent`: the end of the text the client already has that filters must see
    with the held text (a resumed generation's, or what a forced cut let go)."""

    def __init__(self, lookahead: int, sent: str = "") -> None:
        self.lookahead = lookahead
        self.max_chars = max(WINDOW_MAX_CHARS, 4 * lookahead)
        self.max_held = self.max_chars // 2
        self.held: list[EngineDelta] = []
        self.text = ""
        self.sent = sent
        self._rescan()

    def _rescan(self) -> None:
        # How many held deltas end at a boundary known to be no cut, their
        # characters, and the last of them that ends outside a word.
        self._scanned = self._scanned_end = self._outside = 0

    def add(self, delta: EngineDelta) -> None:
        self.held.append(delta)
        self.text += delta.text

    def rewrite(self, text: str) -> None:
        """A redaction: the held deltas become one, with the new text."""
        if text != self.text:
            self.held = [_merge(self.held, text)]
            self.text = text
            self._rescan()

    def releasable(self, held: int = 0) -> EngineDelta | None:
        """The longest run of whole deltas that leaves `lookahead` characters
        (and the last `held`, which a filter holds) and ends between two
        words (`_cuttable`); None if there is none. A run of whitespace counts as one
        character: filters match phrases across any whitespace ("top   secret").
        Past `max_chars`, any delta boundary that leaves those, outside a
        word if it can (a hold is at most `max_held`)."""
        text, limit = self.text, len(self.text) - self.lookahead
        if _WHITESPACE_RUN.search(text, max(limit, 0)):
            limit = _held_from(text, self.lookahead)
        limit = min(limit, len(text) - held, len(text) - 1)
        # Boundaries scanned before are no cut (else they were released):
        # each is looked at once, not once per delta.
        i, end, cut = self._scanned, self._scanned_end, 0
        while i < len(self.held) and end + len(self.held[i].text) <= limit:
            end += len(self.held[i].text)
            i += 1
            if _cuttable(text, end):
                cut = i
            elif not cut and end and not _inside_word(text, end):
                self._outside = i
        if not cut:
            self._scanned, self._scanned_end = i, end
            if len(text) > self.max_chars:
                cut = self._outside or i
        if not cut:
            return None
        out = self.held[:cut]
        size = sum(len(d.text) for d in out)
        released = _merge(out, text[:size])
        del self.held[:cut]
        self.text = text[size:]
        self._rescan()
        # Cut between words, what follows is checked on its own; else a
        # match across the cut must still be seen.
        self.sent = "" if _cuttable(text, size) else text[max(size - self.lookahead, 0) : size]
        return released

    def take_all(self, finish: str | None) -> EngineDelta | None:
        if not self.held:
            return EngineDelta("", 0, finish) if finish is not None else None
        out, self.held = _merge(self.held, self.text, finish), []
        self.text = ""
        self._rescan()
        return out


class GuardrailStage:
    """The stage (core.stages.Stage). Sessions of a tenant whose set is empty
    get the engine's stream as it is."""

    name = "guardrails"

    def __init__(
        self,
        default: Sequence[Filter],
        sets: dict[str, Sequence[Filter]],
        policy: GuardrailPolicy,
        lookahead_chars: int,
        set_of: Callable[[str], str | None] = lambda tenant: None,
    ) -> None:
        self.default = tuple(default)
        self.sets = {name: tuple(fs) for name, fs in sets.items()}
        self.sets[NO_GUARDRAILS] = ()
        self.policy = policy
        self.lookahead_chars = lookahead_chars
        self.set_of = set_of

    def filters_for(self, tenant: str) -> tuple[Filter, ...]:
        name = self.set_of(tenant)
        return self.default if name is None else self.sets[name]

    def session_info(self, tenant: str) -> dict[str, Any]:
        return {"guardrails": [f.name for f in self.filters_for(tenant)]}

    def stream(
        self, request: GenerationRequest, context: StageContext, source: Source
    ) -> AsyncIterator[EngineDelta]:
        filters = self.filters_for(context.tenant)
        if not filters:
            return source(request)  # no window, no added latency
        # The flag, or more if a filter needs it (a long blocklist phrase).
        lookahead = max(self.lookahead_chars, *(getattr(f, "lookahead", 0) for f in filters))
        # A resumed generation (after a pause or a takeover) goes on after text
        # the client holds: filters see its tail too, so a phrase or number
        # split by the pause is still seen whole.
        window = Window(lookahead, request.resumed_text)
        return self._guard(request, context, source, filters, window)

    async def _guard(
        self,
        request: GenerationRequest,
        context: StageContext,
        source: Source,
        filters: tuple[Filter, ...],
        window: Window,
    ) -> AsyncIterator[EngineDelta]:
        upstream = source(request)
        try:
            async for delta in upstream:
                calls = delta.tool_calls
                finish = delta.finish_reason
                if calls:  # checked text first, then the call, unchecked
                    delta = replace(delta, tool_calls=None, finish_reason=None)
                window.add(delta)
                if not delta.text and not calls and finish is None:
                    continue
                final = finish is not None or bool(calls)
                sent = window.sent
                text, block, held = await self.policy.run(
                    filters, sent + window.text, final, max_held=window.max_held
                )
                if sent:
                    text, block = _after_sent(sent, text, block)
                if block is not None:
                    async for out in self._blocked(filters, window, text, block, context):
                        yield out
                    return
                window.rewrite(text)
                if final:
                    out = window.take_all(None if calls else finish)
                    if out is not None:
                        yield out
                    if calls:
                        yield EngineDelta("", 0, finish, tool_calls=calls)
                    if finish is not None:
                        return
                    continue
                out = window.releasable(held)
                if out is not None:
                    yield out
        finally:
            # However this ends (a block, a cancel, the client gone): the engine stops now.
            await upstream.aclose()  # type: ignore[attr-defined]

    async def _blocked(
        self,
        filters: tuple[Filter, ...],
        window: Window,
        text: str,
        block: Block | None,
        context: StageContext,
    ) -> AsyncIterator[EngineDelta]:
        log.info(
            "guardrail_block",
            session_id=context.session_id,
            response_id=context.response_id,
            reason=block.reason if block else None,
        )
        # The text before the blocked part, checked again as final, may go
        # (nothing does if a filter places the block outside the text).
        while block is not None and block.at and block.at < len(text):
            text, block, _ = await self.policy.run(filters, text[: block.at], True, count=False)
        if block is None and text:
            window.rewrite(text)  # only usage matters now: the generation ends here
            out = window.take_all(None)
            if out is not None:
                yield out
        yield EngineDelta("", 0, CONTENT_FILTER)


def _after_sent(sent: str, text: str, block: Block | None) -> tuple[str, Block | None]:
    """The filters' verdict on `sent + held text`, for the held text: a block
    or a redaction that reaches into what the client holds stops the
    generation (it cannot be taken back), with nothing more released."""
    if not text.startswith(sent):
        return "", Block("a redaction reaches text already sent")
    if block is not None and (block.at is None or block.at < len(sent)):
        return "", Block(block.reason)
    if block is not None:
        block = replace(block, at=block.at - len(sent))
    return text[len(sent) :], block


class KeyGuardrails(Protocol):
    """What the API keys say about guardrails (server.admission.KeyStore)."""

    def guardrail_set(self, kid: str) -> str | None: ...

    @property
    def guardrail_sets(self) -> set[str]: ...


def build_guardrails(config: ServerConfig, keys: KeyGuardrails | None) -> GuardrailStage | None:
    """The stage for --guardrail and --guardrail-set; None when no filter is
    configured anywhere (then no stage: no added latency). Raises
    GuardrailError for a filter that cannot load or a key naming no set."""
    sets: dict[str, list[Filter]] = {}
    for spec in config.guardrail_set:
        name, sep, filter_spec = spec.partition("=")
        if not sep or not name or not filter_spec:
            raise GuardrailError(f"--guardrail-set {spec!r}: expected NAME=FILTER[:ARG]")
        if name == NO_GUARDRAILS:
            raise GuardrailError(f"--guardrail-set: {NO_GUARDRAILS!r} is reserved (no filters)")
        sets.setdefault(name, []).append(load_filter(filter_spec))
    default = [load_filter(spec) for spec in config.guardrail]
    named = keys.guardrail_sets if keys is not None else set()
    unknown = named - set(sets) - {NO_GUARDRAILS}
    if unknown:
        raise GuardrailError(
            f"API keys name guardrail sets that no --guardrail-set defines: {sorted(unknown)}"
        )
    if not default and not sets:
        return None
    if config.guardrail_on_timeout not in ("open", "closed"):
        raise GuardrailError("--guardrail-on-timeout must be open or closed")
    closed = config.guardrail_on_timeout == "closed"
    policy = GuardrailPolicy(config.guardrail_timeout_ms / 1000, closed)
    return GuardrailStage(
        default,
        sets,
        policy,
        config.guardrail_lookahead_chars,
        keys.guardrail_set if keys is not None else lambda tenant: None,
    )
