"""A loopback TCP forwarder in front of a real server, that can cut memstream off from it.

While cut, new connections are refused and open ones are dropped: what a client sees when a server restarts, its
pod is rescheduled or the network between fails. The server itself keeps running, so other tests that share it
are unaffected. It runs its own event loop on a thread, so sync and async tests can use it alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any

from memstream.broker import free_port


class Blackout:
    def __init__(self, target: str) -> None:
        """``target``: the server's ``host:port`` (an ``http://`` prefix is kept in ``address``)."""
        scheme, _, rest = target.rpartition("//")
        self.scheme = f"{scheme}//" if scheme else ""
        host, _, port = rest.rpartition(":")
        self.target = (host, int(port))
        self.port = free_port()
        self.cuts = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"blackout-{self.port}", daemon=True)
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def address(self) -> str:
        return f"{self.scheme}127.0.0.1:{self.port}"

    def __enter__(self) -> Blackout:
        self._thread.start()
        self._run(self._listen())
        return self

    def __exit__(self, *_: object) -> None:
        self._run(self._close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def cut(self) -> None:
        """Refuse new connections and drop the open ones."""
        self.cuts += 1
        self._run(self._close())

    def restore(self) -> None:
        self._run(self._listen())

    def _run(self, coroutine: Coroutine[Any, Any, None]) -> None:
        future: Future[None] = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        future.result(timeout=30)

    async def _listen(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(self._forward, "127.0.0.1", self.port, reuse_address=True)

    async def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()  # a reset, as when the server's process dies
        self._writers.clear()
        if server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), timeout=5)

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError, asyncio.CancelledError):
                while data := await source.read(65536):
                    sink.write(data)
                    await sink.drain()
            sink.close()  # one side ended: end the other (after what was written is flushed)

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))
