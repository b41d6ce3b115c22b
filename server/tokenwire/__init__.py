"""tokenwire: a realtime WebSocket server for LLM token streams."""

__version__ = "0.1.0"
