"""Tool definitions the tests offer."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
    },
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}
# With a description: what the real model reads to fill in the call.
WEATHER_DESCRIBED = {**WEATHER, "description": "Get the current weather for a city"}
