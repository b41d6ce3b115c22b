"""The real engine: vLLM's `AsyncLLM`, in process, with DELTA outputs.

Prompts are rendered by the tokenizer's chat template and submitted as token
ids, so the context check happens before any engine work. Prefix caching is
on, which makes resubmitting a conversation (steer, resume) cheap.
Cancelling the task that iterates `generate` aborts the vLLM request.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, ClassVar

from ..logs import get_logger
from .base import (
    ContextLengthExceeded,
    EngineCapabilities,
    EngineDelta,
    EngineLoad,
    EngineUnavailable,
    GenerationRequest,
)
from .toolcalls import ParserStream, forced_scanner, structured_schema

if TYPE_CHECKING:
    from ..config import ServerConfig

log = get_logger("tokenwire.engines.vllm")


def _load_tracker_class() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class LoadTracker(StatLoggerBase):
        """Keeps the scheduler's latest running/waiting counts."""

        latest: ClassVar[dict[str, int]] = {"running": 0, "waiting": 0}

        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            pass

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if scheduler_stats is not None:
                LoadTracker.latest = {
                    "running": scheduler_stats.num_running_reqs,
                    "waiting": scheduler_stats.num_waiting_reqs
                    + scheduler_stats.num_skipped_waiting_reqs,
                }

        def log_engine_initialized(self) -> None:
            pass

    return LoadTracker


class VllmEngine:
    name = "vllm"
    capabilities = EngineCapabilities(resume_from_token_ids=True, preflight=True)

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model_path: str | None = None
        self._llm: Any = None
        self._tokenizer: Any = None
        self._tracker: Any = None
        self._max_len: int | None = None
        self._ready = asyncio.Event()
        self._failure: str | None = None

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self._failure is None

    @property
    def failure(self) -> str | None:
        return self._failure

    async def start(self) -> None:
        try:
            await self._start()
        except Exception as exc:  # reported through /readyz and every request
            self._failure = f"{type(exc).__name__}: {exc}"
            log.error("engine_start_failed", error=self._failure)
            raise
        finally:
            self._ready.set()

    async def _start(self) -> None:
        from ..models import resolve_model

        # Conversion of the bundled model (first run only) is CPU-bound.
        path = await asyncio.to_thread(resolve_model, self.config.model)
        self.model_path = str(path)
        # The flag (or TOKENWIRE_KV_CACHE_GIB) is the one knob; vLLM reads this.
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = f"{self.config.kv_cache_gib:g}"
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=self.model_path,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            enable_prefix_caching=True,
            enforce_eager=True,
            disable_log_stats=False,
        )
        self._tracker = _load_tracker_class()
        log.info("engine_starting", model=self.model_path, dtype=self.config.dtype)
        # Building the engine blocks for ~25 s; keep the event loop serving.
        self._llm = await asyncio.to_thread(
            AsyncLLM.from_engine_args, args, stat_loggers=[self._tracker]
        )
        self._tokenizer = self._llm.get_tokenizer()
        self._max_len = self._llm.model_config.max_model_len
        # vLLM reads settings from the environment per token unless cached;
        # its own servers cache them once started (engine core does the same).
        from vllm.envs import enable_envs_cache

        enable_envs_cache()
        log.info("engine_ready", model=self.model_path, max_model_len=self._max_len)

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def load(self) -> EngineLoad:
        if self._llm is None or self._tracker is None:
            return EngineLoad()
        latest = self._tracker.latest
        return EngineLoad(
            running=latest["running"],
            waiting=latest["waiting"],
            extra={"unfinished": self._llm.output_processor.get_num_unfinished_requests()},
        )

    def _template_messages(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Tool turns in the shape the chat template understands."""
        if "tool_calls" in (self._tokenizer.chat_template or ""):
            # HF templates take a call's arguments as a mapping.
            return [
                {**m, "tool_calls": [_with_parsed_arguments(c) for c in m["tool_calls"]]}
                if m.get("tool_calls")
                else m
                for m in messages
            ]
        # No tool support in the template (SmolLM2's ChatML). Measured on
        # SmolLM2: written-out calls make it imitate JSON instead of answering,
        # while a plain "Result of NAME: ..." user turn gets a grounded answer.
        names = {c["id"]: c["function"]["name"] for m in messages for c in m.get("tool_calls", ())}
        out = []
        for m in messages:
            if m.get("tool_calls"):
                if m["content"]:
                    out.append({"role": "assistant", "content": m["content"]})
            elif m["role"] == "tool":
                name = names.get(m["tool_call_id"], "the tool")
                out.append({"role": "user", "content": f"Result of {name}: {m['content']}"})
            else:
                out.append(m)
        return out

    def render(self, request: GenerationRequest) -> list[int]:
        """Token ids of the chat, through the tokenizer's chat template."""
        text = self._tokenizer.apply_chat_template(
            self._template_messages(request.messages),
            tools=request.tools,
            tokenize=False,
            add_generation_prompt=True,
        )
        return self._tokenizer.encode(text, add_special_tokens=False)

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        if self._tokenizer is None:
            return None  # not loaded yet; generate() checks once it is
        return tuple(self._checked_ids(request))

    def _checked_ids(self, request: GenerationRequest) -> list[int]:
        ids = self.render(request)
        if len(ids) >= (self._max_len or 0):
            raise ContextLengthExceeded(
                f"the prompt has {len(ids)} tokens; the model's context is {self._max_len} "
                "tokens. Shorten the conversation or its instructions.",
            )
        return ids

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        await self._ready.wait()
        if self._failure is not None or self._llm is None:
            raise EngineUnavailable(f"the engine failed to start: {self._failure}")
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

        ids = list(request.rendered) if request.rendered else self._checked_ids(request)
        if request.resume_token_ids:
            ids = [*ids, *request.resume_token_ids]
        room = (self._max_len or 0) - len(ids)
        max_tokens = (
            room if request.max_output_tokens is None else min(request.max_output_tokens, room)
        )
        tools, choice = request.tools, request.tool_choice
        # Forced calls go through structured outputs; "auto" through the
        # configured vLLM tool parser, if any.
        schema = structured_schema(tools, choice) if tools else None
        scanner = forced_scanner(choice) if schema is not None else None
        parser = None
        if tools and choice == "auto" and self.config.tool_parser:
            parser = ParserStream(self.config.tool_parser, self._tokenizer, tools)
        params = SamplingParams(
            temperature=request.temperature,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=parser.skip_special_tokens if parser else True,
            structured_outputs=StructuredOutputsParams(json=schema) if schema else None,
        )
        first = True
        async for out in self._llm.generate({"prompt_token_ids": ids}, params, request.request_id):
            completion = out.outputs[0]
            text, calls = completion.text, None
            if scanner is not None:
                text, calls = "", scanner.feed(text)
            elif parser is not None:
                text, calls = parser.feed(text, list(completion.token_ids))
            yield EngineDelta(
                text=text,
                output_tokens=len(completion.token_ids),
                finish_reason=completion.finish_reason if out.finished else None,
                prompt_tokens=len(ids) if first else None,
                cached_tokens=(out.num_cached_tokens or 0) if first else None,
                tool_calls=calls or None,
                token_ids=list(completion.token_ids),
            )
            first = False


def _with_parsed_arguments(call: dict[str, Any]) -> dict[str, Any]:
    try:
        arguments = json.loads(call["function"]["arguments"])
    except ValueError:
        arguments = call["function"]["arguments"]
    return {**call, "function": {**call["function"], "arguments": arguments}}
