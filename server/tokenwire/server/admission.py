"""Admission: API keys, checked at the WebSocket handshake before any work,
and the per-key limits every session of a key shares.

Keys come from a file (one per line, `#` comments) and/or the environment.
A client presents one as `Authorization: Bearer <key>` or, since browsers
cannot set headers, as the subprotocol entry `tokenwire.auth.<key>`. Keys are
kept only as SHA-256 digests and logged only as a short key id.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from .. import metrics
from ..config import ServerConfig
from ..core.errors import ErrorCode
from ..core.limits import TokenBucket
from .http import error_response

AUTH_SUBPROTOCOL_PREFIX = "tokenwire.auth."


def key_id(key: str) -> str:
    """A stable, non-secret name for a key, for logs and metrics."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:8]


class KeyFileError(ValueError):
    """A key entry tokenwire cannot read; the message says which and why."""


# Options a key entry may carry after the key: `KEY min_priority=10`.
KEY_OPTIONS = {"min_priority": int}


def parse_key_entry(line: str) -> tuple[str, dict[str, int]] | None:
    """`KEY [name=value ...]`; None for a blank line or a comment."""
    line = line.strip()
    if not line or line.startswith("#"):
        return None
    key, *rest = line.split()
    options: dict[str, int] = {}
    for item in rest:
        name, sep, value = item.partition("=")
        if not sep or name not in KEY_OPTIONS:
            raise KeyFileError(
                f"key {key_id(key)}: unknown option {item!r}; known: "
                f"{', '.join(f'{n}=N' for n in KEY_OPTIONS)}"
            )
        try:
            options[name] = KEY_OPTIONS[name](value)
        except ValueError:
            raise KeyFileError(f"key {key_id(key)}: {name} must be an integer") from None
    return key, options


class KeyStore:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests: dict[bytes, str] = {}
        self._options: dict[str, dict[str, int]] = {}  # key id -> options
        for line in keys:
            entry = parse_key_entry(line)
            if entry is not None:
                key, options = entry
                kid = key_id(key)
                self._digests[hashlib.sha256(key.encode()).digest()] = kid
                self._options[kid] = options

    def min_priority(self, kid: str) -> int | None:
        """The best (lowest) priority this key's sessions may ask for."""
        return self._options.get(kid, {}).get("min_priority")

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

    def from_request(self, authorization: str | None, subprotocols: Iterable[str]) -> str | None:
        """The presented key's id, from the header or a subprotocol entry."""
        if authorization:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() == "bearer":
                return self.verify(token.strip())
        for entry in subprotocols:
            if entry.startswith(AUTH_SUBPROTOCOL_PREFIX):
                return self.verify(entry[len(AUTH_SUBPROTOCOL_PREFIX) :])
        return None


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
    min_priority: int | None = None  # see KeyStore.min_priority

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

    def usage(self, key_id: str) -> KeyUsage:
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
            )
        return usage

    def forget_idle(self, key_id: str) -> None:
        usage = self.keys.get(key_id)
        if usage is not None and usage.connections == 0 and usage.responses == 0:
            del self.keys[key_id]


class Admission:
    """Auth and connection limits at the handshake, before the upgrade and
    before any work; then the key's usage for the connection's lifetime."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.keys = KeyStore.load(config.api_keys_file, config.api_keys)
        self.limiter = Limiter(config.max_responses_per_key, config.tokens_per_s_per_key, self.keys)
        # Handshakes that passed auth, waiting for their handler: connection -> key id.
        # Weak: a handshake that fails after auth never reaches its handler.
        self._accepted: weakref.WeakKeyDictionary[ServerConnection, str] = (
            weakref.WeakKeyDictionary()
        )

    def admit(
        self, conn: ServerConnection, request: Request, connections: int, draining: bool
    ) -> Response | None:
        """None to go on with the upgrade, or the HTTP refusal."""
        if draining:
            return error_response(
                HTTPStatus.SERVICE_UNAVAILABLE, "draining", "this instance is shutting down"
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
                response = error_response(
                    HTTPStatus.UNAUTHORIZED,
                    "unauthorized",
                    "present an API key as 'Authorization: Bearer <key>' or as the subprotocol "
                    "'tokenwire.auth.<key>'",
                )
                response.headers["WWW-Authenticate"] = 'Bearer realm="tokenwire"'
                return response
        else:
            kid = "anonymous"
        usage = self.limiter.keys.get(kid)
        if connections + len(self._accepted) >= self.config.max_connections or (
            usage is not None and usage.connections >= self.config.max_connections_per_key
        ):
            metrics.REJECTED.labels("too_many_connections").inc()
            return error_response(
                HTTPStatus.TOO_MANY_REQUESTS,
                "too_many_connections",
                "the connection limit is reached; retry later",
            )
        self._accepted[conn] = kid
        return None

    def connect(self, ws: ServerConnection, connections: int) -> KeyUsage | None:
        """The usage an upgraded connection counts against, or None if the
        limits filled up meanwhile (handshakes race; this count is the one
        that matters)."""
        kid = self._accepted.pop(ws, "anonymous")
        usage = self.limiter.usage(kid)
        if (
            connections >= self.config.max_connections
            or usage.connections >= self.config.max_connections_per_key
        ):
            self.limiter.forget_idle(kid)
            return None
        usage.connections += 1
        metrics.CONNECTIONS.inc()
        return usage

    def disconnect(self, usage: KeyUsage) -> None:
        usage.connections -= 1
        metrics.CONNECTIONS.dec()
        self.limiter.forget_idle(usage.key_id)
