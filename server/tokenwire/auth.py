"""API keys, checked at the WebSocket handshake, before any work.

Keys come from a file (one per line, `#` comments) and/or the environment.
A client presents one as `Authorization: Bearer <key>` or, since browsers
cannot set headers, as the subprotocol entry `tokenwire.auth.<key>`. Keys are
kept only as SHA-256 digests and logged only as a short key id.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Iterable
from pathlib import Path

AUTH_SUBPROTOCOL_PREFIX = "tokenwire.auth."


def key_id(key: str) -> str:
    """A stable, non-secret name for a key, for logs and metrics."""
    return "key_" + hashlib.sha256(key.encode()).hexdigest()[:8]


class KeyStore:
    def __init__(self, keys: Iterable[str] = ()) -> None:
        self._digests: dict[bytes, str] = {}
        for key in keys:
            key = key.strip()
            if key and not key.startswith("#"):
                self._digests[hashlib.sha256(key.encode()).digest()] = key_id(key)

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
