"""deploy/docker-compose.yml (README, "Scaling out") checked without Docker.

Every tokenwire command goes through tokenwire's own flag parser, the
router's through vllm-router's, so a misspelt or removed flag fails here.
Then the cross references: tokenwire points at the router and at Redis, the
router at the vLLM replicas, the load balancer at the tokenwire instances,
and the session header is one the router hashes on. `docker compose config`
and `haproxy -c` run too (`make test` installs both)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock
from urllib.parse import urlsplit

import pytest
import yaml

from tokenwire.cli import build_parser
from tokenwire.config import FIELDS, ServerConfig

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
COMPOSE = DEPLOY / "docker-compose.yml"
HAPROXY = DEPLOY / "haproxy.cfg"
# vllm-router's consistent_hash reads these request headers, first match wins
# (SESSION_HEADER_NAMES in src/policies/hash_key.rs of vllm-project/router).
ROUTER_HASH_HEADERS = ("x-session-id", "x-user-id", "x-tenant-id")


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def services() -> dict[str, dict[str, Any]]:
    return compose()["services"]


def role(name: str) -> dict[str, dict[str, Any]]:
    """The services of one role, told apart by image or build."""
    found = {}
    for key, svc in services().items():
        image = str(svc.get("image", ""))
        build = svc.get("build") or {}
        kind = {
            "tokenwire": build.get("context") == ".." and "dockerfile" not in build,
            "router": build.get("dockerfile") == "router.Dockerfile",
            "vllm": image.startswith("vllm/vllm-openai"),
            "redis": image.startswith("redis:"),
            "lb": image.startswith("haproxy:"),
        }
        if kind[name]:
            found[key] = svc
    assert found, f"no {name} service in {COMPOSE}"
    return found


def one(name: str) -> tuple[str, dict[str, Any]]:
    (item,) = role(name).items()
    return item


def entrypoint(dockerfile: Path) -> list[str]:
    (line,) = [x for x in dockerfile.read_text().splitlines() if x.startswith("ENTRYPOINT")]
    return json.loads(line.removeprefix("ENTRYPOINT"))


def option(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} given {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def check_spelled_out(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """argparse takes `--remote-prio` for `--remote-priority`; a file others
    copy should not rely on that."""
    flags = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    unknown = flags - set(parser._option_string_actions)
    assert not unknown, f"not a flag of {parser.prog}: {sorted(unknown)}"


def serve_parser() -> argparse.ArgumentParser:
    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices["serve"]


def tokenwire_config(svc: dict[str, Any]) -> ServerConfig:
    """The image's entrypoint (`tokenwire serve --host 0.0.0.0`) plus the
    service's command, read as `tokenwire serve` reads them."""
    argv = entrypoint(ROOT / "Dockerfile")[1:] + [str(a) for a in svc["command"]]
    assert "--" not in argv, "--engine remote takes no vLLM engine flags"
    # The container's environment, not this shell's: TOKENWIRE_* set defaults.
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOKENWIRE_")}
    for key, value in (svc.get("environment") or {}).items():
        if value is not None:  # `KEY:` alone passes the shell's value through
            env[key] = re.sub(r"\$\{[^}]*\}", "interpolated", str(value))
    with mock.patch.dict(os.environ, env, clear=True):
        check_spelled_out(serve_parser(), argv)
        try:
            args = build_parser().parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"tokenwire rejects {argv}: exit {exc.code}")
    given = {n: getattr(args, n) for n in FIELDS}
    given = {n: tuple(v) if isinstance(v, list) else v for n, v in given.items()}
    return ServerConfig(**{n: v for n, v in given.items() if v is not None})


def router_args() -> Any:
    """Parsed as `vllm-router` parses (vllm_router.launch_router.parse_router_args,
    whose module also loads the Rust router and aiohttp: not needed here)."""
    from vllm_router.router_args import RouterArgs

    _, svc = one("router")
    argv = [str(a) for a in svc["command"]]
    parser = argparse.ArgumentParser(prog="vllm-router")
    RouterArgs.add_cli_args(parser, use_router_prefix=False)
    check_spelled_out(parser, argv)
    try:
        args = RouterArgs.from_cli_args(parser.parse_args(argv), use_router_prefix=False)
    except SystemExit as exc:
        pytest.fail(f"vllm-router rejects {argv}: exit {exc.code}")
    args._validate_router_args()
    return args


def test_tokenwire_commands_parse_and_point_at_router_and_redis() -> None:
    router_name, router = one("router")
    redis_name, _ = one("redis")
    router_port = int(option([str(a) for a in router["command"]], "--port"))
    assert len(role("tokenwire")) >= 2, "scaling out: at least two instances"
    for name, svc in role("tokenwire").items():
        config = tokenwire_config(svc)
        assert config.engine == "remote", name
        assert config.host == "0.0.0.0", name
        assert config.remote_url == (f"http://{router_name}:{router_port}",), name
        redis = urlsplit(config.redis_url or "")
        assert (redis.scheme, redis.hostname, redis.port or 6379) == ("redis", redis_name, 6379)
        assert config.remote_session_header.lower() in ROUTER_HASH_HEADERS, name
        depends = svc["depends_on"]
        assert depends[router_name]["condition"] == "service_healthy", name
        assert redis_name in depends, name
        grace = int(str(svc["stop_grace_period"]).removesuffix("s"))
        assert grace > config.drain_timeout_s, f"{name}: killed before its drain ends"
        assert config.api_keys or config.api_keys_file, f"{name}: no keys, no 0.0.0.0"


def test_router_command_parses_and_points_at_the_vllm_replicas() -> None:
    args = router_args()
    _, router = one("router")
    assert entrypoint(DEPLOY / router["build"]["dockerfile"]) == ["vllm-router"]
    assert args.policy == "consistent_hash"
    assert args.disable_retries  # tokenwire resubmits failed generations itself
    assert args.host == "0.0.0.0"
    replicas = role("vllm")
    assert len(replicas) >= 2
    expected = set()
    for name, svc in replicas.items():
        argv = [str(a) for a in svc["command"]]
        expected.add(f"http://{name}:{option(argv, '--port')}")
        assert router["depends_on"][name]["condition"] == "service_healthy"
    assert set(args.worker_urls) == expected
    assert len(args.worker_urls) == len(expected)
    probe = " ".join(router["healthcheck"]["test"])
    assert f"127.0.0.1:{args.port}/" in probe


def test_vllm_replicas_serve_one_model_with_the_flags_tokenwire_uses() -> None:
    remote_priority = {tokenwire_config(s).remote_priority for s in role("tokenwire").values()}
    models = set()
    for name, svc in role("vllm").items():
        argv = [str(a) for a in svc["command"]]
        models.add(option(argv, "--model"))
        for flag in ("--enable-scale-out", "--enable-prompt-tokens-details"):
            assert flag in argv, f"{name}: {flag}"
        priority = "--scheduling-policy" in argv and option(argv, "--scheduling-policy")
        assert remote_priority == {priority == "priority"}, f"{name}: priority lanes mismatch"
        port = option(argv, "--port")
        assert f"127.0.0.1:{port}/health" in " ".join(svc["healthcheck"]["test"])
    assert len(models) == 1, f"tokenwire refuses replicas serving different models: {models}"


def test_load_balancer_fronts_every_tokenwire_instance() -> None:
    _, lb = one("lb")
    assert set(lb["depends_on"]) == set(role("tokenwire"))
    text = HAPROXY.read_text()
    assert f"./{HAPROXY.name}:/usr/local/etc/haproxy/haproxy.cfg:ro" in lb["volumes"]
    servers = re.findall(r"^\s*server\s+\S+\s+(\S+):(\d+)", text, re.M)
    expected = {(n, tokenwire_config(s).port) for n, s in role("tokenwire").items()}
    assert {(host, int(port)) for host, port in servers} == expected
    assert re.search(r"^\s*option httpchk GET /readyz$", text, re.M)  # 503 once draining
    (bind,) = re.findall(r"^\s*bind\s+:(\d+)", text, re.M)
    assert [p.split(":")[-1] for p in lb["ports"]] == [bind]


def test_haproxy_accepts_the_config() -> None:
    binary = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin")
    assert binary, "haproxy is missing: run `make test`, which installs it"
    run = subprocess.run([binary, "-c", "-f", str(HAPROXY)], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def compose_command() -> list[str]:
    """Compose v2 (`docker compose`) where it is installed, else v1
    (`docker-compose`, the Debian package `make test` installs)."""
    if shutil.which("docker"):
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if v2.returncode == 0:
            return ["docker", "compose"]
    assert shutil.which("docker-compose"), "docker-compose is missing: run `make test`"
    return ["docker-compose"]


def test_docker_compose_accepts_the_file() -> None:
    command = compose_command()
    env = dict(os.environ, TOKENWIRE_API_KEYS="tw-test-key")
    run = subprocess.run(
        [*command, "-f", str(COMPOSE), "config", "--quiet"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.vllm
def test_vllm_accepts_the_replica_commands() -> None:
    """vLLM's own `vllm serve` parser (seconds to import: the vllm marker)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = make_arg_parser(FlexibleArgumentParser())
    for name, svc in role("vllm").items():
        argv = [str(a) for a in svc["command"]]
        check_spelled_out(parser, argv)
        try:
            args = parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"vllm serve rejects {name}'s {argv}: exit {exc.code}")
        assert args.enable_scale_out and args.enable_prompt_tokens_details, name
        assert args.enable_prefix_caching, name
