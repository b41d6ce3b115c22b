"""TLS on the server's one port: wss:// for /v1/realtime and https:// for the
HTTP routes, with no proxy in front."""

from __future__ import annotations

import ssl

from ..config import ServerConfig


class TLSError(ValueError):
    """A TLS setting tokenwire cannot use; the message says which and why."""


def _no_passphrase() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal, which a
    # server must never do.
    raise TLSError("the private key is encrypted; give an unencrypted key file")


def server_context(config: ServerConfig) -> ssl.SSLContext | None:
    """The context for `--ssl-certfile`/`--ssl-keyfile`, or None for plain ws://."""
    certfile, keyfile = config.ssl_certfile, config.ssl_keyfile
    if not certfile and not keyfile:
        return None
    if not certfile or not keyfile:
        given, missing = (
            ("--ssl-certfile", "--ssl-keyfile") if certfile else ("--ssl-keyfile", "--ssl-certfile")
        )
        raise TLSError(f"{given} was given without {missing}; TLS needs both")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)  # TLS 1.2 or later, no client certs
    # Say HTTP/1.1 outright: a browser that offers h2 must not expect it here.
    context.set_alpn_protocols(["http/1.1"])
    try:
        context.load_cert_chain(certfile, keyfile, password=_no_passphrase)
    except FileNotFoundError as exc:
        raise TLSError(f"no such file: {exc.filename}") from None
    except TLSError:
        raise
    except (OSError, ssl.SSLError) as exc:
        raise TLSError(
            f"cannot load {certfile} with {keyfile} (PEM certificate chain and its key): {exc}"
        ) from None
    return context
