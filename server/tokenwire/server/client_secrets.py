"""Client secrets: short-lived `ek_` keys a browser holds instead of an API key.

`POST /v1/realtime/client_secrets`, as OpenAI's GA Realtime API has it. Request
(both fields optional): `{"expires_after": {"anchor": "created_at", "seconds":
N}, "session": {GA session settings}}`; response: `{"value": "ek_...",
"expires_at": <unix s>, "session": {the session as GA shows it}}`. An app
backend mints one with its API key and hands it to the browser, which connects
with it as `Authorization: Bearer ek_...` or as the subprotocol entry
`openai-insecure-api-key.ek_...` or `tokenwire.auth.ek_...`.

- A secret starts any number of sessions until it expires (10 s to 2 h, 600 s by
  default, OpenAI's bounds); a session that started goes on after that.
- It counts against the key that minted it: the same key id for limits, metrics
  and resume. Removing that key from the server revokes its secrets too.
- Session settings given at mint time are checked then (the GA dialect's
  translation, then the core's schema) and applied to each session that starts
  with the secret, before session.created; the client may change them after.
- Kept by SHA-256 digest only: in this process, or with --redis-url in Redis
  (`RedisStore.put_secret`, expiring with it) so that every instance takes it.
  In this process live secrets may hold at most MEMORY_BUDGET bytes of mint
  requests (settings can be large); past half of that, a key holding more than
  1/KEY_SHARE of it mints no more (so one tenant cannot shut minting off for
  the others): beyond that, minting answers 429 until some expire. In Redis,
  Redis's own maxmemory is the bound.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from redis.exceptions import RedisError
from websockets.http11 import Response

from .. import metrics
from ..core.errors import ErrorCode, ProtocolError
from ..core.schema import SessionUpdate, parse_client_event
from ..core.tools import check_tool_choice
from ..logs import get_logger
from ..storage.redis import RedisStore
from ..wire.codec import decode_frame
from ..wire.openai_errors import ga_error
from ..wire.openai_realtime import OpenAIRealtime, ga_session
from .http import error_response, json_response

log = get_logger("tokenwire.server")

PREFIX = "ek_"
DEFAULT_TTL_S = 600
MIN_TTL_S = 10
MAX_TTL_S = 7200
MEMORY_BUDGET = 64 << 20  # bytes of mint requests live secrets may hold in this process
KEY_SHARE = 8  # one key's secrets may hold at most 1/KEY_SHARE of it
_RECORD_BYTES = 256  # what a secret costs besides its request body, roughly


def is_client_secret(key: str | None) -> bool:
    return bool(key) and key.startswith(PREFIX)  # type: ignore[union-attr]


def digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()


@dataclass(frozen=True, slots=True)
class ClientSecret:
    key_id: str  # of the API key that minted it ("anonymous" without keys)
    expires_at: int  # unix seconds
    settings: dict[str, Any] | None  # internal session settings, already checked


class MintError(Exception):
    """A mint request refused, with its HTTP status and a stable code."""

    def __init__(
        self, status: HTTPStatus, code: str, message: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    def response(self) -> Response:
        return error_response(self.status, self.code, self.message, self.param)


class SecretsUnavailable(Exception):
    """The shared store (Redis) did not answer."""


def _invalid(param: str, message: str) -> MintError:
    return MintError(HTTPStatus.BAD_REQUEST, "invalid_value", message, param)


def _unknown_keys(obj: dict[str, Any], allowed: set[str], prefix: str) -> None:
    for name in obj:
        if name not in allowed:
            param = f"{prefix}{name}"
            raise MintError(
                HTTPStatus.BAD_REQUEST, "unknown_parameter", f"Unknown parameter: '{param}'.", param
            )


def parse_ttl(raw: Any) -> int:
    """`expires_after` as seconds from now."""
    if raw is None:
        return DEFAULT_TTL_S
    if not isinstance(raw, dict):
        raise _invalid("expires_after", "expires_after must be an object")
    _unknown_keys(raw, {"anchor", "seconds"}, "expires_after.")
    if raw.get("anchor", "created_at") != "created_at":
        raise _invalid("expires_after.anchor", 'the only anchor is "created_at"')
    seconds = raw.get("seconds", DEFAULT_TTL_S)
    if isinstance(seconds, bool) or not isinstance(seconds, int):
        raise _invalid("expires_after.seconds", "expires_after.seconds must be an integer")
    if not MIN_TTL_S <= seconds <= MAX_TTL_S:
        raise _invalid(
            "expires_after.seconds",
            f"expires_after.seconds must be between {MIN_TTL_S} and {MAX_TTL_S}, got {seconds}",
        )
    return seconds


def parse_settings(raw: Any, min_priority: int | None) -> dict[str, Any] | None:
    """GA session settings as checked internal ones, refused as a session.update
    over the GA dialect would be."""
    if raw is None:
        return None
    try:
        frame = json.dumps({"type": "session.update", "session": raw})
        event = parse_client_event(OpenAIRealtime().parse(frame))
        assert isinstance(event, SessionUpdate)
        settings = event.session.given()
        check_tool_choice(
            settings.get("tool_choice", "auto"),
            settings.get("tools", []),
            None,
            "session.tool_choice",
        )
    except RecursionError:
        raise _invalid("session", "session is nested too deeply") from None
    except ProtocolError as exc:
        error = ga_error(exc.to_event()["error"])
        raise MintError(
            HTTPStatus.BAD_REQUEST, error["code"], error["message"], error["param"]
        ) from None
    priority = settings.get("priority")
    if priority is not None and min_priority is not None and priority < min_priority:
        raise MintError(
            HTTPStatus.BAD_REQUEST,
            str(ErrorCode.PRIORITY_NOT_ALLOWED),
            f"priority {priority} is not allowed for this API key; its best is {min_priority} "
            "(a lower value runs first)",
            "session.priority",
        )
    return settings


def parse_request(
    body: bytes | None, min_priority: int | None
) -> tuple[int, dict[str, Any] | None]:
    """The TTL and the session settings of a mint request."""
    data: Any = {}
    if body:
        try:
            data = decode_frame(body.decode())
        except (UnicodeDecodeError, ProtocolError):
            raise MintError(
                HTTPStatus.BAD_REQUEST, "invalid_json", "the body must be a JSON object (UTF-8)"
            ) from None
    if not isinstance(data, dict):
        raise MintError(HTTPStatus.BAD_REQUEST, "invalid_json", "the body must be a JSON object")
    _unknown_keys(data, {"expires_after", "session"}, "")
    return parse_ttl(data.get("expires_after")), parse_settings(data.get("session"), min_priority)


class ClientSecrets:
    """Mints secrets and looks them up: in this process, or in Redis."""

    def __init__(
        self,
        store: RedisStore | None,
        session_defaults: dict[str, Any],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.session_defaults = session_defaults  # what the GA echo shows as unset
        self.clock = clock
        self._memory: dict[str, tuple[ClientSecret, int]] = {}  # digest -> (secret, bytes)
        self._memory_bytes = 0
        self._key_bytes: Counter[str] = Counter()

    async def mint(self, key_id: str, body: bytes | None, min_priority: int | None) -> Response:
        """The answer to a mint request by `key_id` (already authenticated)."""
        try:
            ttl_s, settings = parse_request(body, min_priority)
            value = PREFIX + secrets.token_urlsafe(32)
            secret = ClientSecret(key_id, int(self.clock()) + ttl_s, settings)
            await self._put(digest(value), secret, ttl_s, len(body or b"") + _RECORD_BYTES)
        except MintError as exc:
            return exc.response()
        except SecretsUnavailable:
            return unavailable_response()
        metrics.CLIENT_SECRETS.inc()
        log.info("client_secret_minted", key_id=key_id, ttl_s=ttl_s, settings=bool(settings))
        session = ga_session({**self.session_defaults, **(settings or {})})
        return json_response(
            HTTPStatus.OK, {"value": value, "expires_at": secret.expires_at, "session": session}
        )

    async def lookup(self, value: str) -> ClientSecret | None:
        """The secret if it exists and has not expired; SecretsUnavailable if
        Redis did not answer."""
        key = digest(value)
        if self.store is None:
            secret = self._memory.get(key, (None, 0))[0]
        else:
            try:
                record = await self.store.secret(key)
            except RedisError as exc:
                raise SecretsUnavailable(str(exc)) from None
            secret = None if record is None else ClientSecret(*record)
        if secret is None or self.clock() >= secret.expires_at:
            return None
        return secret

    async def _put(self, key: str, secret: ClientSecret, ttl_s: int, size: int) -> None:
        if self.store is not None:
            try:
                await self.store.put_secret(
                    key, [secret.key_id, secret.expires_at, secret.settings], ttl_s
                )
            except RedisError as exc:
                raise SecretsUnavailable(str(exc)) from None
            return
        kid = secret.key_id
        if not self._fits(kid, size):
            self._prune()  # expired ones go in bulk, only when a budget is reached
            if not self._fits(kid, size):
                raise MintError(
                    HTTPStatus.TOO_MANY_REQUESTS,
                    "too_many_client_secrets",
                    "this server holds as many client secrets as it keeps in memory"
                    + ("" if self._memory_bytes + size > MEMORY_BUDGET else " for one API key")
                    + "; retry when some have expired",
                )
        self._memory[key] = (secret, size)
        self._memory_bytes += size
        self._key_bytes[kid] += size

    def _fits(self, key_id: str, size: int) -> bool:
        total = self._memory_bytes + size
        # The share binds only past half the store: one key alone (or none:
        # every mint anonymous) may fill it.
        return total <= MEMORY_BUDGET and (
            total <= MEMORY_BUDGET // 2
            or self._key_bytes[key_id] + size <= MEMORY_BUDGET // KEY_SHARE
        )

    def _prune(self) -> None:
        now = self.clock()
        self._memory = {k: v for k, v in self._memory.items() if v[0].expires_at > now}
        self._memory_bytes = sum(size for _, size in self._memory.values())
        self._key_bytes = Counter()
        for secret, size in self._memory.values():
            self._key_bytes[secret.key_id] += size


def unavailable_response() -> Response:
    return error_response(
        HTTPStatus.SERVICE_UNAVAILABLE,
        "client_secrets_unavailable",
        "client secrets are kept in Redis, which did not answer; retry later",
    )
