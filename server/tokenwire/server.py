"""The WebSocket server: routing, subprotocol choice, lifecycle."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import os
import signal
import weakref
from collections.abc import Sequence
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from . import metrics
from .auth import KeyStore
from .config import ServerConfig
from .engines import Engine, create_engine
from .eventlog import resume_problem
from .follow import Follower
from .limits import KeyUsage, Limiter
from .logs import get_logger
from .protocol import (
    CLOSE_TRY_AGAIN_LATER,
    SUBPROTOCOLS,
    ErrorCode,
    ProtocolError,
    SessionResume,
)
from .redisstore import Meta, RedisStore
from .transport import Connection, Handoff, Runtime

log = get_logger("tokenwire.server")

REALTIME_PATH = "/v1/realtime"


PACKAGE_DIR = Path(__file__).resolve().parent
STATIC_DIR = PACKAGE_DIR / "static"
# The JS client's sources, served to the demo page with no build step: the
# repo's client_js/ by default, or wherever an image put it.
CLIENT_JS_DIR = Path(
    os.environ.get("TOKENWIRE_CLIENT_JS_DIR", PACKAGE_DIR.parent.parent / "client_js")
)
MOUNTS = {
    "/static/": STATIC_DIR,
    "/client/": CLIENT_JS_DIR / "src",
    "/vendor/msgpack/": CLIENT_JS_DIR / "node_modules" / "@msgpack" / "msgpack" / "dist.esm",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
    ".ts": "text/plain; charset=utf-8",
    ".map": "application/json",
}


def json_response(status: HTTPStatus, body: dict[str, Any]) -> Response:
    return http_response(status, json.dumps(body).encode(), "application/json")


def http_response(status: HTTPStatus, data: bytes, content_type: str) -> Response:
    headers = Headers(
        [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            ("Cache-Control", "no-store"),
            ("X-Content-Type-Options", "nosniff"),
        ]
    )
    return Response(status.value, status.phrase, headers, data)


def static_file(root: Path, relative: str) -> Response | None:
    """A file under `root`, never outside it."""
    try:
        target = (root / relative).resolve()
        if not target.is_relative_to(root.resolve()) or not target.is_file():
            return None
    except (OSError, ValueError):  # NUL bytes, names too long: not a file of ours
        return None
    kind = CONTENT_TYPES.get(target.suffix, "application/octet-stream")
    return http_response(HTTPStatus.OK, target.read_bytes(), kind)


class TokenwireServer:
    def __init__(self, config: ServerConfig, engine: Engine | None = None) -> None:
        self.config = config
        self.engine = engine or create_engine(config)
        self.connections: set[Connection] = set()  # sessions with a socket attached
        self.sessions: dict[str, Connection] = {}  # every live session, by id
        self._expiring: set[asyncio.Task[None]] = set()
        self.keys = KeyStore.load(config.api_keys_file, config.api_keys)
        self.limiter = Limiter(config.max_responses_per_key, config.tokens_per_s_per_key)
        # Handshakes that passed auth, waiting for their handler: connection -> key id.
        # Weak: a handshake that fails after auth never reaches its handler.
        self._accepted: weakref.WeakKeyDictionary[ServerConnection, str] = (
            weakref.WeakKeyDictionary()
        )
        self._server: Server | None = None
        self._engine_task: asyncio.Task[None] | None = None
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
        self.draining = False
        self.followers: set[Follower] = set()  # sockets following another instance's session

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
            "paused_connections": sum(c.paused for c in self.connections),
            "outbound_buffered_bytes": sum(c.buffered_amount for c in self.connections),
            "engine_load": {"running": load.running, "waiting": load.waiting, **load.extra},
        }

    def _process_request(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == REALTIME_PATH:
            return self._admit(conn, request)
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
        found = None
        if path == "/":
            found = static_file(STATIC_DIR, "index.html")
        for prefix, root in MOUNTS.items():
            if path.startswith(prefix):
                found = static_file(root, path[len(prefix) :])
        if found is not None:
            return found
        return json_response(
            HTTPStatus.NOT_FOUND,
            {"error": f"no route {path!r}; the WebSocket endpoint is {REALTIME_PATH}"},
        )

    def _admit(self, conn: ServerConnection, request: Request) -> Response | None:
        """Auth and connection limits, before the upgrade and before any work."""
        if self.draining:
            return json_response(
                HTTPStatus.SERVICE_UNAVAILABLE,
                {"error": {"code": "draining", "message": "this instance is shutting down"}},
            )
        offered = [
            p.strip()
            for header in request.headers.get_all("Sec-WebSocket-Protocol")
            for p in header.split(",")
        ]
        if self.keys.enabled:
            kid = self.keys.from_request(request.headers.get("Authorization"), offered)
            if kid is None:
                metrics.REJECTED.labels("unauthorized").inc()
                response = json_response(
                    HTTPStatus.UNAUTHORIZED,
                    {
                        "error": {
                            "code": "unauthorized",
                            "message": "present an API key as 'Authorization: Bearer <key>' or as "
                            "the subprotocol 'tokenwire.auth.<key>'",
                        }
                    },
                )
                response.headers["WWW-Authenticate"] = 'Bearer realm="tokenwire"'
                return response
        else:
            kid = "anonymous"
        usage = self.limiter.keys.get(kid)
        if len(self.connections) + len(self._accepted) >= self.config.max_connections or (
            usage is not None and usage.connections >= self.config.max_connections_per_key
        ):
            metrics.REJECTED.labels("too_many_connections").inc()
            return json_response(
                HTTPStatus.TOO_MANY_REQUESTS,
                {
                    "error": {
                        "code": "too_many_connections",
                        "message": "the connection limit is reached; retry later",
                    }
                },
            )
        self._accepted[conn] = kid
        return None  # go on with the WebSocket upgrade

    def _update_gauges(self) -> None:
        load = self.engine.load()
        metrics.ENGINE_QUEUE.labels("running").set(load.running)
        metrics.ENGINE_QUEUE.labels("waiting").set(load.waiting)
        metrics.OUTBOUND_BUFFERED.set(sum(c.buffered_amount for c in self.connections))

    @staticmethod
    def _select_subprotocol(conn: ServerConnection, offered: Sequence[str]) -> str | None:
        # The client's order wins; with none of ours offered we speak JSON.
        for name in offered:
            if name in SUBPROTOCOLS:
                return name
        return None

    # -- WebSocket ----------------------------------------------------------

    async def _handle(self, ws: ServerConnection) -> None:
        kid = self._accepted.pop(ws, "anonymous")
        usage = self.limiter.usage(kid)
        # Handshakes race; the count that matters is taken here.
        if (
            len(self.connections) >= self.config.max_connections
            or usage.connections >= self.config.max_connections_per_key
        ):
            self.limiter.forget_idle(kid)
            await ws.close(CLOSE_TRY_AGAIN_LATER, "too_many_connections")
            return
        usage.connections += 1
        metrics.CONNECTIONS.inc()
        runtime: Runtime = await self._new_session(usage, ws.subprotocol)
        resume_from: int | None = None
        try:
            while True:
                group: set[Any] = (
                    self.connections if isinstance(runtime, Connection) else self.followers
                )
                group.add(runtime)
                try:
                    outcome = await runtime.serve(ws, resume_from)
                finally:
                    group.discard(runtime)
                if not isinstance(outcome, Handoff):
                    break
                if isinstance(runtime, Connection):
                    # The socket resumes another session; the fresh one never ran.
                    await self._end_session(runtime)
                runtime, resume_from = outcome.target, outcome.last_seq
                if isinstance(runtime, Connection):
                    if runtime.state == "attached" and runtime.ws is not None:
                        runtime.ws.transport.abort()  # its old socket is dead but did not know
                    await runtime.detached.wait()
                    if runtime.state in ("ended", "handed_over"):
                        await ws.close(1011, "the session ended while resuming")
                        return
            if isinstance(runtime, Connection):
                if outcome == "lost" and self.config.resume_grace_s > 0 and not self.draining:
                    # Keep it for a resume; its generations go on meanwhile.
                    self._arm_expiry(runtime)
                elif runtime.state != "handed_over":
                    await self._end_session(runtime)
        finally:
            usage.connections -= 1
            metrics.CONNECTIONS.dec()
            self.limiter.forget_idle(kid)

    def _arm_expiry(self, runtime: Connection) -> None:
        if runtime.expiry is not None:
            runtime.expiry.cancel()
        runtime.expiry = asyncio.get_running_loop().call_later(
            self.config.resume_grace_s, self._expire, runtime
        )

    async def _new_session(
        self,
        usage: KeyUsage,
        subprotocol: str | None,
        restored: tuple[dict[str, Any], list[Any]] | None = None,
    ) -> Connection:
        runtime = Connection(
            self.engine, self.config, usage, self.find_session, subprotocol, self.store, restored
        )
        runtime.on_moved = self._forget
        self.sessions[runtime.session.id] = runtime
        if self.store is not None and restored is None:
            await self.store.register(runtime.session.id, usage.key_id)
        return runtime

    async def find_session(
        self, event: SessionResume, key_id: str | None, requester: Connection
    ) -> Runtime:
        """What serves a resume of `event.session_id` by this key: the local
        session, or (with Redis) a follower or a takeover of another
        instance's. Another key's session looks unknown."""
        sid = event.session_id
        runtime = self.sessions.get(sid)
        if runtime is requester:
            runtime = None
        if runtime is not None and runtime.state not in ("ended", "handed_over"):
            if runtime.key_id != key_id:
                raise _not_found(event)
            if problem := await runtime.check_resume(event.last_seq):
                raise _not_possible(event, problem)
            return runtime
        if self.store is None:
            raise _not_found(event)
        meta = await self.store.meta(sid)
        if meta is None or meta.key_id != (key_id or None):
            raise _not_found(event)
        bounds = await self.store.bounds(sid)
        if bounds is not None and (problem := resume_problem(event.last_seq, *bounds)):
            raise _not_possible(event, problem)
        if meta.owner != self.store.instance_id and await self.store.alive(meta.owner):
            return Follower(self.store, sid, meta.owner, self.config.lease_s / 2)
        taken = await self.take_over(sid, meta)
        if taken is None:
            raise _not_found(event)
        return taken

    async def take_over(self, sid: str, meta: Meta) -> Connection | None:
        """Continue a session whose owner (`meta.owner`) is gone, from its
        snapshot and log."""
        assert self.store is not None
        if not await self.store.claim(sid, meta.owner):
            return None
        loaded = await self.store.load(sid)
        if loaded is None:
            return None
        usage = self.limiter.usage(meta.key_id or "anonymous")
        runtime = await self._new_session(usage, None, loaded)
        runtime.log.info("session_taken_over", previous_owner=meta.owner)
        metrics.TAKEOVERS.inc()
        # Generations continue after the tokens the old owner logged; the
        # events they make are logged even before the client is attached.
        runtime.continue_restored()
        self._arm_expiry(runtime)
        return runtime

    async def _on_forward(self, sid: str, op: str, data: Any, follower: str) -> None:
        runtime = self.sessions.get(sid)
        if runtime is None or runtime.state in ("ended", "handed_over"):
            return
        if op != "attach" and follower != runtime.follower:
            return  # from a follower the client has left
        if op == "close":
            await self._end_session(runtime)
            return
        runtime.receive_forwarded(op, data, follower)
        if runtime.state in ("remote", "detached"):
            self._arm_expiry(runtime)  # the follower is alive: the grace period starts over

    async def _end_session(self, runtime: Connection) -> None:
        self._forget(runtime)
        if runtime.state == "handed_over":
            return  # it lives on elsewhere
        await runtime.end()
        if self.store is not None and runtime.state == "ended":
            await self.store.drop(runtime.session.id)

    def _forget(self, runtime: Connection) -> None:
        """The session ends here, or moved to another instance."""
        if self.sessions.get(runtime.session.id) is runtime:
            del self.sessions[runtime.session.id]
        if runtime.expiry is not None:
            runtime.expiry.cancel()

    def _expire(self, runtime: Connection) -> None:
        if runtime.state in ("detached", "remote"):
            runtime.log.info("resume_grace_over")
            task = asyncio.get_running_loop().create_task(self._end_session(runtime))
            self._expiring.add(task)
            task.add_done_callback(self._expiring.discard)

    # -- lifecycle ----------------------------------------------------------

    async def start(self) -> None:
        if self.store is not None:
            await self.store.start(self._on_forward)
        self._engine_task = asyncio.create_task(self.engine.start())
        self._engine_task.add_done_callback(_ignore_result)
        self._engine_task.add_done_callback(_freeze_heap)
        self._server = await serve(
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
            select_subprotocol=self._select_subprotocol,
            max_size=self.config.max_message_bytes,
            compression=None,  # per-message deflate costs CPU per token and memory per socket
            ping_interval=self.config.ping_interval_s,
            ping_timeout=self.config.ping_interval_s,
            # Inbound frames queued before websockets stops reading the socket.
            max_queue=self.config.max_inbound_frames,
            # A client that does not answer our close frame (often one that
            # stopped reading) is dropped after this long.
            close_timeout=2,
            # asyncio's default of 100 overflows when thousands of clients
            # (re)connect at once, e.g. after another instance drained.
            backlog=4096,
        )
        log.info(
            "listening",
            url=f"ws://{self.config.host}:{self.port}{REALTIME_PATH}",
            engine=self.engine.name,
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
            if runtime.state == "attached":
                runtime.going_away("shutdown", retry_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.drain_timeout_s
        busy = self._busy()
        log.info(
            "draining",
            sessions=len(self.sessions),
            active=busy,
            timeout_s=self.config.drain_timeout_s,
        )
        while busy and loop.time() < deadline:
            await asyncio.sleep(0.05)
            busy = self._busy()
        runtimes = list(self.sessions.values())
        await asyncio.gather(*(f.close() for f in list(self.followers)))
        if self.store is not None:
            # Concurrently: each waits up to a few seconds for its socket.
            await asyncio.gather(*(r.hand_over() for r in runtimes), return_exceptions=True)
        for runtime in runtimes:
            await self._end_session(runtime)
        if self.store is not None:
            await self.store.release()  # no lease: the others may take over now
        log.info("drained", handed_over=busy if self.store is not None else 0)

    def _busy(self) -> int:
        return sum(
            len(r.session.active_responses)
            for r in self.sessions.values()
            if r.state != "handed_over"
        )

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
        for runtime in list(self.sessions.values()):
            await self._end_session(runtime)
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


def _not_possible(event: SessionResume, problem: str) -> ProtocolError:
    return ProtocolError(
        ErrorCode.RESUME_NOT_POSSIBLE, problem, event_id=event.event_id, param="last_seq"
    )


def _not_found(event: SessionResume) -> ProtocolError:
    return ProtocolError(
        ErrorCode.SESSION_NOT_FOUND,
        f"no session {event.session_id!r} to resume (unknown, or its grace period ended); "
        "start a new session",
        event_id=event.event_id,
        param="session_id",
    )


def _freeze_heap(_: asyncio.Task[None]) -> None:
    # What is loaded by now (the model, libraries) lives for the whole process:
    # keep it out of every later garbage collection, as vLLM's own server does.
    gc.collect()
    gc.freeze()
    # Per-token objects (events, futures, tasks) live for milliseconds; with
    # the default 700 allocations per young collection many of them get
    # promoted, and at thousands of sessions full collections of the whole
    # heap (600-800 ms, measured at 10k sessions) stall the event loop.
    gc.set_threshold(50_000, 20, 100)


def _ignore_result(task: asyncio.Task[None]) -> None:
    # The failure is logged and reported by the engine; don't warn twice.
    if not task.cancelled():
        task.exception()
