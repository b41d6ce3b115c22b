"""Guardrail filters: the interface, the built-ins, and loading by name.

A filter looks at the text the guardrail stage still holds back (the
window) and answers with a verdict: `ALLOW`, `Block(reason)` or
`Redact(text)`. `check` may be sync or async (a call to a moderation
classifier); the stage bounds async checks with `--guardrail-timeout-ms`.

`final` is False while more text may follow: a match that touches the end of
the window may still grow ("secret" -> "secrets") and must be left for a later
check, which the window guarantees will come before that text is released.

`--guardrail NAME[:ARG]` names a built-in (`blocklist:FILE`, `pii`) or an entry
point in the group `tokenwire.guardrails`: a callable taking ARG (or None)
and returning a `Filter`.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol

try:  # `regex` bounds a search's time: a catastrophic pattern cannot stall the loop
    import regex as _regex
except ImportError:  # pragma: no cover - only without the optional `regex` package
    _regex = None

ENTRY_POINT_GROUP = "tokenwire.guardrails"
# Scripts written without spaces between words (CJK ideographs and their
# punctuation, kana, fullwidth forms, Thai, Lao, Myanmar, Khmer): the window
# may be cut between two of their characters, and a blocklist word in them is
# found inside running text, which has no word boundaries to match on.
UNSPACED = re.compile(
    "[\u0e00-\u0eff\u1000-\u109f\u1780-\u17ff\u3000-\u30ff"
    "\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef]"
)
REGEX_PREFIX = "re:"  # a blocklist line that is a regular expression
# Seconds one blocklist regex may run on one window (with the `regex` package).
REGEX_TIMEOUT_S = 0.05


class GuardrailError(ValueError):
    """A guardrail the server cannot set up; the message says which and why."""


@dataclass(frozen=True, slots=True)
class Allow:
    pass


@dataclass(frozen=True, slots=True)
class Block:
    reason: str
    # Where the blocked text starts in the window, if the filter knows: the
    # text before it may still be delivered (after every filter checks it).
    at: int | None = None


@dataclass(frozen=True, slots=True)
class Redact:
    text: str  # the window, rewritten


@dataclass(frozen=True, slots=True)
class Hold:
    """No decision yet on the text from `at` on (a match may be forming
    there, longer than any lookahead can say): the stage does not release it."""

    at: int


Verdict = Allow | Block | Redact | Hold
ALLOW = Allow()


class Filter(Protocol):
    name: str
    # Characters this filter needs held back to see what it matches whole.
    lookahead: int

    def check(self, window: str, final: bool) -> Verdict | Awaitable[Verdict]: ...


def _decided(match_end: int, window: str, final: bool, margin: int = 1) -> bool:
    """A match is decided once `margin` characters follow it (or nothing more comes)."""
    return final or match_end <= len(window) - margin


class Blocklist:
    """Words and phrases (case-insensitive, whole words) or `re:` regexes, one a line."""

    name = "blocklist"

    def __init__(self, lines: list[str]) -> None:
        others: list[str] = []
        self.patterns: list[Any] = []
        # Entries of plain words: by their first word, as word tuples. A dict
        # lookup per word of the window, where a 500-word regex alternation
        # costs a scan per position (measured: benchmarks/guardrail.py).
        self.phrases: dict[str, list[tuple[str, ...]]] = {}
        longest = 0
        for raw in lines:
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            if line.startswith(REGEX_PREFIX):
                self.patterns.append(_compile(line[len(REGEX_PREFIX) :], 0))
                continue
            longest = max(longest, len(line))
            parts = tuple(line.lower().split())
            if all(_WORD.fullmatch(w) for w in parts) and not UNSPACED.search(line):
                self.phrases.setdefault(parts[0], []).append(parts)
            else:
                others.append(line)
        if others:  # entries with punctuation or unspaced script: a regex, longest first
            others.sort(key=len, reverse=True)
            alternation = "|".join(map(_entry_pattern, others))
            self.patterns.insert(0, re.compile(f"(?:{alternation})", re.IGNORECASE))
        # The longest entry, plus the character that shows it has ended.
        self.lookahead = longest + 1 if longest else 0

    @classmethod
    def from_arg(cls, arg: str | None) -> Blocklist:
        if not arg:
            raise GuardrailError("blocklist needs a file: --guardrail blocklist:FILE")
        try:
            return cls(Path(arg).read_text().splitlines())
        except OSError as exc:
            raise GuardrailError(f"blocklist {arg}: {exc.strerror or exc}") from None

    def check(self, window: str, final: bool) -> Verdict:
        if self.phrases:
            found = self._phrase(window, final)
            if found is not None:
                return found
        for pattern in self.patterns:
            # The leftmost match only: one that is not decided yet ends the
            # window, so no later one can be. A regex has no length bound
            # for a lookahead: an undecided match, or (with `regex`) the
            # start of one at the window's end, holds the text from there.
            match = _search(pattern, window, partial=not final)
            if match is None or match.start() == len(window):  # an empty partial: nothing held
                continue
            if getattr(match, "partial", False) or not _decided(match.end(), window, final):
                return Hold(match.start())
            return Block(f"blocklist: {pattern.pattern[:40]}", match.start())
        return ALLOW

    def _phrase(self, window: str, final: bool) -> Block | None:
        # Words of the window as it is, lowered one by one: lowering the whole
        # window moves positions ("İ" lowers to two characters).
        words = list(_WORD.finditer(window))
        lowered = [w[0].lower() for w in words]
        for i, w in enumerate(words):
            for phrase in self.phrases.get(lowered[i], ()):
                run = words[i : i + len(phrase)]
                if len(run) < len(phrase) or lowered[i : i + len(phrase)] != list(phrase):
                    continue
                # Only whitespace between the words ("top secret", not "top-secret").
                if any(window[a.end() : b.start()].strip() for a, b in itertools.pairwise(run)):
                    continue
                if _decided(run[-1].end(), window, final):
                    return Block("blocklist", w.start())
        return None


_WORD = re.compile(r"\w+")


def _entry_pattern(entry: str) -> str:
    """A plain entry as a regex: its words across any whitespace, whole (not
    \b: it may begin or end with a non-word character), except at an end in
    a script written without spaces, where running text has no boundary."""
    body = r"\s+".join(map(re.escape, entry.split()))
    before = "" if UNSPACED.match(entry[0]) else r"(?<!\w)"
    after = "" if UNSPACED.match(entry[-1]) else r"(?!\w)"
    return before + body + after


def _compile(pattern: str, flags: int) -> Any:
    try:
        return (_regex or re).compile(pattern, flags)
    except (re.error, getattr(_regex, "error", re.error)) as exc:
        raise GuardrailError(f"blocklist regex {pattern!r}: {exc}") from None


def _search(pattern: Any, text: str, partial: bool = False) -> Any:
    """`partial`: with `regex`, a match cut off by the text's end counts too."""
    if _regex is not None and isinstance(pattern, _regex.Pattern):
        # Raises TimeoutError.
        return pattern.search(text, partial=partial, timeout=REGEX_TIMEOUT_S)
    return pattern.search(text)


# Anchored on the left: else a search retries from each character of a long
# run of name characters, quadratic in the run.
EMAIL = re.compile(
    r"(?<![A-Za-z0-9._%+-])[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}"
)
# An optional +country code, then 3-3-4 digits with separators or a (area)
# code: plain digit runs (years, amounts) are left alone. ASCII: a number
# right after a Chinese word ("电话555 123 4567") is still one.
PHONE = re.compile(
    r"(?<![\w+])(?:\+\d{1,3}[ .-]?)?(?:\(\d{3}\)[ .-]?|\d{3}[ .-])\d{3}[ .-]\d{4}(?!\w)",
    re.ASCII,
)
# A match this close to the window's end may still grow (".au", "-4567").
PII_MARGIN = 8


class Pii:
    """Redacts e-mail addresses and phone numbers: `[email]`, `[phone]`."""

    name = "pii"
    # The longest phone form plus the margin; an e-mail, one word, is held
    # whole anyway (the stage never releases part of a word).
    lookahead = 32

    @classmethod
    def from_arg(cls, arg: str | None) -> Pii:
        if arg:
            raise GuardrailError("pii takes no argument")
        return cls()

    def check(self, window: str, final: bool) -> Verdict:
        text = window
        for pattern, label in ((EMAIL, "[email]"), (PHONE, "[phone]")):
            if not pattern.search(text):
                continue
            text = pattern.sub(
                lambda m, label=label: (
                    label if _decided(m.end(), m.string, final, PII_MARGIN) else m[0]
                ),
                text,
            )
        return ALLOW if text == window else Redact(text)


BUILTINS: dict[str, Callable[[str | None], Filter]] = {
    "blocklist": Blocklist.from_arg,
    "pii": Pii.from_arg,
}


def load_filter(spec: str) -> Filter:
    """A filter from `NAME[:ARG]`: a built-in, else an entry point of
    `tokenwire.guardrails` (a factory called with ARG, or None)."""
    name, sep, arg = spec.partition(":")
    factory = BUILTINS.get(name)
    if factory is None:
        found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
        if not found:
            plugins = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]
            known = ", ".join([*BUILTINS, *plugins])
            raise GuardrailError(f"unknown guardrail {name!r}; known: {known}")
        try:
            factory = found[0].load()
        except Exception as exc:  # an installed plugin that fails to import
            raise GuardrailError(f"guardrail {name!r}: {type(exc).__name__}: {exc}") from None
    try:
        made = factory(arg if sep else None)
    except GuardrailError:
        raise
    except Exception as exc:
        raise GuardrailError(f"guardrail {name!r}: {type(exc).__name__}: {exc}") from None
    if not callable(getattr(made, "check", None)):
        raise GuardrailError(f"guardrail {name!r}: its factory returned no filter")
    if not hasattr(made, "name"):
        made.name = name  # type: ignore[misc]
    return made
