"""The remote engine: vLLM OpenAI-compatible servers, driven with token ids.

tokenwire renders the chat template itself (the model's tokenizer, loaded
here), sends token ids and keeps the token ids that come back, so a paused,
steered or failed-over generation resubmits prompt + generated ids and
continues exactly (a prefix-cache hit on the server). Tool-call scanners run
here, on the streamed text.

Each server is checked at startup (remote_checks.py). A session is pinned
to one replica by a stable hash of its id (and carries it in a header, for a
router); a replica that fails is taken out by its circuit breaker
(replicas.py), and a generation it was running continues on the next one.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..logs import get_logger
from .base import (
    EngineCapabilities,
    EngineDelta,
    EngineError,
    EngineLoad,
    EngineUnavailable,
    GenerationRequest,
)
from .chat_template import ChatTemplate
from .remote_checks import check_rendering, probe_endpoint, read_model
from .remote_http import (
    ABORT_PATH,
    COMPLETIONS_PATH,
    GENERATE_ID_PREFIX,
    GENERATE_PATH,
    MAX_LINE,
    PROMPT_ID_BYTES,
    Chunk,
    ReplicaFailed,
    client_session,
    completions_body,
    error_body,
    error_for,
    generate_body,
    parse_chunk,
    sampling,
    sse_data,
)
from .replicas import REQUESTS, TTFT, Replica, replica_order
from .startup import Startup
from .toolcalls import (
    ParserStream,
    forced_scanner,
    import_vllm_side,
    split_calls,
    structured_schema,
)

if TYPE_CHECKING:
    import aiohttp

    from ..config import ServerConfig

log = get_logger("tokenwire.engines.remote")


# Chunks read after the finishing one while waiting for its usage.
AFTER_END_CHUNKS = 8


@dataclass(slots=True)
class _Plan:
    """What one generation sends, kept across failover attempts."""

    prompt: list[int]  # rendered prompt + resume ids
    budget: int  # output tokens allowed in all
    schema: dict[str, Any] | None
    skip_special_tokens: bool
    produced: list[int] = field(default_factory=list)


class RemoteEngine:
    name = "remote"

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.replicas = [Replica(url.rstrip("/")) for url in config.remote_url]
        self.capabilities = EngineCapabilities(
            resume_from_token_ids=True, preflight=True, priority=config.remote_priority
        )
        self.model = ""
        self._client: aiohttp.ClientSession | None = None
        self._template: ChatTemplate | None = None
        self._max_len = 0
        self._startup = Startup(
            lambda exc: str(exc) if isinstance(exc, EngineError) else repr(exc),
            "the remote engine",
            log,
        )
        self._in_flight = 0
        self._aborts: set[asyncio.Task[None]] = set()  # fire-and-forget abort POSTs

    @property
    def ready(self) -> bool:
        # Started, and a server not known to be down: with none, /readyz
        # sends new clients to another gateway. Known: its /health failed
        # too; a failed request alone (one session's, through a router that
        # fails over itself) makes no gateway unready.
        return self._startup.ready and any(not r.health_failed for r in self.replicas)

    @property
    def failure(self) -> str | None:
        if self._startup.ready and not self.ready:
            return (
                "every --remote-url server is down (its GET /health fails); each is "
                "probed again and back in service once it answers"
            )
        return self._startup.failure

    # -- startup ------------------------------------------------------------

    async def start(self) -> None:
        await self._startup.run(self._start)

    async def _start(self) -> None:
        if not self.replicas:
            raise EngineUnavailable("--engine remote needs at least one --remote-url")
        self._client = client_session(self.config.remote_timeout_s)
        for replica in self.replicas:
            await read_model(self._client, replica)
        models = {r.model for r in self.replicas}
        if len(models) > 1:
            raise EngineUnavailable(f"the servers serve different models: {sorted(models)}")
        self.model = self.replicas[0].model
        self._template = ChatTemplate(await asyncio.to_thread(self._load_tokenizer))
        # What a first request with tools would import, off the event loop.
        await asyncio.to_thread(import_vllm_side, self.config.tool_parser)
        for replica in self.replicas:
            await check_rendering(self._client, self._template, replica)
            await probe_endpoint(self._client, self._template, replica)
            replica.watch()
        self._max_len = min(r.max_model_len for r in self.replicas)
        if not self.config.remote_priority:
            log.warning(
                "remote_priority_off",
                hint="priorities are sent, but vLLM ignores them unless it runs "
                "--scheduling-policy priority; then pass --remote-priority",
            )
        log.info(
            "engine_ready",
            model=self.model,
            max_model_len=self._max_len,
            replicas={r.url: r.describe()["endpoint"] for r in self.replicas},
        )

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        source = self.config.model or self.model
        try:
            return AutoTokenizer.from_pretrained(source)
        except Exception as exc:
            raise EngineUnavailable(
                f"cannot load the tokenizer of {source!r} ({type(exc).__name__}: {exc}); "
                "pass --model with a local copy of the served model's tokenizer"
            ) from None

    async def close(self) -> None:
        for task in self._aborts:
            task.cancel()
        for replica in self.replicas:
            replica.stop()
        if self._client is not None:
            await self._client.close()
            self._client = None

    # -- the engine interface -----------------------------------------------

    def load(self) -> EngineLoad:
        # What this gateway has in flight; the servers' own queues are theirs.
        return EngineLoad(
            running=self._in_flight,
            extra={
                "unfinished": self._in_flight,
                "replicas": {r.url: r.describe() for r in self.replicas},
            },
        )

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        if self._template is None:
            return None  # not started yet; generate() checks once it is
        return tuple(self._template.prompt_ids(request, self._max_len))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        await self._startup.wait()
        assert self._template is not None
        ids = (
            list(request.rendered)
            if request.rendered
            else await self._template.prompt_ids_async(request, self._max_len)
        )
        prompt = [*ids, *request.resume_token_ids]
        room = self._max_len - len(prompt)
        wanted = request.max_output_tokens
        tools, choice = request.tools, request.tool_choice
        # Forced calls go through structured outputs; "auto" through the
        # configured vLLM tool parser, if any.
        schema = structured_schema(tools, choice) if tools else None
        scanner = forced_scanner(choice) if schema is not None else None
        parser = None
        if tools and choice == "auto" and self.config.tool_parser:
            parser = ParserStream(self.config.tool_parser, self._template.tokenizer, tools)
        plan = _Plan(
            prompt=prompt,
            budget=room if wanted is None else min(wanted, room),
            schema=schema,
            skip_special_tokens=parser.skip_special_tokens if parser else True,
        )
        first = True
        self._in_flight += 1
        try:
            async with aclosing(self._chunks(request, plan)) as chunks:
                async for chunk in chunks:
                    text, calls = split_calls(
                        chunk.text,
                        chunk.token_ids,
                        scanner,
                        parser,
                        chunk.finish_reason is not None,
                    )
                    yield EngineDelta(
                        text=text,
                        output_tokens=len(chunk.token_ids),
                        finish_reason=chunk.finish_reason,
                        # Usage adds up (core/lifecycle.py): the prompt on the
                        # first delta; the cached count, which vLLM reports
                        # only at the end, on the last one with a prompt of 0.
                        prompt_tokens=len(prompt) if first else (0 if chunk.usage else None),
                        # At most the prompt: a resubmission sent prompt +
                        # the ids so far, and its cache hit counts them too.
                        cached_tokens=(
                            min(chunk.cached_tokens, len(prompt))
                            if chunk.usage and chunk.cached_tokens is not None
                            else None
                        ),
                        tool_calls=calls or None,
                        token_ids=list(chunk.token_ids),
                    )
                    first = False
        finally:
            self._in_flight -= 1

    async def _chunks(self, request: GenerationRequest, plan: _Plan) -> AsyncIterator[Chunk]:
        """The generation's chunks, from one replica or, when one fails, the
        next: it resubmits prompt + the ids produced so far, so nothing is
        lost or repeated. The finishing chunk carries the final usage."""
        failures: list[str] = []
        # Two rounds: a replica whose stream broke may be reached again on a
        # fresh connection (a dropped keep-alive connection fails like a dead
        # server), and a lone replica gets one resubmission.
        first_round = replica_order(self.replicas, request.session_id)
        n = len(first_round)
        # The last replica that is up waits for its first token however long
        # (a prompt slow to prefill is slow everywhere), and so does every
        # attempt after the first round's last: the down ones go last.
        last_up = max((i for i, r in enumerate(first_round) if r.up), default=-1)
        for attempt, replica in enumerate(first_round * 2):
            if attempt and plan.schema is not None and plan.produced:
                break  # a grammar cannot restart mid-output on another server
            try:
                patient = attempt >= (last_up if last_up >= 0 else n - 1)
                attempt_chunks = self._attempt(replica, request, plan, attempt, patient)
                async with aclosing(attempt_chunks) as chunks:
                    async for chunk in chunks:
                        yield chunk
                replica.served()  # also brings back a down one, tried as a last resort
                return
            except ReplicaFailed as exc:
                assert self._client is not None
                replica.failed(self._client)
                failures.append(exc.message)
                log.warning(
                    "remote_replica_failed",
                    url=replica.url,
                    request_id=request.request_id,
                    produced=len(plan.produced),
                    error=exc.message,
                )
        raise EngineUnavailable("no replica could serve the request: " + "; ".join(failures))

    async def _attempt(
        self,
        replica: Replica,
        request: GenerationRequest,
        plan: _Plan,
        attempt: int,
        patient: bool,
    ) -> AsyncIterator[Chunk]:
        import aiohttp
        from aiohttp.http_exceptions import LineTooLong

        assert self._client is not None
        remaining = plan.budget - len(plan.produced)
        if remaining <= 0:  # failed right after the last token
            yield Chunk(finish_reason="length", usage=True)
            return
        ids = plan.prompt + plan.produced
        params = sampling(
            temperature=request.temperature,
            max_tokens=remaining,
            ignore_eos=request.ignore_eos,
            skip_special_tokens=plan.skip_special_tokens,
            schema=plan.schema,
            seed=request.seed,
            stream_interval=request.stream_interval,
        )
        priority, salt = request.priority, request.cache_salt
        rid = request.request_id if attempt == 0 else f"{request.request_id}-retry{attempt}"
        if replica.generate_endpoint:
            body = generate_body(rid, replica.model, ids, params, priority, salt)
            path = GENERATE_PATH
        else:
            path = COMPLETIONS_PATH
            body = completions_body(replica.model, ids, params, priority, salt)
        # vLLM takes a request's id from X-Request-Id when there is one (a
        # gateway may add its own): ours, so the abort below finds it.
        headers = {"X-Request-Id": rid}
        if request.session_id:
            headers[self.config.remote_session_header] = request.session_id
        streaming = False
        final: Chunk | None = None
        replica.in_flight += 1
        replica.requests += 1
        REQUESTS.labels(replica.url).inc()
        sent_at = time.monotonic()
        # With somewhere else to go, a replica that gives no first token in
        # time loses the request to the next one (it may be overloaded).
        # Chunks with nothing in them (`data: {}`) do not count as one.
        ttft = 0.0 if patient else self.config.remote_ttft_timeout_s
        try:
            async with asyncio.timeout(ttft or None) as clock:
                async with self._client.post(
                    replica.base + path, json=body, headers=headers
                ) as resp:
                    if resp.status != 200:
                        text = await error_body(resp)
                        raise error_for(resp.status, text, replica.url)
                    streaming = True
                    silent_s = self.config.remote_timeout_s
                    said_at = time.monotonic()  # the last chunk with something in it, taken
                    after_end = 0
                    longest = MAX_LINE + PROMPT_ID_BYTES * len(ids)  # the prompt's echo
                    async for data in sse_data(resp.content, replica.url, silent_s, longest):
                        chunk = parse_chunk(data, replica.url, replica.model)
                        if chunk.usage:
                            if final is not None:
                                final.cached_tokens = chunk.cached_tokens
                                break  # the stream's end: nothing else is read
                            continue
                        if final is not None:
                            # Past the end: nothing may follow the last token. The
                            # usage may still come; a stream that never ends won't.
                            after_end += 1
                            if after_end > AFTER_END_CHUNKS:
                                break
                            continue
                        if not (chunk.text or chunk.token_ids or chunk.finish_reason):
                            # `data: {}` alone is no more life than a keep-alive.
                            if silent_s and time.monotonic() - said_at > silent_s:
                                raise ReplicaFailed(
                                    f"{replica.url} sent only empty chunks for {silent_s:g} s"
                                )
                            continue
                        if sent_at:
                            TTFT.labels(replica.url).observe(time.monotonic() - sent_at)
                            sent_at = 0.0
                            clock.reschedule(None)  # disarmed before anything is yielded
                        plan.produced.extend(chunk.token_ids)
                        if len(plan.produced) > plan.budget:
                            raise ReplicaFailed(f"{replica.url} went on past max_tokens")
                        if chunk.finish_reason == "abort":
                            # vLLM aborted it (shut down, or paused with abort):
                            # not the answer's end; it goes on elsewhere.
                            if chunk.text or chunk.token_ids:
                                yield Chunk(chunk.text, chunk.token_ids)
                            raise ReplicaFailed(f"{replica.url} aborted the request")
                        if chunk.finish_reason is not None:
                            final = chunk  # held until the usage chunk that follows it
                        else:
                            yield chunk
                        # From now: the consumer's time with the chunk is no
                        # silence of the server's.
                        said_at = time.monotonic()
        # Before TimeoutError: aiohttp's read timeout (a stalled stream) is one too.
        except (aiohttp.ClientError, LineTooLong, EngineError) as exc:
            if final is None:
                if isinstance(exc, EngineError):  # a replica's fault, or the request's
                    raise
                raise ReplicaFailed(f"{replica.url}: {replica.error_text(exc)}") from None
            # Broken after the finishing token: only the usage is lost. Never
            # resubmit a finished generation (it would go on past its end).
        except TimeoutError:
            raise ReplicaFailed(f"{replica.url} gave no first token within {ttft:g} s") from None
        finally:
            replica.in_flight -= 1
            if streaming and final is None and replica.generate_endpoint:
                # Closing the stream aborts too, after about a decode step;
                # the abort endpoint is immediate (measured: 4 ms).
                self._abort_soon(replica, GENERATE_ID_PREFIX + rid, headers)
        if final is None:
            raise ReplicaFailed(f"{replica.url} ended the stream before it finished")
        final.usage = True
        yield final

    def _abort_soon(
        self, replica: Replica, engine_request_id: str, headers: dict[str, str]
    ) -> None:
        import aiohttp

        async def abort() -> None:
            assert self._client is not None
            # The session header too: a router sends it where the request went.
            try:
                async with self._client.post(
                    replica.base + ABORT_PATH,
                    json={"request_ids": [engine_request_id]},
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=2),
                ):
                    pass
            except Exception as exc:  # best effort: the closed stream aborts it anyway
                log.debug("remote_abort_failed", url=replica.url, error=repr(exc))

        if self._client is None:
            return
        task = asyncio.get_running_loop().create_task(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)


def check_or_exit(config: ServerConfig) -> None:
    """`tokenwire serve --engine remote`: probe the servers before anything
    starts; an unreachable or mismatched one exits with code 2 and says why."""

    async def check() -> None:
        engine = RemoteEngine(config)
        try:
            await engine.start()
        finally:
            await engine.close()

    try:
        asyncio.run(check())
    except EngineError as exc:
        print(f"error: --engine remote: {exc.message}", file=sys.stderr)
        raise SystemExit(2) from None
