"""Admission: API keys, checked at the WebSocket handshake before any work,
and the per-key limits every session of a key shares.

Keys come from a file (one per line, `#` comments) and/or the environment.
A client presents one as `Authorization: Bearer <key>` or, since browsers
cannot set headers, as the subprotocol entry `tokenwire.auth.<key>` or
`openai-insecure-api-key.<key>` (what OpenAI's JS SDK sends). Keys are kept
only as SHA-256 digests and logged only as a short key id. A client secret
(`ek_...`, server/client_secrets.py) is presented the same ways and counts
as the key that minted it. OpenAI's beta Realtime dialect is refused here.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import weakref
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from .. import metrics
from ..config import ServerConfig
from ..core.errors import ErrorCode
from ..core.limits import TokenBucket
from .client_secrets import ClientSecrets, SecretsUnavailable, is_client_secret
from .client_secrets import unavailable_response as secrets_unavailable
from .http import error_response

AUTH_SUBPROTOCOL_PREFIX = "tokenwire.auth."
# OpenAI's JS SDK in a browser offers `realtime` and this entry with its key.
OPENAI_AUTH_SUBPROTOCOL_PREFIX = "openai-insecure-api-key."
AUTH_PREFIXES = (AUTH_SUBPROTOCOL_PREFIX, OPENAI_AUTH_SUBPROTOCOL_PREFIX)
# OpenAI's beta Realtime dialect (its SDKs' `beta.realtime`) announces itself so.
BETA_SUBPROTOCOL = "openai-beta.realtime-v1"
BETA_HEADER_VALUE = "realtime=v1"  # in `OpenAI-Beta`, a comma-separated list


def key_id(key: str) -> str:
    """A stable, non-secret name for a key, for logs and metrics."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:8]


def presented_key(authorization: str | None, subprotocols: Iterable[str]) -> str | None:
    """The key a client presents: a Bearer header, else an auth subprotocol entry."""
    if authorization:
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() == "bearer":
            return token.strip()
    for entry in subprotocols:
        for prefix in AUTH_PREFIXES:
            if entry.startswith(prefix):
                return entry[len(prefix) :]
    return None


class KeyFileError(ValueError):
    """A key entry tokenwire cannot read; the message says which and why."""


def _set_name(value: str) -> str:
    if not value or not all(c.isalnum() or c in "_.-" for c in value):
        raise ValueError("must be a name (letters, digits, _ . -)")
    return value


def _salt(value: str) -> str:
    if not 0 < len(value) <= 128 or not value.isprintable():
        raise ValueError("must be 1 to 128 printable characters")
    return value


def _integer(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ValueError("must be an integer") from None


# Options a key entry may carry after the key, with how each reads its value:
# `KEY min_priority=10 guardrails=strict cache_salt=acme` (a --guardrail-set,
# or `none`; keys with different salts never share vLLM prefix-cache blocks).
KEY_OPTIONS: dict[str, Callable[[str], Any]] = {
    "min_priority": _integer,
    "guardrails": _set_name,
    "cache_salt": _salt,
}
_OPTION_FORMS = {
    "min_priority": "min_priority=N",
    "guardrails": "guardrails=NAME",
    "cache_salt": "cache_salt=SALT",
}


def parse_key_entry(line: str) -> tuple[str, dict[str, Any]] | None:
    """`KEY [name=value ...]`; None for a blank line or a comment."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    key, *rest = line.split()
    options: dict[str, Any] = {}
    for item in rest:
        name, sep, value = item.partition("=")
        if not sep or name not in KEY_OPTIONS:
            raise KeyFileError(
                f"key {key_id(key)}: unknown option {item!r}; known: "
                f"{', '.join(_OPTION_FORMS[n] for n in KEY_OPTIONS)}"
            )
        try:
            options[name] = KEY_OPTIONS[name](value)
        except ValueError as exc:
            raise KeyFileError(f"key {key_id(key)}: {name} {exc}") from None
    return key, options


class KeyStore:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests: dict[bytes, str] = {}
        self._options: dict[str, dict[str, Any]] = {}  # key id -> options
        for line in keys:
            entry = parse_key_entry(line)
            if entry is not None:
                key, options = entry
                kid = key_id(key)
                if kid in self._options:
                    # Limits and options are kept per id: two keys under one
                    # (the same key twice, or 1 in 2^32 pairs) would share them.
                    raise KeyFileError(
                        f"key {kid}: listed twice, or another key has the same id "
                        "(the first 32 bits of its SHA-256); keep one entry per key, "
                        "or replace one of the two keys"
                    )
                self._digests[hashlib.sha256(key.encode()).digest()] = kid
                self._options[kid] = options

    def min_priority(self, kid: str) -> int | None:
        """The best (lowest) priority this key's sessions may ask for."""
        return self._options.get(kid, {}).get("min_priority")

    def cache_salt(self, kid: str) -> str | None:
        """vLLM's cache_salt for this key's requests: its prefix cache is its own."""
        return self._options.get(kid, {}).get("cache_salt")

    def guardrail_set(self, kid: str) -> str | None:
        """The named guardrail set this key's sessions get (None: the default)."""
        return self._options.get(kid, {}).get("guardrails")

    @property
    def guardrail_sets(self) -> set[str]:
        """Every set a key names, to check against the configured ones."""
        return {o["guardrails"] for o in self._options.values() if "guardrails" in o}

    @property
    def has_priority_floors(self) -> bool:
        return any("min_priority" in o for o in self._options.values())

    @classmethod
    def load(cls, path: str | None, env_keys: str | None) -> KeyStore:
        keys: list[str] = []
        if path:
            keys += Path(path).read_text().splitlines()
        if env_keys:
            keys += env_keys.split(",")
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def __len__(self) -> int:
        return len(self._digests)

    def verify(self, key: str | None) -> str | None:
        """The key's id if it is one of ours, else None."""
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        for known, kid in self._digests.items():
            if hmac.compare_digest(known, digest):
                return kid
        return None

    def knows(self, kid: str) -> bool:
        return kid in self._options

    def from_request(self, authorization: str | None, subprotocols: Iterable[str]) -> str | None:
        """The presented key's id, from the header or a subprotocol entry."""
        return self.verify(presented_key(authorization, subprotocols))


def is_loopback(host: str) -> bool:
    if host in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


@dataclass
class KeyUsage:
    """What one API key (or, without keys, the whole server) is using now."""

    key_id: str
    max_responses: int
    tokens: TokenBucket | None
    connections: int = 0
    responses: int = 0
    sessions: int = 0  # live sessions, attached or awaiting a resume (server.registry)
    min_priority: int | None = None  # see KeyStore.min_priority
    cache_salt: str | None = None  # see KeyStore.cache_salt

    def acquire_response(self) -> tuple[ErrorCode, str] | None:
        """Reserve a response slot, or say why not."""
        if self.responses >= self.max_responses:
            return (
                ErrorCode.TOO_MANY_RESPONSES,
                f"this API key already runs {self.responses} responses, its limit",
            )
        if self.tokens is not None and not self.tokens.ready():
            return (
                ErrorCode.RATE_LIMIT_EXCEEDED,
                f"this API key is over its token rate; retry in "
                f"{self.tokens.retry_after_s():.1f} s",
            )
        self.responses += 1
        return None

    def hold_response(self) -> None:
        self.responses += 1

    def release_response(self) -> None:
        self.responses -= 1

    def spend_tokens(self, n: int) -> None:
        if self.tokens is not None and n:
            self.tokens.debit(n)


class Limiter:
    """Per-key usage, created on first use."""

    def __init__(
        self,
        max_responses_per_key: int,
        tokens_per_s_per_key: float,
        key_store: KeyStore | None = None,
    ) -> None:
        self.max_responses = max_responses_per_key
        self.tokens_per_s = tokens_per_s_per_key
        self.key_store = key_store
        self.keys: dict[str, KeyUsage] = {}
        # Idle keys kept only for their token debt: dropped once it is paid.
        self._in_debt: set[str] = set()

    def usage(self, key_id: str) -> KeyUsage:
        if self._in_debt:
            for idle in list(self._in_debt):
                self.forget_idle(idle)
        usage = self.keys.get(key_id)
        if usage is None:
            bucket = None
            if self.tokens_per_s > 0:
                bucket = TokenBucket(self.tokens_per_s, burst=self.tokens_per_s * 2)
            usage = self.keys[key_id] = KeyUsage(
                key_id,
                self.max_responses,
                bucket,
                min_priority=self.key_store.min_priority(key_id) if self.key_store else None,
                cache_salt=self.key_store.cache_salt(key_id) if self.key_store else None,
            )
        return usage

    def forget_idle(self, key_id: str) -> None:
        """Drop a key's record once a fresh one would be the same: no socket,
        no session (one awaiting a resume holds it too: its key's sessions
        share one record) and no token debt (else reconnecting forgives it)."""
        self._in_debt.discard(key_id)
        usage = self.keys.get(key_id)
        if usage is None or usage.connections or usage.responses or usage.sessions:
            return
        if usage.tokens is None or usage.tokens.full():
            del self.keys[key_id]
        else:
            self._in_debt.add(key_id)  # the next key's arrival looks again


def unauthorized(message: str, handshake: bool = True) -> Response:
    if handshake:  # not a refused mint: the metric counts handshakes
        metrics.REJECTED.labels("unauthorized").inc()
    response = error_response(HTTPStatus.UNAUTHORIZED, "unauthorized", message)
    response.headers["WWW-Authenticate"] = 'Bearer realm="tokenwire"'
    return response


NO_KEY = (
    "present an API key (or a client secret, ek_...) as 'Authorization: Bearer <key>' or as "
    "the subprotocol 'tokenwire.auth.<key>' or 'openai-insecure-api-key.<key>'"
)


def beta_refusal(headers: Any, offered: list[str]) -> Response | None:
    """A 400 for OpenAI's beta Realtime dialect, which tokenwire does not speak;
    GA clients send neither signal."""
    beta_header = any(
        entry.strip().lower() == BETA_HEADER_VALUE
        for value in headers.get_all("OpenAI-Beta")
        for entry in value.split(",")
    )
    if not beta_header and BETA_SUBPROTOCOL not in offered:
        return None
    metrics.REJECTED.labels("beta_not_supported").inc()
    return error_response(
        HTTPStatus.BAD_REQUEST,
        "beta_not_supported",
        "tokenwire speaks the GA OpenAI Realtime API, not the beta one: drop the "
        "'OpenAI-Beta: realtime=v1' header and the 'openai-beta.realtime-v1' subprotocol "
        "(with the openai SDK, use client.realtime, not client.beta.realtime)",
    )


@dataclass(frozen=True, slots=True)
class Grant:
    """What a handshake's credential admits: the key it counts against, and the
    session settings a client secret carries."""

    key_id: str
    settings: dict[str, Any] | None = None


class Admission:
    """Auth and connection limits at the handshake, before the upgrade and
    before any work; then the key's usage for the connection's lifetime."""

    def __init__(self, config: ServerConfig, secrets: ClientSecrets | None = None) -> None:
        self.config = config
        self.keys = KeyStore.load(config.api_keys_file, config.api_keys)
        self.limiter = Limiter(config.max_responses_per_key, config.tokens_per_s_per_key, self.keys)
        self.secrets = secrets or ClientSecrets(None, {})
        # Handshakes that passed auth, waiting for their handler: connection -> grant.
        # Weak: a handshake that fails after auth never reaches its handler.
        self._accepted: weakref.WeakKeyDictionary[ServerConnection, Grant] = (
            weakref.WeakKeyDictionary()
        )

    def admit(
        self, conn: ServerConnection, request: Request, connections: int, draining: bool
    ) -> Response | Awaitable[Response | None] | None:
        """None to go on with the upgrade, or the HTTP refusal. A client secret
        is looked up asynchronously (Redis); an API key stays on this sync path."""
        if draining:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, "draining", "this instance is shutting down"
            )
        offered = [
            p.strip()
            for header in request.headers.get_all("Sec-WebSocket-Protocol")
            for p in header.split(",")
        ]
        refusal = beta_refusal(request.headers, offered)
        if refusal is not None:
            return refusal
        key = presented_key(request.headers.get("Authorization"), offered)
        kid = self.keys.verify(key) if self.keys.enabled else None
        if kid is None and is_client_secret(key):
            assert key is not None
            return self._admit_secret(conn, key, connections)
        if kid is None and self.keys.enabled:
            return unauthorized(NO_KEY)
        return self._limit(conn, Grant(kid or "anonymous"), connections)

    async def _admit_secret(
        self, conn: ServerConnection, key: str, connections: int
    ) -> Response | None:
        try:
            secret = await self.secrets.lookup(key)
        except SecretsUnavailable:
            return secrets_unavailable()
        # Unknown, expired, or minted by a key this server no longer has.
        if secret is None or (self.keys.enabled and not self.keys.knows(secret.key_id)):
            return unauthorized(
                "this client secret is unknown or has expired; mint a new one at "
                "POST /v1/realtime/client_secrets"
            )
        kid = secret.key_id if self.keys.enabled else "anonymous"
        return self._limit(conn, Grant(kid, secret.settings), connections)

    def _limit(self, conn: ServerConnection, grant: Grant, connections: int) -> Response | None:
        usage = self.limiter.keys.get(grant.key_id)
        if connections + self._handshaking() >= self.config.max_connections or (
            usage is not None and usage.connections >= self.config.max_connections_per_key
        ):
            metrics.REJECTED.labels("too_many_connections").inc()
            return error_response(
                HTTPStatus.TOO_MANY_REQUESTS,
                "too_many_connections",
                "the connection limit is reached; retry later",
            )
        self._accepted[conn] = grant
        return None

    def _handshaking(self) -> int:
        """Handshakes admitted and still under way: one websockets refused after
        us (a bad Origin) is gone, though its entry waits for the collector."""
        return sum(
            1 for c in self._accepted if c.transport is not None and not c.transport.is_closing()
        )

    def may_mint(self, authorization: str | None) -> bool:
        """Whether a mint with this header would pass auth: its body is read then only."""
        return self._minter(authorization) is not None

    def _minter(self, authorization: str | None) -> str | None:
        """The key a mint counts against (anonymous without keys); None: refused."""
        if not self.keys.enabled:
            return "anonymous"
        return self.keys.verify(presented_key(authorization, ()))

    def mint(self, request: Request, body: bytes | None) -> Response | Awaitable[Response]:
        """`POST /v1/realtime/client_secrets`: needs a server API key (not a
        client secret) when the server has keys; mints anonymously without."""
        kid = self._minter(request.headers.get("Authorization"))
        if kid is None:
            return unauthorized(
                "minting a client secret needs a server API key as "
                "'Authorization: Bearer <key>' (a client secret cannot mint another)",
                handshake=False,
            )
        return self.secrets.mint(kid, body, self.keys.min_priority(kid))

    def connect(
        self, ws: ServerConnection, connections: int
    ) -> tuple[KeyUsage, dict[str, Any] | None] | None:
        """The usage an upgraded connection counts against and the settings its
        session starts with, or None if the limits filled up meanwhile
        (handshakes race; this count is the one that matters)."""
        grant = self._accepted.pop(ws, None) or Grant("anonymous")
        usage = self.limiter.usage(grant.key_id)
        if (
            connections >= self.config.max_connections
            or usage.connections >= self.config.max_connections_per_key
        ):
            self.limiter.forget_idle(grant.key_id)
            metrics.REJECTED.labels("too_many_connections").inc()  # closed 1013
            return None
        usage.connections += 1
        metrics.CONNECTIONS.inc()
        return usage, grant.settings

    def disconnect(self, usage: KeyUsage) -> None:
        usage.connections -= 1
        metrics.CONNECTIONS.dec()
        self.limiter.forget_idle(usage.key_id)
