"""A counting gate whose waiters are let in by rank, then in arrival order: ``asyncio.Semaphore`` with priorities."""

from __future__ import annotations

import asyncio
import heapq
import itertools


class RankedGate:
    """At most ``size`` holders; when one leaves, the waiter of lowest rank enters (the earliest among equals)."""

    def __init__(self, size: int) -> None:
        self.free = max(1, size)
        self._waiting: list[tuple[int, int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(1 for _, _, entry in self._waiting if not entry.done())

    async def acquire(self, rank: int = 0) -> None:
        if self.free > 0 and not self._waiting:
            self.free -= 1
            return
        entry: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (rank, next(self._arrivals), entry))
        try:
            await entry
        except asyncio.CancelledError:
            if entry.done() and not entry.cancelled():  # let in just as it was cancelled: pass the place on
                self.release()
            raise

    def release(self) -> None:
        self.free += 1
        while self.free > 0 and self._waiting:
            _, _, entry = heapq.heappop(self._waiting)
            if entry.done():  # its waiter was cancelled
                continue
            self.free -= 1
            entry.set_result(None)
