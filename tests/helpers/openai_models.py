"""The OpenAI SDK's own event models, as the strict check of every GA frame
tokenwire sends: its dialect's unit tests and the real-client tests use it."""

from __future__ import annotations

import json
import typing
from typing import Any

from openai.types.realtime import RealtimeClientEvent, RealtimeServerEvent
from pydantic import BaseModel


def _members(union: Any) -> list[type[BaseModel]]:
    while typing.get_origin(union) is typing.Annotated:
        union = typing.get_args(union)[0]
    return list(typing.get_args(union))


def _type_of(model: type[BaseModel]) -> str:
    return typing.get_args(model.model_fields["type"].annotation)[0]


SERVER_MODELS = {_type_of(m): m for m in _members(RealtimeServerEvent)}
CLIENT_TYPES = {_type_of(m) for m in _members(RealtimeClientEvent)}
# Extra fields OpenAI's own server sends that the SDK models do not declare.
ALLOWED_EXTRAS = {
    ("RealtimeSessionCreateRequest", "id"),
    ("RealtimeSessionCreateRequest", "object"),
}


def _extras(model: Any, path: str = "") -> list[str]:
    found = []
    if isinstance(model, BaseModel):
        for key in model.__pydantic_extra__ or {}:
            if (type(model).__name__, key) not in ALLOWED_EXTRAS:
                found.append(f"{path}.{key}")
        for name in type(model).model_fields:
            found += _extras(getattr(model, name), f"{path}.{name}")
    elif isinstance(model, list):
        for i, value in enumerate(model):
            found += _extras(value, f"{path}[{i}]")
    return found


def validate(frame: str) -> dict[str, Any]:
    """One GA frame through the SDK's model for its type: strict types, every
    required field, no field the model does not know."""
    obj = json.loads(frame)
    model = SERVER_MODELS[obj["type"]]
    parsed = model.model_validate(obj, strict=True)
    assert _extras(parsed) == [], obj
    assert parsed.event_id.startswith("event_")
    return obj
