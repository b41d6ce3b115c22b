"""WebSocket close codes the server uses (see docs/protocol.md)."""

CLOSE_IDLE = 4000  # no client frame and no active response for --idle-timeout-s
CLOSE_SLOW_CLIENT = 4008  # the client stopped reading its stream
CLOSE_TRY_AGAIN_LATER = 1013  # connection limit reached after the handshake; Redis failed
STORE_UNAVAILABLE = "session store unavailable"  # 1013's reason when Redis failed
CLOSE_SERVICE_RESTART = 1012  # drained: resume the session, on another instance
