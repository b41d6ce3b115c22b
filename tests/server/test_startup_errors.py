"""`tokenwire serve` that cannot start stops at once with exit code 2 and
what to do, never a traceback: a Redis it cannot use (before the engine
loads, and never showing the password), or an address it cannot take."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from ..conftest import RedisServer, free_port


def serve(redis_url: str | None, port: int | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            *(sys.executable, "-m", "tokenwire", "serve", "--engine", "scripted"),
            *("--port", str(port or free_port())),
            *(("--redis-url", redis_url) if redis_url else ()),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def limited_user(redis_server: RedisServer) -> Iterator[str]:
    """A Redis user that may do everything but run scripts."""
    admin = redis.Redis(port=redis_server.port)
    admin.acl_setuser(
        "tw_noscript",
        enabled=True,
        passwords=["+s3cret"],
        keys=["*"],
        channels=["*"],
        commands=["+@all", "-@scripting"],
    )
    yield f"redis://tw_noscript:s3cret@127.0.0.1:{redis_server.port}/0"
    admin.acl_deluser("tw_noscript")
    admin.close()


def test_an_unreachable_redis_says_so() -> None:
    run = serve(f"redis://127.0.0.1:{free_port()}/0")
    assert run.returncode == 2
    assert "error: Redis at redis://127.0.0.1:" in run.stderr
    assert "is redis-server running" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_user_without_scripting_is_refused_at_startup(limited_user: str) -> None:
    run = serve(limited_user)
    assert run.returncode == 2
    assert "NOPERM" in run.stderr or "permission" in run.stderr.lower()
    assert "the Redis user needs" in run.stderr and "EVALSHA" in run.stderr
    assert "s3cret" not in run.stderr and "Traceback" not in run.stderr


def test_a_wrong_password_says_to_check_it(redis_server: RedisServer, limited_user: str) -> None:
    run = serve(f"redis://tw_noscript:n0t-the-pass@127.0.0.1:{redis_server.port}/0")
    assert run.returncode == 2
    assert "check the user and password in --redis-url" in run.stderr
    assert "n0t-the-pass" not in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("with_redis", [False, True])
def test_a_port_in_use_says_so_and_gives_the_lease_back(
    redis_server: RedisServer, with_redis: bool
) -> None:
    admin = redis.Redis(port=redis_server.port)
    leases_before = set(admin.scan_iter("tw:inst:*"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = serve(redis_server.url if with_redis else None, port)
    assert run.returncode == 2
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "choose another --port" in run.stderr and "Traceback" not in run.stderr
    assert set(admin.scan_iter("tw:inst:*")) <= leases_before  # released, not left to expire
    admin.close()
