"""A TCP proxy that a test can cut, or make swallow one direction, as a network would."""

from __future__ import annotations

import asyncio
import contextlib


class Proxy:
    def __init__(self, port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, port)  # where new connections go; a test may move it
        self.drop_upstream = False  # swallow what clients send
        self.drop_downstream = False  # swallow what the server sends
        self.refuse = False  # close new connections at once
        self.dropped = 0  # bytes swallowed
        self.forwarded_down = 0  # bytes passed on from the server, all connections
        # Swallow what the server sends once this many bytes have passed in all:
        # a stall at a set point of a stream, however fast the reader is.
        self.drop_downstream_after: int | None = None
        self.connections = 0  # connections made to the target
        self._pairs: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Proxy:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        self.cut()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    def url(self, path: str = "/v1/realtime") -> str:
        return f"ws://127.0.0.1:{self.port}{path}"

    def cut(self) -> None:
        """Reset every open connection, on both sides."""
        for client, upstream in list(self._pairs):
            client.transport.abort()
            upstream.transport.abort()
        self._pairs.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refuse:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self.connections += 1
        pair = (writer, up_writer)
        self._pairs.add(pair)
        for src, dst, upstream in ((reader, up_writer, True), (up_reader, writer, False)):
            task = asyncio.create_task(self._pump(src, dst, upstream, pair))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _passed(self, data: bytes, upstream: bool) -> bytes:
        """What of `data` goes on; the rest is swallowed."""
        if upstream:
            keep = 0 if self.drop_upstream else len(data)
        else:
            keep = 0 if self.drop_downstream else len(data)
            if self.drop_downstream_after is not None:
                keep = min(keep, max(self.drop_downstream_after - self.forwarded_down, 0))
            self.forwarded_down += keep
        self.dropped += len(data) - keep
        return data[:keep]

    async def _pump(
        self,
        src: asyncio.StreamReader,
        dst: asyncio.StreamWriter,
        upstream: bool,
        pair: tuple[asyncio.StreamWriter, asyncio.StreamWriter],
    ) -> None:
        with contextlib.suppress(OSError, asyncio.CancelledError):
            while data := await src.read(65536):
                passed = self._passed(data, upstream)
                if passed:
                    dst.write(passed)
                    await dst.drain()
        # One side ended: end the other, as a TCP connection would.
        for w in pair:
            w.transport.abort()
        self._pairs.discard(pair)
