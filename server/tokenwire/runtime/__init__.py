"""The asyncio layer: one concept a module."""
