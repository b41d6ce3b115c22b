"""Where prompts are tokenized: a recorder of a tokenizer's encodes, and a
stand-in engine that preflights through SmolLM2's chat template."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass
from typing import Any

from tokenwire.engines.base import GenerationRequest
from tokenwire.engines.scripted import ScriptedEngine


@dataclass(frozen=True)
class Encode:
    chars: int
    thread: int
    # Off the loop's thread: the loop ran a callback while this encode was
    # under way, which it can only do if nothing holds it.
    loop_ran: bool


class EncodeRecorder:
    """Wraps `tokenizer.encode` (made on the loop's thread, in a test) and
    records each call; `restore()` or leaving the `with` block unwraps it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer, self.encode = tokenizer, tokenizer.encode
        self.loop = asyncio.get_running_loop()
        self.loop_thread = threading.get_ident()
        self.calls: list[Encode] = []
        tokenizer.encode = self._recording

    def _recording(self, text: str, **kwargs: Any) -> list[int]:
        thread = threading.get_ident()
        loop_ran = False
        if thread != self.loop_thread:
            try:
                ping = asyncio.run_coroutine_threadsafe(asyncio.sleep(0), self.loop)
                ping.result(timeout=10)
                loop_ran = True
            except Exception:  # a loop held or closed did not run
                pass
        self.calls.append(Encode(len(text), thread, loop_ran))
        return self.encode(text, **kwargs)

    def long(self, over: int = 4096) -> list[Encode]:
        return [c for c in self.calls if c.chars > over]

    def on_loop(self, call: Encode) -> bool:
        return call.thread == self.loop_thread

    def restore(self) -> None:
        self.tokenizer.encode = self.encode

    def __enter__(self) -> EncodeRecorder:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


class TemplateEngine(ScriptedEngine):
    """The scripted engine, preflighting through SmolLM2's chat template as the
    vLLM and remote engines do; `encodes` records where it tokenized. Made in
    a test's event loop."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        from tokenwire.engines.chat_template import ChatTemplate
        from tokenwire.models import prepare_default_model

        tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
        self.encodes = EncodeRecorder(tokenizer)
        self.template = ChatTemplate(tokenizer)

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        return tuple(self.template.prompt_ids(request, 8192))
