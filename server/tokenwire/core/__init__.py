"""The sans-I/O core: sessions, responses, conversations; no asyncio,
websockets, redis or wire module is imported here."""
