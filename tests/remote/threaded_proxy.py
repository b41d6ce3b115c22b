"""tests.helpers.proxy.Proxy on an event loop of its own thread, so it keeps
forwarding while the test thread blocks (e.g. while a server it fronts starts)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from contextlib import contextmanager

from ..helpers.proxy import Proxy


class ThreadedProxy:
    def __init__(self, proxy: Proxy, loop: asyncio.AbstractEventLoop) -> None:
        self.proxy = proxy
        self.loop = loop

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.proxy.port}"

    def cut(self) -> None:
        asyncio.run_coroutine_threadsafe(_call(self.proxy.cut), self.loop).result(5)

    def refuse(self, refuse: bool) -> None:
        self.proxy.refuse = refuse  # read by the proxy's loop on each new connection


async def _call(fn: object) -> None:
    fn()  # type: ignore[operator]


@contextmanager
def threaded_proxy(port: int) -> Iterator[ThreadedProxy]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    proxy = Proxy(port)
    asyncio.run_coroutine_threadsafe(proxy.__aenter__(), loop).result(5)
    try:
        yield ThreadedProxy(proxy, loop)
    finally:
        asyncio.run_coroutine_threadsafe(proxy.__aexit__(None, None, None), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
