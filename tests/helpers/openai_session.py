"""A GA client, the OpenAI Realtime dialect and a real core Session, with no
I/O: every frame the session's events become is checked against the SDK's
models (`openai_models.validate`)."""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel

from tokenwire.core.errors import ProtocolError
from tokenwire.core.session import Session
from tokenwire.core.tools import ToolFlow
from tokenwire.engines.base import EngineDelta
from tokenwire.wire.openai_realtime import OpenAIRealtime

from .openai_models import validate


class GAHarness:
    """`tool_flow`: CLIENT is what the runtime gives an OpenAI socket's session."""

    def __init__(self, tool_flow: ToolFlow = ToolFlow.CONTINUE, **dialect: Any) -> None:
        self.session = Session(tool_flow=tool_flow)
        self.dialect = OpenAIRealtime("realtime", **dialect)
        self.seq = 0
        self.frames: list[dict[str, Any]] = []
        self.request_id: str | None = None
        self.request: Any = None  # the last GenerationRequest started

    def send(self, event: BaseModel | dict[str, Any]) -> None:
        obj = event.model_dump(exclude_none=True) if isinstance(event, BaseModel) else event
        try:
            parsed = self.dialect.parse(json.dumps(obj))
        except ProtocolError as err:
            self.session.receive_protocol_error(err)
        else:
            self.session.receive_client_event(parsed)
        self._actions()

    def engine(self, delta: EngineDelta) -> None:
        assert self.request_id is not None
        self.session.receive_engine_output(self.request_id, delta)
        self._actions()

    def _actions(self) -> None:
        for action in self.session.actions_to_perform():
            if hasattr(action, "request"):
                self.request, self.request_id = action.request, action.request.request_id

    def take(self) -> list[dict[str, Any]]:
        out = []
        for event in self.session.events_to_send():
            self.seq += 1
            event["seq"] = self.seq
            out += [validate(frame) for frame in self.dialect.encode_all(event)]
        self.frames += out
        return out


def types(frames: list[dict[str, Any]]) -> list[str]:
    return [f["type"] for f in frames]
