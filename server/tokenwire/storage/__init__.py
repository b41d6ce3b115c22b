"""Where sessions live beyond one socket: the per-session event log, and
(with Redis) the session directory several instances share."""
