"""What `--engine remote` checks of each server before it serves: its model
and max_model_len (`/v1/models`), that its `/tokenize` renders a
conversation as tokenwire does (token ids must mean the same on both
sides), and, with one 1-token request, which token-ids endpoint it offers
and which settings it would silently ignore (each one logged as a warning).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..logs import get_logger
from .base import EngineUnavailable
from .chat_template import ChatTemplate
from .remote_http import COMPLETIONS_PATH, GENERATE_PATH, parse_chunk
from .replicas import Replica

if TYPE_CHECKING:
    import aiohttp

log = get_logger("tokenwire.engines.remote")

# The conversation whose rendering must match the server's /tokenize.
PROBE_CHAT = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
# Held to this by structured outputs, a 1-token answer must start it; the
# model would never say it unconstrained.
PROBE_CHOICE = "!!!"


@dataclass(slots=True)
class Answer:
    """A whole (not streamed) HTTP answer."""

    status_code: int
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

    def json(self) -> Any:
        return json.loads(self.body)

    def payload(self, url: str) -> dict[str, Any]:
        """The JSON object a vLLM server answers; anything else (a proxy's
        HTML page, say) makes the start fail with a message, not a traceback."""
        try:
            payload = self.json()
        except ValueError:
            payload = None
        if not isinstance(payload, dict):
            raise EngineUnavailable(f"{url} did not answer with a JSON object: {self.text[:300]!r}")
        return payload


async def call(
    client: aiohttp.ClientSession, replica: Replica, method: str, path: str, **kw: Any
) -> Answer:
    import aiohttp

    try:
        async with client.request(method, replica.base + path, **kw) as resp:
            return Answer(resp.status, await resp.read())
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineUnavailable(f"cannot reach {replica.url} ({replica.error_text(exc)})") from None


async def read_model(client: aiohttp.ClientSession, replica: Replica) -> None:
    resp = await call(client, replica, "GET", "/v1/models")
    if resp.status_code != 200:
        raise EngineUnavailable(f"{replica.url}/v1/models answered {resp.status_code}")
    try:
        card = resp.json()["data"][0]
        replica.model = str(card["id"])
        replica.max_model_len = int(card["max_model_len"])
    except (ValueError, KeyError, IndexError, TypeError):
        raise EngineUnavailable(
            f"{replica.url}/v1/models is not a vLLM model list: {resp.text[:300]!r}"
        ) from None


async def check_rendering(
    client: aiohttp.ClientSession, template: ChatTemplate, replica: Replica
) -> None:
    ours = template.render(PROBE_CHAT)
    resp = await call(
        client,
        replica,
        "POST",
        "/tokenize",
        json={"model": replica.model, "messages": PROBE_CHAT, "add_generation_prompt": True},
    )
    if resp.status_code != 200:
        raise EngineUnavailable(f"{replica.url}/tokenize answered {resp.status_code}")
    theirs = resp.payload(f"{replica.url}/tokenize").get("tokens") or []
    if theirs != ours:
        raise EngineUnavailable(
            f"{replica.url} renders the chat template differently from tokenwire; "
            "token ids would not mean the same thing.\n"
            f"  tokenwire ({len(ours)} tokens): {template.decode(ours)!r}\n"
            f"  server    ({len(theirs)} tokens): {template.decode(theirs)!r}"
        )


async def probe_endpoint(
    client: aiohttp.ClientSession, template: ChatTemplate, replica: Replica
) -> None:
    """One 1-token request: which endpoint, are cached tokens reported, and
    are structured outputs honoured (a server that ignores them, as vLLM
    does with the old `guided_json`, answers in prose)."""
    ids = template.render(PROBE_CHAT)
    params = {
        "max_tokens": 1,
        "temperature": 0.0,
        "structured_outputs": {"choice": [PROBE_CHOICE]},
    }
    resp = await call(
        client,
        replica,
        "POST",
        GENERATE_PATH,
        json={"token_ids": ids, "sampling_params": params, "output_mode": "text"},
    )
    if resp.status_code in (403, 404):  # not offered (no --enable-scale-out)
        resp = await call(
            client,
            replica,
            "POST",
            COMPLETIONS_PATH,
            json={"model": replica.model, "prompt": ids, "return_token_ids": True, **params},
        )
    else:
        replica.generate_endpoint = True
    if resp.status_code != 200:
        raise EngineUnavailable(
            f"{replica.url} failed a 1-token test request ({resp.status_code}): {resp.text[:300]}"
        )
    answer = resp.payload(replica.url)
    # The streamed chunks' parser reads the whole answer's choice the same way.
    choice = parse_chunk(resp.body, replica.url)
    if not choice.token_ids:
        raise EngineUnavailable(
            f"{replica.url} answered a 1-token test request without its token ids; "
            "tokenwire needs them to resume and fail over exactly. Use a vLLM "
            "that returns them (`return_token_ids`, vLLM 0.10.2 or later)"
        )
    usage = answer.get("usage")
    usage = usage if isinstance(usage, dict) else {}
    replica.reports_cached = usage.get("prompt_tokens_details") is not None
    if not replica.reports_cached:
        log.warning(
            "remote_no_cached_tokens",
            url=replica.url,
            hint="usage will lack cached_tokens; start vllm serve with "
            "--enable-prompt-tokens-details",
        )
    text = choice.text
    if not (text and PROBE_CHOICE.startswith(text)):
        log.warning(
            "remote_structured_outputs_ignored",
            url=replica.url,
            answer=text,
            hint="this server ignores structured_outputs, so forced tool calls "
            "are not held to their schema; use a vLLM that supports them",
        )
