"""The real engine: vLLM's `AsyncLLM`, in process, with DELTA outputs.

Prompts are rendered by the tokenizer's chat template and submitted as token
ids, so the context check happens before any engine work. Prefix caching is
on, which makes resubmitting a conversation (steer, resume) cheap.
Cancelling the task that iterates `generate` aborts the vLLM request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import zlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from ..logs import get_logger
from .base import (
    EngineCapabilities,
    EngineDelta,
    EngineLoad,
    EngineUnavailable,
    GenerationRequest,
)
from .chat_template import ChatTemplate
from .startup import Startup
from .toolcalls import (
    ParserStream,
    forced_scanner,
    import_vllm_side,
    split_calls,
    structured_schema,
)
from .vllm_stats import async_llm, load_tracker_class

if TYPE_CHECKING:
    from ..config import ServerConfig

log = get_logger("tokenwire.engines.vllm")

DIED = "vLLM's engine process died (its log says why); restart tokenwire"


def rank_of(session_id: str | None, ranks: int) -> int | None:
    """A session's data-parallel rank: stable across processes and restarts,
    so every generation of a session meets its own prefix cache."""
    if ranks <= 1 or not session_id:
        return None
    return zlib.crc32(session_id.encode()) % ranks


def dp_ranks(parallel: Any) -> int:
    """The data-parallel ranks this process may send to: only its local ones
    when vLLM balances externally or hybrid (`--data-parallel-rank`,
    `--data-parallel-hybrid-lb`): vLLM refuses any other rank."""
    if parallel.local_engines_only:
        return int(parallel.data_parallel_size_local)
    return int(parallel.data_parallel_size)


class VllmEngine:
    name = "vllm"

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.model_path: str | None = None
        self.model = ""
        self._llm: Any = None
        self._tokenizer: Any = None
        self._template: ChatTemplate | None = None
        self._tracker: Any = None
        self._max_len: int | None = None
        self._startup = Startup(lambda exc: f"{type(exc).__name__}: {exc}", "the engine", log)
        # Priority reaches the scheduler only with --scheduling-policy priority.
        self.capabilities = EngineCapabilities(resume_from_token_ids=True, preflight=True)
        self.ranks = 1  # data-parallel ranks
        self.sent_by_rank: Counter[int] = Counter()
        self._warned_priority = False

    @property
    def ready(self) -> bool:
        return self._startup.ready and not self._dead

    @property
    def failure(self) -> str | None:
        return DIED if self._dead else self._startup.failure

    @property
    def _dead(self) -> bool:
        """vLLM's engine process died: nothing more will be served."""
        return self._llm is not None and bool(self._llm.errored)

    async def start(self) -> None:
        await self._startup.run(self._start)

    async def _start(self) -> None:
        from ..models import resolve_model
        from .vllm_args import engine_args, given_by_vllm

        if not given_by_vllm(self.config.vllm_args, "model"):
            # Conversion of the bundled model (first run only) is CPU-bound.
            path = await asyncio.to_thread(resolve_model, self.config.model)
            self.model_path = str(path)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        settings = engine_args(
            self.config.vllm_args,
            model=self.model_path,
            dtype=self.config.dtype,
            max_model_len=self.config.max_model_len,
            kv_cache_gib=self.config.kv_cache_gib,
            shortcuts_given=self.config.shortcuts_given,
        )
        for note in settings.notes:
            log.info("engine_setting", note=note)
        args = settings.args
        self.model_path = args.model
        self._tracker = load_tracker_class()
        # Refuses an unknown --tool-parser before the engine is built.
        await asyncio.to_thread(import_vllm_side, self.config.tool_parser)
        log.info(
            "engine_starting",
            model=args.model,
            dtype=args.dtype,
            data_parallel_size=args.data_parallel_size,
            scheduling_policy=args.scheduling_policy,
        )
        # Building the engine blocks for ~25 s; keep the event loop serving.
        self._llm = await asyncio.to_thread(async_llm, args, self._tracker)
        self._tokenizer = self._llm.get_tokenizer()
        self._template = ChatTemplate(self._tokenizer)
        self._max_len = self._llm.model_config.max_model_len
        vllm_config = self._llm.vllm_config
        self.ranks = dp_ranks(vllm_config.parallel_config)
        self.capabilities = EngineCapabilities(
            resume_from_token_ids=True,
            preflight=True,
            priority=vllm_config.scheduler_config.policy == "priority",
        )
        # vLLM reads settings from the environment per token unless cached;
        # its own servers cache them once started (engine core does the same).
        from vllm.envs import enable_envs_cache

        enable_envs_cache()
        self.model = self.model_path or ""
        log.info("engine_ready", model=self.model_path, max_model_len=self._max_len)

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def load(self) -> EngineLoad:
        if self._llm is None or self._tracker is None:
            return EngineLoad()
        totals = self._tracker.totals()
        extra: dict[str, Any] = {
            "unfinished": self._llm.output_processor.get_num_unfinished_requests()
        }
        if self.ranks > 1:
            extra["requests_by_rank"] = {str(r): n for r, n in sorted(self.sent_by_rank.items())}
        return EngineLoad(running=totals["running"], waiting=totals["waiting"], extra=extra)

    def render(self, request: GenerationRequest) -> list[int]:
        """Token ids of the chat, through the tokenizer's chat template."""
        assert self._template is not None
        return self._template.render(request.messages, request.tools)

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        if self._template is None:
            return None  # not loaded yet; generate() checks once it is
        return tuple(self._template.prompt_ids(request, self._max_len or 0))

    async def generate(self, request: GenerationRequest) -> AsyncIterator[EngineDelta]:
        await self._startup.wait()
        template = self._template
        if self._llm is None or template is None:  # closed meanwhile
            raise EngineUnavailable("the engine is shut down")
        ids = (
            list(request.rendered)
            if request.rendered
            else await template.prompt_ids_async(request, self._max_len or 0)
        )
        if self._llm is None:  # closed while the prompt was tokenized
            raise EngineUnavailable("the engine is shut down")
        from vllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError

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
            seed=request.seed,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
            skip_special_tokens=parser.skip_special_tokens if parser else True,
            structured_outputs=StructuredOutputsParams(json=schema) if schema else None,
            # None leaves the engine's --stream-interval (a request only raises it).
            stream_interval=request.stream_interval if request.stream_interval > 1 else None,
        )
        if request.priority and not self.capabilities.priority and not self._warned_priority:
            self._warned_priority = True
            log.warning(
                "priority_ignored",
                hint="requests carry priorities, but vLLM schedules first come, first served; "
                "start with `-- --scheduling-policy priority`",
            )
        rank = rank_of(request.session_id, self.ranks)
        if rank is not None:
            self.sent_by_rank[rank] += 1
        outs = self._llm.generate(
            {
                "prompt_token_ids": ids,
                **({"cache_salt": salt} if (salt := request.cache_salt) else {}),
            },
            params,
            request.request_id,
            priority=request.priority,
            data_parallel_rank=rank,
        )
        first = True
        try:
            # Closed with ours: vLLM aborts the request now, not once its
            # generator is collected.
            async with contextlib.aclosing(outs):
                async for out in outs:
                    completion = out.outputs[0]
                    ids_out = completion.token_ids
                    text, calls = split_calls(
                        completion.text, ids_out, scanner, parser, out.finished
                    )
                    yield EngineDelta(
                        text=text,
                        output_tokens=len(ids_out),
                        finish_reason=completion.finish_reason if out.finished else None,
                        prompt_tokens=len(ids) if first else None,
                        cached_tokens=(out.num_cached_tokens or 0) if first else None,
                        tool_calls=calls or None,
                        token_ids=list(ids_out),
                        queue_wait_s=_queue_wait(out.metrics) if first else None,
                    )
                    first = False
        except EngineDeadError:
            log.error("engine_died", request_id=request.request_id, hint=DIED)
            raise EngineUnavailable(DIED) from None


def _queue_wait(stats: Any) -> float | None:
    """Seconds the request waited for the scheduler (engine-core clock)."""
    if stats is None or not stats.scheduled_ts or not stats.queued_ts:
        return None
    return max(stats.scheduled_ts - stats.queued_ts, 0.0)
