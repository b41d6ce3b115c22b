"""Server settings. Every CLI flag has a TOKENWIRE_* environment variable."""

from __future__ import annotations

from dataclasses import dataclass, field, fields


@dataclass(slots=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8765
    # TLS on the same port: wss:// for /v1/realtime, https:// for the HTTP routes.
    # Both or neither: a PEM certificate chain and its (unencrypted) private key.
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    engine: str = "vllm"
    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    # None: vLLM's default for the platform (on CPUs tokenwire picks float32,
    # as bfloat16 is slower without AVX512-BF16).
    dtype: str | None = None
    max_message_bytes: int = 1 << 20
    max_model_len: int | None = None  # None: the model's own context length
    kv_cache_gib: float = 1.0
    scripted_tokens_per_s: float = 50.0
    max_active_responses: int = 8
    # Cap when neither session nor response sets max_output_tokens: small
    # models can loop until the context is full.
    default_max_output_tokens: int = 1024
    # How long a response waits in requires_action for tool outputs.
    tool_timeout_s: float = 60.0
    # Text one conversation may hold; bounds a session's memory.
    max_conversation_bytes: int = 1 << 20
    # vLLM tool parser for tool_choice "auto" (e.g. hermes); none: auto gives text.
    tool_parser: str | None = None
    ping_interval_s: float = 20.0
    # Backpressure (bytes waiting for the client = socket write buffer + queue).
    outbound_high_water: int = 64 * 1024  # above it, pending deltas are merged
    outbound_hard_cap: int = 256 * 1024  # above it, generation pauses, reading stops
    stall_s: float = 5.0  # writer blocked this long: pause generation too
    slow_client_timeout_s: float = 30.0  # blocked this long: close with 4008
    max_inbound_frames: int = 4  # frames queued from the client before reading pauses
    sndbuf: int = 0  # SO_SNDBUF for client sockets; 0 keeps the OS default
    # Resume: how long a session outlives a dropped socket, and how much of
    # what it sent it keeps for replay.
    resume_grace_s: float = 30.0
    resume_log_bytes: int = 256 * 1024
    # Several instances: Redis holds each session's log and state, so any
    # instance can resume, follow or take over a session.
    redis_url: str | None = None  # e.g. redis://localhost:6379/0
    redis_maxlen: int = 10_000  # events kept per session log (approximate MAXLEN)
    redis_ttl_s: float = 3600.0  # a session's keys outlive its last write by this
    lease_s: float = 5.0  # an owner silent this long is dead: its sessions may be taken over
    drain_timeout_s: float = 30.0  # on SIGTERM, how long responses get to finish
    # Response cache (stages.cache): deterministic requests answered from a
    # stored generation; in Redis with --redis-url, else an in-memory LRU.
    response_cache: bool = False
    response_cache_ttl_s: float = 3600.0  # an entry expires this long after it was stored
    # Memory: the LRU's total; either backend: no entry over an eighth of it.
    response_cache_max_bytes: int = 64 << 20
    # Streaming guardrails (stages.guardrails): filters every tenant's output
    # passes, `NAME[:ARG]` each (blocklist:FILE, pii, or an entry point).
    guardrail: tuple[str, ...] = ()
    # Named sets for API keys (`KEY guardrails=NAME`): `NAME=NAME[:ARG]`, one
    # filter a flag; a set is what all its flags name.
    guardrail_set: tuple[str, ...] = ()
    guardrail_timeout_ms: float = 500.0  # an async filter's check, at most
    guardrail_on_timeout: str = "closed"  # closed: a timed-out check blocks; open: it allows
    # Characters held back until cleared (more if a filter needs it).
    guardrail_lookahead_chars: int = 32
    # Security and limits.
    api_keys_file: str | None = None  # one key per line
    api_keys: str | None = None  # comma-separated; prefer the file or the env var
    insecure: bool = False  # allow a non-loopback address without API keys
    allowed_origins: str | None = None  # comma-separated Origin allow-list for browsers
    max_connections: int = 10_000
    max_connections_per_key: int = 1_000
    max_responses_per_key: int = 256
    tokens_per_s_per_key: float = 0.0  # output tokens/s per key; 0 = unlimited
    max_events_per_s: float = 50.0  # client events per second per connection (burst x2)
    # Client bytes per second per connection (burst x2, at least one largest
    # message); over it, reading pauses. 0 = unlimited.
    max_inbound_bytes_per_s: float = float(1 << 20)
    idle_timeout_s: float = 600.0  # no client frame and nothing running: close (4000)
    # The process's memory allocator (allocator.py): auto takes mimalloc if
    # installed, which hands a wave's memory back; else pymalloc.
    allocator: str = "auto"
    log_content: bool = False  # log message text; off so logs never hold user data
    log_level: str = "info"
    # --engine remote: vLLM OpenAI-compatible servers (or a router in front of
    # them), driven with token ids. A session is pinned to one by its id.
    remote_url: tuple[str, ...] = ()
    # The header that carries the session id, for a router's session affinity.
    remote_session_header: str = "X-Session-ID"
    # A stream silent this long (no token, no keep-alive) has stalled.
    remote_timeout_s: float = 30.0
    # With several replicas: no first token this long, try the next (0: wait).
    remote_ttft_timeout_s: float = 20.0
    # The servers run `--scheduling-policy priority`; tokenwire cannot see it.
    remote_priority: bool = False
    # vLLM's own engine flags (everything after `--`), and which of the
    # shortcuts above the user set on tokenwire's side; not flags themselves.
    vllm_args: tuple[str, ...] = field(default=(), metadata={"cli": False})
    shortcuts_given: tuple[str, ...] = field(default=(), metadata={"cli": False})


def env_name(field_name: str) -> str:
    return "TOKENWIRE_" + field_name.upper()


FIELDS = {f.name: f for f in fields(ServerConfig) if f.metadata.get("cli", True)}
