"""The HTTP side of the remote engine: vLLM's two token-id endpoints.

- `POST /inference/v1/generate` (`vllm serve --enable-scale-out`): token ids
  in, text and token ids out, abortable by id through
  `/inference/v1/abort_requests`.
- `POST /v1/completions` with `prompt: [ids]` and `return_token_ids`: works
  on every vLLM server and router; closing the stream aborts the request.

Both stream SSE chunks of the same shape (`choices[0]` with `text`,
`token_ids`, `finish_reason`; a last chunk with `usage`), so one parser reads
both. Measured on vLLM 0.32: usage (with `prompt_tokens_details.cached_tokens`
only under `--enable-prompt-tokens-details`) arrives in a chunk of its own
after the finishing one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from .base import ContextLengthExceeded, EngineError, EngineUnavailable, RequestError

if TYPE_CHECKING:
    import aiohttp

GENERATE_PATH = "/inference/v1/generate"
ABORT_PATH = "/inference/v1/abort_requests"
COMPLETIONS_PATH = "/v1/completions"
# vLLM prefixes the id it is given on /inference/v1/generate with this.
GENERATE_ID_PREFIX = "generate-tokens-"
CONNECT_TIMEOUT_S = 5.0
KEEPALIVE_S = 4.0  # below the 5 s uvicorn (vLLM's server) keeps an idle connection
# A longer SSE line is garbage. Below it, a whole answer in one chunk (a high
# stream_interval) passes aiohttp's default line limit of 512 KiB. Not more:
# aiohttp joins a line's pieces by copying, so its CPU grows with the square
# of its length (measured: 64 MiB took 39 s of the loop, 4 MiB about 0.1 s).
MAX_LINE = 4 * 2**20
# /v1/completions with return_token_ids echoes the prompt's ids in its first
# chunk: up to this many bytes an id (a 7-digit id, its comma and space).
PROMPT_ID_BYTES = 12
# What of an error answer is read: its message, not an endless or trickled body.
MAX_ERROR_BODY = 64 * 1024
ERROR_BODY_S = 5.0
_decode = msgspec.json.Decoder().decode


def client_session(read_timeout_s: float) -> aiohttp.ClientSession:
    """The gateway's HTTP client: aiohttp, whose C parser reads a token's
    chunk for about half the CPU of httpx's pure-Python stack (measured:
    gateway CPU per token 104 -> 61 µs at c=8)."""
    import aiohttp

    return aiohttp.ClientSession(
        # One connection per stream in flight: no cap (a capped pool would
        # queue generations behind each other). aiohttp never retries a POST,
        # which could run a generation twice.
        # Idle connections go before the server drops them (vLLM's uvicorn:
        # VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s): a request written into one it is
        # closing fails, and would mark a healthy replica down.
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
        timeout=aiohttp.ClientTimeout(
            total=None, sock_connect=CONNECT_TIMEOUT_S, sock_read=read_timeout_s
        ),
        # No cookie jar: one shared by every session would pin all of this
        # instance's sessions to one pod behind a cookie-affinity router.
        cookie_jar=aiohttp.DummyCookieJar(),
    )


class ReplicaFailed(EngineUnavailable):
    """This server failed the attempt (down, 5xx, garbage, stalled); another
    replica may serve the same request."""


@dataclass(slots=True)
class Chunk:
    """What one SSE chunk carried for choice 0."""

    text: str = ""
    token_ids: tuple[int, ...] = ()
    finish_reason: str | None = None
    cached_tokens: int | None = None  # from a usage chunk
    usage: bool = False


def sampling(
    *,
    temperature: float,
    max_tokens: int,
    ignore_eos: bool,
    skip_special_tokens: bool,
    schema: dict[str, Any] | None,
    seed: int | None = None,
    stream_interval: int = 1,
) -> dict[str, Any]:
    """vLLM sampling parameters, as both endpoints name them."""
    params: dict[str, Any] = {
        "temperature": temperature,
        "max_tokens": max_tokens,
        "ignore_eos": ignore_eos,
        "skip_special_tokens": skip_special_tokens,
    }
    if seed is not None:
        params["seed"] = seed
    if stream_interval > 1:
        params["stream_interval"] = stream_interval
    if schema is not None:
        # `structured_outputs`, not `guided_json`: vLLM 0.32 ignores the latter.
        params["structured_outputs"] = {"json": schema}
    return params


def generate_body(
    request_id: str,
    model: str,
    ids: list[int],
    params: dict[str, Any],
    priority: int,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "request_id": request_id,
        # Its chunks name no model: with this, a server that serves another
        # answers 404 (and the request goes elsewhere) instead of its output.
        "model": model,
        "token_ids": ids,
        "sampling_params": params,
        "output_mode": "text",
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return _scheduling(body, priority, cache_salt)


def completions_body(
    model: str,
    ids: list[int],
    params: dict[str, Any],
    priority: int,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": ids,
        "stream": True,
        "return_token_ids": True,
        "stream_options": {"include_usage": True},
        **params,
    }
    return _scheduling(body, priority, cache_salt)


def _scheduling(body: dict[str, Any], priority: int, cache_salt: str | None) -> dict[str, Any]:
    """Both endpoints take these the same way, and only when set."""
    if priority:
        body["priority"] = priority
    if cache_salt:
        body["cache_salt"] = cache_salt
    return body


def parse_chunk(data: bytes | str, url: str, model: str = "") -> Chunk:
    """One SSE `data:` payload. Garbage, an error chunk or another model's
    output (a misrouted request) fails the attempt."""
    try:
        payload = _decode(data)
    except (msgspec.DecodeError, UnicodeDecodeError):
        raise ReplicaFailed(f"{url} sent a chunk that is not JSON: {data[:200]!r}") from None
    if not isinstance(payload, dict):
        raise ReplicaFailed(f"{url} sent an unexpected chunk: {data[:200]!r}")
    try:
        if "error" in payload:  # vLLM reports errors raised mid-stream this way
            error = payload["error"] if isinstance(payload["error"], dict) else {}
            raise error_for(int(error.get("code") or 500), json.dumps(payload), url)
        if model and payload.get("model", model) != model:
            raise ReplicaFailed(f"{url} answered for model {payload['model']!r}, not {model!r}")
        chunk = Chunk()
        usage = payload.get("usage")
        choices = payload.get("choices") or []
        if usage and not choices:
            chunk.usage = True
            details = usage.get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            chunk.cached_tokens = None if cached is None else _count(cached)
            return chunk
        if not choices:
            return chunk
        choice = choices[0]
        chunk.text = choice.get("text") or ""
        ids = choice.get("token_ids") or []
        # Resumes and failovers send these ids back: a wrong one must fail here.
        if not isinstance(chunk.text, str) or not isinstance(ids, list):
            raise TypeError
        chunk.token_ids = tuple(_count(i) for i in ids)
        chunk.finish_reason = choice.get("finish_reason")
        if not isinstance(chunk.finish_reason, str | None):
            raise TypeError
        return chunk
    except (ValueError, TypeError, AttributeError, KeyError, IndexError):
        # A chunk of the wrong shape is garbage too: try another replica.
        raise ReplicaFailed(f"{url} sent a malformed chunk: {data[:200]!r}") from None


async def error_body(resp: aiohttp.ClientResponse) -> str:
    """The start of an error answer: what came of its first 64 KiB within 5 s."""
    body = bytearray()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(ERROR_BODY_S):
            while len(body) < MAX_ERROR_BODY:
                piece = await resp.content.read(MAX_ERROR_BODY - len(body))
                if not piece:
                    break
                body += piece
    return body.decode(errors="replace")


def _count(value: object) -> int:
    """A token id or a count: an int >= 0, not a bool."""
    if type(value) is int and value >= 0:
        return value
    raise ValueError


async def sse_data(
    content: aiohttp.StreamReader, url: str, silent_s: float, max_line: int = MAX_LINE
) -> AsyncIterator[bytes]:
    """The `data:` payloads of an SSE stream, up to `[DONE]`. Keep-alive
    comments reset the read timeout but are no data: a stream of nothing
    else for `silent_s` fails like a silent one."""
    last = time.monotonic()
    while line := await content.readline(max_line_length=max_line):
        if not line.startswith(b"data:"):
            # Blank separators, comments, keep-alives: a clock read, not one per token.
            if silent_s and time.monotonic() - last > silent_s:
                raise ReplicaFailed(f"{url} sent no data for {silent_s:g} s, only keep-alives")
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            return
        yield data
        # After the consumer is done with it: its time is no silence of the server's.
        last = time.monotonic()


def message_of(body: str) -> str:
    try:
        payload = json.loads(body)
    except ValueError:
        return body[:500]
    if isinstance(payload, dict):
        error = payload.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        for key in ("message", "detail"):
            if payload.get(key):
                return str(payload[key])
    return body[:500]


REQUEST_FAULTS = frozenset({400, 413, 422})


def error_for(status: int, body: str, url: str) -> EngineError:
    """An HTTP error: the server's fault (another replica may do) or the request's."""
    message = message_of(body)
    # Only these are about the request itself. Anything else (5xx, a missing
    # endpoint, auth or routing: a replica restarted without --enable-scale-out,
    # a proxy in front, an unexpected 2xx) is this server's fault, not the request's.
    if status not in REQUEST_FAULTS:
        return ReplicaFailed(f"{url} answered {status}: {message}")
    lowered = message.lower()
    if "context length" in lowered or "max_model_len" in lowered or "too long" in lowered:
        return ContextLengthExceeded(f"the server refused the prompt: {message}")
    return RequestError(f"the server refused the request ({status}): {message}")
