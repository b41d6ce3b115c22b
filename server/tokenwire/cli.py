"""`tokenwire serve` and `tokenwire models prepare`."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from .allocator import CHOICES, AllocatorError, Plan
from .allocator import apply as apply_allocator
from .config import FIELDS, ServerConfig, env_name
from .engines.vllm_args import forced_help  # no vLLM import: that waits for --engine vllm

_HELP = {
    "host": "address to listen on",
    "port": "port to listen on",
    "ssl_certfile": "PEM certificate (chain) to serve wss:// and https:// on the same port; "
    "needs --ssl-keyfile",
    "ssl_keyfile": "PEM private key of --ssl-certfile (unencrypted)",
    "engine": "vllm (the real model, in process), remote (vLLM servers given by --remote-url) "
    "or scripted (deterministic, for tests and benchmarks)",
    "model": "a local Hugging Face-format directory; default: the bundled SmolLM2-135M-Instruct",
    "dtype": "model dtype, a shortcut for vLLM's --dtype (default: vLLM's for the platform; "
    "on CPUs float32, the fastest without AVX512-BF16)",
    "max_message_bytes": "largest client frame; a bigger one closes the connection with 1009",
    "max_model_len": "context length, a shortcut for vLLM's --max-model-len (default: the model's)",
    "kv_cache_gib": "KV cache size in GiB, a shortcut for vLLM's --kv-cache-memory-bytes "
    "(default on CPUs; elsewhere only when given: on GPUs vLLM sizes it by "
    "--gpu-memory-utilization)",
    "scripted_tokens_per_s": "token rate of the scripted engine (0: as fast as possible)",
    "max_active_responses": "responses one connection may run at once",
    "default_max_output_tokens": "output cap when the client sets no max_output_tokens",
    "tool_timeout_s": "how long a response waits for tool outputs before ending incomplete",
    "max_conversation_bytes": "text one conversation may hold before new input is refused",
    "tool_parser": "vLLM tool parser for tool_choice auto (e.g. hermes); default: none",
    "ping_interval_s": "WebSocket keepalive ping interval, seconds",
    "outbound_high_water": "bytes waiting for a client above which deltas are merged",
    "outbound_hard_cap": "bytes waiting for a client above which its generation pauses",
    "stall_s": "seconds a client may block the writer before its generation pauses",
    "slow_client_timeout_s": "seconds a client may block the writer before it is closed (4008)",
    "max_inbound_frames": "client frames queued before the server stops reading the socket",
    "sndbuf": "SO_SNDBUF of client sockets in bytes (0: OS default)",
    "resume_grace_s": "how long a session outlives a dropped connection, waiting for resume",
    "resume_log_bytes": "bytes of sent events a session keeps for replay on resume (no Redis)",
    "redis_url": "Redis for several instances: shared session logs, resume on any instance, "
    "drain handover and crash takeover (e.g. redis://localhost:6379/0)",
    "redis_maxlen": "events kept per session log in Redis (approximate MAXLEN)",
    "redis_ttl_s": "seconds a session's Redis keys outlive its last write",
    "lease_s": "seconds without a heartbeat after which an instance counts as dead",
    "drain_timeout_s": "on SIGTERM, seconds running responses get to finish before handover",
    "response_cache": "answer deterministic requests (temperature 0) from a cache of earlier "
    "identical generations, per tenant; in Redis with --redis-url, else in memory",
    "response_cache_ttl_s": "seconds a response cache entry lives",
    "response_cache_max_bytes": "in-memory response cache size (LRU); no entry larger than an "
    "eighth of it is stored (either backend)",
    "guardrail": "a filter on every response's text, NAME[:ARG]: blocklist:FILE (words, or "
    "re:REGEX lines), pii (redacts e-mails and phones), or an entry point of the group "
    "tokenwire.guardrails; repeat for several (env: comma-separated)",
    "guardrail_set": "a named filter set for API keys (KEY guardrails=NAME): NAME=NAME[:ARG], "
    "one filter a flag, repeatable",
    "guardrail_timeout_ms": "milliseconds an async guardrail filter may take per check",
    "guardrail_on_timeout": "closed: a filter that times out or fails blocks; open: it allows",
    "guardrail_lookahead_chars": "characters of output held back until every filter cleared "
    "them (more if a blocklist phrase is longer)",
    "api_keys_file": "file of API keys, one per line; clients must present one",
    "api_keys": "API keys, comma-separated (prefer --api-keys-file)",
    "insecure": "serve a non-loopback address without API keys",
    "allowed_origins": "comma-separated Origin allow-list for browser clients",
    "max_connections": "open connections in all",
    "max_connections_per_key": "open connections per API key",
    "max_responses_per_key": "responses running at once per API key",
    "tokens_per_s_per_key": "output tokens per second per API key (0: unlimited)",
    "max_events_per_s": "client events per second per connection, burst twice that",
    "max_inbound_bytes_per_s": "client bytes per second per connection, burst twice that "
    "(at least one largest message); over it the server reads the socket more slowly",
    "idle_timeout_s": "close a connection with no frames and nothing running (code 4000)",
    "remote_url": "--engine remote: a vLLM OpenAI-compatible server or router base URL, "
    "e.g. http://10.0.0.5:8000; repeat the flag for several replicas (env: comma-separated)",
    "remote_session_header": "--engine remote: the request header carrying the session id, "
    "for a router's session affinity",
    "remote_timeout_s": "--engine remote: seconds a server may stay silent (queued before "
    "its first token, or mid-stream) before the stream counts as stalled",
    "remote_ttft_timeout_s": "--engine remote, several replicas: seconds to wait for a first "
    "token before the request goes to the next replica; the last one tried waits (0: no limit)",
    "remote_priority": "--engine remote: the servers schedule by priority "
    "(vllm serve --scheduling-policy priority), so request priorities matter",
    "allocator": "the process's memory allocator: auto (mimalloc if installed, which returns "
    "memory to the OS after a wave of sessions; else pymalloc), mimalloc, pymalloc or malloc "
    "(glibc)",
    "log_content": "log message text (off by default: logs never hold user data)",
    "log_level": "debug, info, warning or error",
}
_CHOICES = {
    "engine": ["vllm", "remote", "scripted"],
    "log_level": ["debug", "info", "warning", "error"],
    "guardrail_on_timeout": ["open", "closed"],
    "allocator": list(CHOICES),
}
_TYPES: dict[str, type] = {"max_model_len": int}
_SHORTCUTS = ("model", "dtype", "max_model_len", "kv_cache_gib")
_VLLM_EPILOG = """\
vLLM engine flags (--engine vllm): tokenwire serve [tokenwire flags] -- [vLLM flags]
  Everything after `--` goes to vLLM's own engine argument parser, with vLLM's
  defaults for the platform: `tokenwire serve -- --help` lists every flag, and
  `-- --config engine.yaml` reads them from a file. For example:
    tokenwire serve --model /models/llama-70b-awq -- --tensor-parallel-size 4 \\
        --gpu-memory-utilization 0.92 --quantization awq --max-num-seqs 128
  --model, --dtype and --max-model-len above are shortcuts for vLLM's flags of
  the same names, --kv-cache-gib for --kv-cache-memory-bytes; where both are
  given, the vLLM flag wins (a log line says so).
  tokenwire forces two settings:
"""


_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
# The engines a setting means something to; elsewhere it is ignored.
ENGINES_OF = {
    "model": ("vllm", "remote"),  # remote: where its tokenizer comes from
    "dtype": ("vllm",),
    "max_model_len": ("vllm",),
    "kv_cache_gib": ("vllm",),
    "tool_parser": ("vllm", "remote"),
    "scripted_tokens_per_s": ("scripted",),
    "remote_session_header": ("remote",),
    "remote_timeout_s": ("remote",),
    "remote_ttft_timeout_s": ("remote",),
    "remote_priority": ("remote",),
}


class EnvError(ValueError):
    """A TOKENWIRE_* variable whose value the flag would refuse."""


def _env_default(name: str, default: Any) -> Any:
    """The flag's default from its environment variable, checked as the flag
    is: a typo in a container's environment fails at start, naming it."""
    var = env_name(name)
    raw = os.environ.get(var)
    if raw is None:
        return default
    try:
        value = _from_env(name, raw, default)
    except ValueError as exc:
        raise EnvError(f"{var}={raw!r}: {exc}") from None
    choices = _CHOICES.get(name)
    if choices is not None:
        value = value.lower()  # INFO as logging names it
    if choices is not None and value not in choices:
        raise EnvError(f"{var}={raw!r}: expected one of {', '.join(choices)}")
    return value


def _from_env(name: str, raw: str, default: Any) -> Any:
    if isinstance(default, tuple):
        return tuple(part.strip() for part in raw.split(",") if part.strip())
    if isinstance(default, bool):
        word = raw.strip().lower()
        if word not in _TRUE + _FALSE:
            raise ValueError(f"expected one of {', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}")
        return word in _TRUE
    kind = _kind(name, default)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"expected {'an integer' if kind is int else 'a number'}") from None


def _kind(name: str, default: Any) -> Any:
    """The type a flag's value is read as."""
    return _TYPES.get(name) or (type(default) if default is not None else str)


def _add_serve_flags(parser: argparse.ArgumentParser) -> None:
    defaults = ServerConfig()
    for name in FIELDS:
        default = _env_default(name, getattr(defaults, name))
        flag = "--" + name.replace("_", "-")
        helptext = f"{_HELP[name]} (env {env_name(name)}; default: %(default)s)"
        if isinstance(getattr(defaults, name), bool):
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=helptext
            )
            continue
        if isinstance(getattr(defaults, name), tuple):  # a repeatable flag
            parser.add_argument(
                flag, action="append", default=None, help=helptext.replace("%(default)s", "none")
            )
            continue
        kind = _kind(name, getattr(defaults, name))
        parser.add_argument(
            flag, type=kind, default=default, choices=_CHOICES.get(name), help=helptext
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenwire", description="Realtime WebSocket server for LLM token streams."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser(
        "serve",
        help="serve ws://HOST:PORT/v1/realtime (wss:// with --ssl-certfile and --ssl-keyfile)",
        usage="tokenwire serve [tokenwire flags] [-- vLLM engine flags]",
        epilog=_VLLM_EPILOG + forced_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_serve_flags(serve)
    models = sub.add_parser("models", help="manage models")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert the bundled SmolLM2 GGUF into a checkpoint")
    prep.add_argument("--force", action="store_true", help="convert again even if cached")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv_given = argv
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_argv: list[str] = []
    if "--" in argv:  # `serve [ours] -- [vLLM's]`
        cut = argv.index("--")
        argv, vllm_argv = argv[:cut], argv[cut + 1 :]
    try:
        parser = build_parser()
    except EnvError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    if args.command == "models":
        from .models import ModelError, prepare_default_model

        try:
            path = prepare_default_model(force=args.force)
        except ModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        print(path)
        return 0

    given = {name: getattr(args, name) for name in FIELDS}
    for name, value in given.items():
        if value is None and isinstance(getattr(ServerConfig(), name), tuple):
            given[name] = _env_default(name, ())  # a repeatable flag not on the command line
        elif isinstance(value, list):
            given[name] = tuple(value)
    config = ServerConfig(
        **given,
        vllm_args=tuple(vllm_argv),
        # --kv-cache-gib from the environment applies on CPUs only (the image
        # sets it for every variant; a GPU sizes its cache by memory share).
        shortcuts_given=tuple(n for n in _SHORTCUTS if _given(n, argv, n != "kv_cache_gib")),
    )
    if vllm_argv and config.engine != "vllm":
        print(
            f"error: flags after `--` are vLLM engine flags; --engine {config.engine} takes none",
            file=sys.stderr,
        )
        return 2
    for name, engines in ENGINES_OF.items():
        # Only on the command line: a shared environment (an image's) may set
        # a variable for every engine.
        if config.engine not in engines and _given(name, argv, env=False):
            flag = "--" + name.replace("_", "-")
            print(f"error: {flag} applies to --engine {' or '.join(engines)}", file=sys.stderr)
            return 2
    if config.engine == "vllm" and config.kv_cache_gib <= 0:
        print("error: --kv-cache-gib must be above 0", file=sys.stderr)
        return 2
    allocator = Plan(config.allocator)
    if argv_given is None:  # the process's own command line: it can execute again
        try:
            allocator = apply_allocator(config.allocator)
        except AllocatorError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if config.engine == "vllm":
        # vLLM's argument module takes seconds to import: only for this engine.
        from .engines.vllm_args import check_or_exit

        check_or_exit(vllm_argv, dtype=config.dtype, tool_parser=config.tool_parser)
    if config.engine == "remote":
        from .engines.remote import check_or_exit as check_remote

        check_remote(config)  # an unreachable or mismatched server fails here, code 2
    elif config.remote_url:
        print("error: --remote-url needs --engine remote", file=sys.stderr)
        return 2
    return serve(config, allocator)


def _vllm_names_model(config: ServerConfig) -> bool:
    from .engines.vllm_args import given_by_vllm

    return given_by_vllm(config.vllm_args, "model")


def _given(name: str, argv: list[str], env: bool = True) -> bool:
    """The user set this flag on tokenwire's side (the command line, or env)."""
    flags = ("--" + name.replace("_", "-"), "--no-" + name.replace("_", "-"))
    in_argv = any(a in flags or a.startswith(flags[0] + "=") for a in argv)
    return in_argv or (env and env_name(name) in os.environ)


def serve(config: ServerConfig, allocator: Plan) -> int:
    import uvloop

    from . import logs
    from .server import TokenwireServer

    logs.configure(config.log_level)
    logs.get_logger("tokenwire.allocator").info(
        "allocator", name=allocator.allocator, **({"why": allocator.note} if allocator.note else {})
    )
    from .server.admission import KeyFileError, KeyStore, is_loopback
    from .server.tls import TLSError, server_context

    try:
        keys = KeyStore.load(config.api_keys_file, config.api_keys)
    except (KeyFileError, OSError) as exc:
        print(f"error: API keys: {exc}", file=sys.stderr)
        return 2
    from .stages.filters import GuardrailError
    from .stages.guardrails import build_guardrails

    try:
        build_guardrails(config, keys)  # a missing blocklist or plugin fails now, code 2
    except GuardrailError as exc:
        print(f"error: guardrails: {exc}", file=sys.stderr)
        return 2
    try:
        server_context(config)  # fail now, not after the engine has loaded
    except TLSError as exc:
        print(f"error: TLS: {exc}", file=sys.stderr)
        return 2
    if not keys.enabled and not config.insecure and not is_loopback(config.host):
        print(
            f"error: refusing to serve {config.host} without API keys. Pass --api-keys-file "
            "(or TOKENWIRE_API_KEYS), or --insecure if the network in front is trusted.",
            file=sys.stderr,
        )
        return 2
    if config.engine == "vllm" and not _vllm_names_model(config):
        # Prepare the model here, in the foreground, so its progress is visible.
        from .models import ModelError, resolve_model

        try:
            config.model = str(resolve_model(config.model))
        except ModelError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    from .server.app import ListenError
    from .storage.redis import RedisUnavailable

    try:
        uvloop.run(TokenwireServer(config).serve_forever())
    except (RedisUnavailable, ListenError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
