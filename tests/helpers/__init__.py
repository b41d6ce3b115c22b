"""Helpers the test suites share (no fixtures: those stay in tests/conftest.py).

- session: drive(), one client event into a Session and what it produced
- wait: until(), poll a condition with a deadline
- tools: tool definitions
- wire: bare WebSocket clients that read a session's events by seq
- proxy: a TCP proxy a test can cut
- fuzz: what the fuzzers check every server event against
"""
