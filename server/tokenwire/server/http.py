"""Plain HTTP on the server's port: health, readiness, metrics, the demo
page and the JS client's sources."""

from __future__ import annotations

import json
import os
from http import HTTPStatus
from pathlib import Path
from typing import Any

from websockets.datastructures import Headers
from websockets.http11 import Response

PACKAGE_DIR = Path(__file__).resolve().parent.parent
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


def error_response(
    status: HTTPStatus, code: str, message: str, param: str | None = None
) -> Response:
    error = {"code": code, "message": message}
    if param is not None:
        error["param"] = param  # the request field at fault, as OpenAI names it
    return json_response(status, {"error": error})


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


def static_route(path: str) -> Response | None:
    """The demo page and the files it loads."""
    found = None
    if path == "/":
        found = static_file(STATIC_DIR, "index.html")
    for prefix, root in MOUNTS.items():
        if path.startswith(prefix):
            found = static_file(root, path[len(prefix) :])
    return found
