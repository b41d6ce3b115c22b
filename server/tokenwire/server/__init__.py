"""The server: lifecycle and drain (app), HTTP routes (http), admission
(auth, limits) and the session registry."""

from .app import REALTIME_PATH, TokenwireServer

__all__ = ["REALTIME_PATH", "TokenwireServer"]
