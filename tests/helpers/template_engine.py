"""A stand-in engine for tests of where prompts are tokenized."""

from __future__ import annotations

import threading

from tokenwire.engines.base import GenerationRequest
from tokenwire.engines.scripted import ScriptedEngine


class TemplateEngine(ScriptedEngine):
    """The scripted engine, preflighting through SmolLM2's chat template as the
    vLLM and remote engines do; it records the threads that tokenized."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoTokenizer

        from tokenwire.engines.chat_template import ChatTemplate
        from tokenwire.models import prepare_default_model

        tokenizer = AutoTokenizer.from_pretrained(prepare_default_model())
        self.threads: list[tuple[int, int]] = []  # (characters, thread)
        encode = tokenizer.encode

        def counting(text: str, **kwargs: object) -> list[int]:
            self.threads.append((len(text), threading.get_ident()))
            return encode(text, **kwargs)

        tokenizer.encode = counting
        self.template = ChatTemplate(tokenizer)

    def preflight(self, request: GenerationRequest) -> tuple[int, ...] | None:
        return tuple(self.template.prompt_ids(request, 8192))
