"""The server: its lifecycle (start, drain, close) and the life of each
WebSocket connection, from admission to the session it ends in."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
from collections.abc import Awaitable
from http import HTTPStatus
from typing import Any

from redis.exceptions import RedisError
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from .. import metrics
from ..config import ServerConfig
from ..core.limits import TokenBucket
from ..engines import Engine, create_engine
from ..logs import get_logger
from ..runtime import cluster
from ..runtime.follower import Follower
from ..runtime.session_runtime import GONE, RuntimeState, SessionRuntime, until_detached
from ..runtime.socket import ClientSocket, Handoff, Outcome
from ..runtime.ws import close_or_abort, inbound_budget, set_sndbuf
from ..stages import build_stages
from ..storage.redis import RedisStore
from ..wire import dialect_for, select_subprotocol
from ..wire.close_codes import CLOSE_TRY_AGAIN_LATER, STORE_UNAVAILABLE
from .admission import Admission
from .body import BodyConnection, BodyError
from .client_secrets import ClientSecrets
from .collector import COLLECTOR
from .heartbeat import Heartbeat
from .http import error_response, http_response, json_response, static_route
from .loop_watch import LoopWatch
from .registry import Registry
from .tls import server_context

log = get_logger("tokenwire.server")

REALTIME_PATH = "/v1/realtime"
CLIENT_SECRETS_PATH = "/v1/realtime/client_secrets"
DRAIN_FLUSH_S = 1.0  # how long writers get to send what is queued before sessions end
BETA_SESSIONS_PATH = "/v1/realtime/sessions"  # the beta's ephemeral keys

# A POST body websockets' connection could not read (server/body.py).
_BODY_ERRORS = {
    BodyError.LENGTH_REQUIRED: (HTTPStatus.LENGTH_REQUIRED, "send the body with a Content-Length"),
    BodyError.TOO_LARGE: (HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "the body is too large"),
    BodyError.BAD_LENGTH: (HTTPStatus.BAD_REQUEST, "the Content-Length is not one number"),
}


class ListenError(Exception):
    """The server cannot take the address it was given."""


def _listen_hint(exc: OSError) -> str:
    if exc.errno == errno.EADDRINUSE:
        return "another program listens there; stop it, or choose another --port"
    if exc.errno == errno.EACCES:
        return "ports below 1024 need privileges; choose a --port above 1023"
    if exc.errno == errno.EADDRNOTAVAIL:
        return "--host is not an address of this machine; 0.0.0.0 listens on all of them"
    return "check --host and --port"


class TokenwireServer:
    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine or create_engine(config)
        self.connections: set[SessionRuntime] = set()  # sessions with a socket attached
        self.followers: set[Follower] = set()  # sockets following another instance's session
        self.store = (
            RedisStore(
                config.redis_url,
                ttl_s=config.redis_ttl_s,
                maxlen=config.redis_maxlen,
                lease_s=config.lease_s,
            )
            if config.redis_url
            else None
        )
        # What a minted secret's GA session shows for settings it leaves unset.
        defaults = {
            "engine": self.engine.name,
            "default_max_output_tokens": config.default_max_output_tokens,
        }
        self.admission = Admission(config, ClientSecrets(self.store, defaults))
        self.registry = Registry(self.engine, config, self.admission.limiter, self.store)
        self.registry.stages = build_stages(config, self.store, self.engine, self.admission.keys)
        self._server: Server | None = None
        self._engine_task: asyncio.Task[None] | None = None
        # Keepalive pings for every connection (websockets' own: a task each).
        interval = config.ping_interval_s
        self.heartbeat = Heartbeat(interval, interval) if interval > 0 else None
        self.loop_watch = LoopWatch()
        tables = self.registry.reclaimer.tables
        tables += [
            self.connections,
            self.followers,
            *(self.heartbeat.slots if self.heartbeat else ()),
        ]
        self.draining = False

    @property
    def sessions(self) -> dict[str, SessionRuntime]:
        """Every live session of this instance, by id."""
        return self.registry.sessions

    # -- HTTP -------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        load = self.engine.load()
        return {
            "status": "ok",
            "engine": self.engine.name,
            "ready": self.engine.ready,
            "draining": self.draining,
            "instance_id": self.store.instance_id if self.store else None,
            "sessions": len(self.sessions),
            "connections": len(self.connections),
            "followers": len(self.followers),
            "paused_connections": sum(c.paused for c in self.connections),
            "outbound_buffered_bytes": sum(c.buffered_amount for c in self.connections),
            "engine_load": {"running": load.running, "waiting": load.waiting, **load.extra},
        }

    def _process_request(
        self, conn: ServerConnection, request: Request
    ) -> Response | Awaitable[Response | None] | None:
        """Synchronous but for client secrets (minting; a handshake with one),
        which websockets awaits."""
        path = request.path.split("?", 1)[0]
        if path == REALTIME_PATH and request.method == "GET":
            return self.admission.admit(conn, request, self._open_sockets, self.draining)
        if path == CLIENT_SECRETS_PATH:
            return self._client_secrets(conn, request)
        if path == BETA_SESSIONS_PATH:
            return error_response(
                HTTPStatus.BAD_REQUEST,
                "beta_not_supported",
                "this is the beta Realtime API's session endpoint; tokenwire speaks the GA API: "
                f"mint a client secret at POST {CLIENT_SECRETS_PATH} "
                "(openai SDK: client.realtime.client_secrets.create)",
            )
        if request.method not in ("GET", "HEAD") or path == REALTIME_PATH:
            response = error_response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method_not_allowed",
                f"{request.method} is served only at {CLIENT_SECRETS_PATH}"
                if path != REALTIME_PATH
                else f"the WebSocket handshake at {REALTIME_PATH} is a GET",
            )
            response.headers["Allow"] = "GET"
            return response
        if path == "/metrics":
            self._update_gauges()
            body, content_type = metrics.render()
            return http_response(HTTPStatus.OK, body, content_type)
        if path == "/healthz":
            return json_response(HTTPStatus.OK, self.health())
        if path == "/readyz":
            # Draining: the load balancer should send new clients elsewhere.
            ready = self.engine.ready and not self.draining
            body = {"ready": ready, "engine": self.engine.name, "draining": self.draining}
            failure = getattr(self.engine, "failure", None)
            if failure:
                body["error"] = failure
            return json_response(HTTPStatus.OK if ready else HTTPStatus.SERVICE_UNAVAILABLE, body)
        found = static_route(path)
        if found is not None:
            return found
        return json_response(
            HTTPStatus.NOT_FOUND,
            {"error": f"no route {path!r}; the WebSocket endpoint is {REALTIME_PATH}"},
        )

    def _client_secrets(
        self, conn: ServerConnection, request: Request
    ) -> Response | Awaitable[Response]:
        if request.method != "POST":
            response = error_response(
                HTTPStatus.METHOD_NOT_ALLOWED,
                "method_not_allowed",
                f"mint a client secret with POST {CLIENT_SECRETS_PATH}",
            )
            response.headers["Allow"] = "POST"
            return response
        if self.draining:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, "draining", "this instance is shutting down"
            )
        problem = getattr(conn, "body_error", None)
        if problem is not None:
            status, message = _BODY_ERRORS[problem]
            return error_response(status, str(problem), message)
        return self.admission.mint(request, getattr(conn, "body", None))

    def _update_gauges(self) -> None:
        load = self.engine.load()
        metrics.ENGINE_QUEUE.labels("running").set(load.running)
        metrics.ENGINE_QUEUE.labels("waiting").set(load.waiting)
        metrics.OUTBOUND_BUFFERED.set(sum(c.buffered_amount for c in self.connections))

    # -- WebSocket ----------------------------------------------------------

    @property
    def _open_sockets(self) -> int:
        """What --max-connections counts: sockets serving a session here or
        following one owned elsewhere."""
        return len(self.connections) + len(self.followers)

    async def _handle(self, ws: ServerConnection) -> None:
        # Nothing reads the handshake again: its headers (about 4 KiB) need not
        # live as long as the socket. The request stays (websockets' parser
        # holds it too), emptied.
        ws.request.headers.clear()
        ws.response = None
        admitted = self.admission.connect(ws, self._open_sockets)
        if admitted is None:
            await ws.close(CLOSE_TRY_AGAIN_LATER, "too_many_connections")
            return
        usage, settings = admitted
        if self.heartbeat is not None:
            self.heartbeat.add(ws)
        try:
            try:
                # The registry leaves nothing behind if this fails.
                runtime = await self.registry.new_session(usage, ws.subprotocol, settings=settings)
            except Exception as exc:
                await _failed(ws, exc)
                return
            await self._run(ws, runtime)
        finally:
            self.admission.disconnect(usage)
            if self.heartbeat is not None:
                self.heartbeat.discard(ws)

    async def _run(self, ws: ServerConnection, runtime: SessionRuntime | Follower) -> None:
        """Serve the socket's sessions (its own, then any it resumes) until it closes."""
        dialect = dialect_for(ws.subprotocol)
        # One budget for the connection, whatever session it serves.
        budget = inbound_budget(self.config.max_inbound_bytes_per_s, self.config.max_message_bytes)
        resume_from: int | None = None
        try:
            while True:
                outcome = await self._serve(ws, dialect, runtime, resume_from, budget)
                if not isinstance(outcome, Handoff):
                    break
                if isinstance(runtime, SessionRuntime):
                    # The socket resumes another session; the fresh one never ran.
                    await self.registry.end_session(runtime)
                runtime, resume_from = outcome.target, outcome.last_seq
                if isinstance(runtime, SessionRuntime):
                    if not await _take(ws, runtime):
                        return
                    # No await from here to the attach: one socket per session.
                    self.registry.replacing_follower(runtime)
        except Exception as exc:
            await _failed(ws, exc)
            if isinstance(runtime, SessionRuntime) and runtime.state in _OURS:
                # A session being resumed stays for its client's next try; the
                # socket's own fresh one ends if its client never used it.
                used = resume_from is not None or runtime.session.client_events
                await self._release(runtime, "lost" if used else "ended")
            return
        if isinstance(runtime, SessionRuntime):
            await self._release(runtime, outcome)

    async def _release(self, runtime: SessionRuntime, outcome: Outcome) -> None:
        """Its socket is gone: keep the session for a resume, or end it (its
        client's dialect has no resume: its generations would run for no one)."""
        resumable = runtime.delivery.dialect.resumable
        if outcome == "lost" and resumable and self.config.resume_grace_s > 0:
            if self.draining and self.store is not None:
                return  # the drain hands it over (protocol.md: every session)
            if not self.draining:
                self.registry.arm_expiry(runtime)  # its generations go on meanwhile
                return
        if runtime.state is not RuntimeState.HANDED_OVER:
            await self.registry.end_session(runtime)

    async def _serve(
        self,
        ws: ServerConnection,
        dialect: Any,
        runtime: SessionRuntime | Follower,
        resume_from: int | None,
        budget: TokenBucket | None,
    ) -> Outcome:
        if isinstance(runtime, Follower):
            if self.config.sndbuf:  # as an owner's socket gets it (runtime.delivery)
                set_sndbuf(ws, self.config.sndbuf)
            self.followers.add(runtime)
            try:
                return await runtime.serve(ws, dialect, resume_from, budget)
            finally:
                self.followers.discard(runtime)
        self.connections.add(runtime)
        try:
            socket = ClientSocket(ws, dialect, self.config.idle_timeout_s, budget)
            return await socket.serve(runtime, resume_from)
        finally:
            self.connections.discard(runtime)

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        tls = server_context(self.config)  # a bad TLS setup fails before anything starts
        if self.store is not None:
            await self.store.start(self.registry.on_forward)
        self._engine_task = asyncio.create_task(self.engine.start())
        self._engine_task.add_done_callback(_ignore_result)
        self._engine_task.add_done_callback(lambda _: COLLECTOR.freeze())
        self._engine_task.add_done_callback(self._check_priority_lanes)
        if self.heartbeat is not None:
            self.heartbeat.start()
        self.loop_watch.start()
        try:
            self._server = await self._listen(tls)
        except OSError as exc:
            with contextlib.suppress(Exception):
                await self.close()  # the engine may have begun to load; the lease is held
            raise ListenError(
                f"cannot listen on {self.config.host}:{self.config.port}: "
                f"{os.strerror(exc.errno) if exc.errno else exc} ({_listen_hint(exc)})"
            ) from exc
        log.info(
            "listening",
            url=f"{'wss' if tls else 'ws'}://{self.config.host}:{self.port}{REALTIME_PATH}",
            engine=self.engine.name,
        )

    async def _listen(self, tls: Any) -> Server:
        return await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=self._process_request,
            # Browsers send Origin; other clients send none and pass (None).
            origins=(
                [*(o.strip() for o in self.config.allowed_origins.split(",") if o.strip()), None]
                if self.config.allowed_origins
                else None
            ),
            select_subprotocol=lambda _, offered: select_subprotocol(offered),
            max_size=self.config.max_message_bytes,
            compression=None,  # per-message deflate costs CPU per token and memory per socket
            ping_interval=None,  # self.heartbeat pings
            # Inbound frames queued before websockets stops reading the socket.
            max_queue=self.config.max_inbound_frames,
            # A client that does not answer our close frame (often one that
            # stopped reading) is dropped after this long.
            close_timeout=2,
            # asyncio's default of 100 overflows when thousands of clients
            # (re)connect at once, e.g. after another instance drained.
            backlog=4096,
            # The HTTP routes share the port: https:// too with TLS.
            ssl=tls,
            # Reads the body of POST /v1/realtime/client_secrets (server/body.py).
            create_connection=BodyConnection.with_max_body(
                self.config.max_message_bytes,
                lambda path, auth: path == CLIENT_SECRETS_PATH and self.admission.may_mint(auth),
            ),
        )

    def _check_priority_lanes(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            return
        if self.admission.keys.has_priority_floors and not self.engine.capabilities.priority:
            log.warning(
                "priority_lanes_off",
                hint="API keys cap priorities, but the engine schedules first come, first "
                "served; start it with `-- --scheduling-policy priority`",
            )

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def wait_engine(self) -> None:
        if self._engine_task is not None:
            await asyncio.shield(self._engine_task)

    async def drain(self) -> None:
        """Graceful shutdown: accept nothing new, tell every client, let
        responses finish for up to --drain-timeout-s, then hand the rest over
        (with Redis) or end them."""
        # Still listening: /readyz says 503 and new WebSocket handshakes get
        # 503, so a load balancer moves on (nginx: proxy_next_upstream http_503).
        self.draining = True
        # With Redis another instance continues a session at once; without,
        # a new session on a restarted or other instance is the way on.
        retry_ms = 0 if self.store is not None else int(self.config.drain_timeout_s * 1000)
        for runtime in list(self.sessions.values()):
            if runtime.state is RuntimeState.ATTACHED:
                runtime.going_away("shutdown", retry_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        busy = self.registry.busy()
        log.info(
            "draining",
            sessions=len(self.sessions),
            active=busy,
            timeout_s=self.config.drain_timeout_s,
        )
        while busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
            busy = self.registry.busy()
        runtimes = list(self.sessions.values())
        await asyncio.gather(*(f.close() for f in list(self.followers)))
        failed: list[str] = []
        if self.store is not None:
            # Concurrently, and bounded: Redis may not answer.
            failed = await cluster.hand_over_all(runtimes, self.config.drain_timeout_s)
        else:
            await _written(runtimes, DRAIN_FLUSH_S)  # session.going_away, if nothing else
        for runtime in runtimes:
            await self.registry.end_session(runtime)
        if self.store is not None:
            await self.store.release()  # no lease: the others may take over now
        handed = len(runtimes) - len(failed) if self.store is not None else 0
        log.info("drained", handed_over=handed, not_handed_over=len(failed))

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for runtime in list(self.sessions.values()):
            await self.registry.end_session(runtime)
        await self.registry.settle(2.0)  # a mark or an end: one Redis command each
        self.registry.reclaimer.cancel()
        if self.heartbeat is not None:
            self.heartbeat.stop()
        self.loop_watch.stop()
        if self._engine_task is not None and not self._engine_task.done():
            self._engine_task.cancel()
        await self.engine.close()
        if self.store is not None:
            await self.store.close()

    async def serve_forever(self) -> None:
        await self.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("shutting_down")
        await self.drain()
        await self.close()


# A session in these states has no socket of this instance and nobody else's.
_OURS = frozenset({RuntimeState.NEW, RuntimeState.DETACHED})


async def _take(ws: ServerConnection, runtime: SessionRuntime) -> bool:
    """Wait until the session a socket resumes is free for it; False (the
    socket closed) if it ended meanwhile or another resume took it first."""
    if runtime.state is RuntimeState.ATTACHED and runtime.ws is not None:
        runtime.ws.transport.abort()  # its old socket is dead but did not know
    await until_detached(runtime)
    if runtime.state in GONE:
        await ws.close(1011, "the session ended while resuming")
        return False
    if runtime.state is RuntimeState.ATTACHED:
        # Two resumes waited for the same old socket: one socket per session.
        await ws.close(1011, "the session was resumed on another connection")
        return False
    return True


async def _failed(ws: ServerConnection, exc: Exception) -> None:
    """Something broke serving a connection: tell its client, which may retry."""
    if isinstance(exc, RedisError):
        log.warning("session_store_failed", error=str(exc) or type(exc).__name__)
        await close_or_abort(ws, CLOSE_TRY_AGAIN_LATER, STORE_UNAVAILABLE)
    else:
        log.exception("connection_failed")
        await close_or_abort(ws, 1011, "internal error")


def _ignore_result(task: asyncio.Task[None]) -> None:
    # The failure is logged and reported by the engine; don't warn twice.
    if not task.cancelled():
        task.exception()


async def _written(runtimes: list[SessionRuntime], timeout_s: float) -> None:
    """Until the live sockets' writers have sent what is queued (bounded): an
    ending session clears its queue, and an idle one's writer may not have run."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while loop.time() < deadline:
        if not any(r.delivery.live and r.delivery.outbox for r in runtimes):
            return
        await asyncio.sleep(0.01)
