"""Cancelling queries: every worker reads the query-control topic and stops the answering of a cancelled query it
holds, at the model's next token; a query cancelled before a worker took it up is answered "cancelled" at once.

The control topic is read by every worker (a consumer without a group, from the earliest offset): the worker that
answers a query is the one whose partition holds it, and the cancel comes on another topic, so each worker looks.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from schemas.events import QueryCancel
from services.logging import get_logger
from services.settings import Settings
from streams.background import Fetch, TopicFeed, decode_records

log = get_logger(__name__)


class Cancellations:
    """The queries cancelled lately (the newest ``capacity``, with why) and the answering tasks running now."""

    def __init__(self, capacity: int = 10_000) -> None:
        self.capacity = capacity
        self._cancelled: OrderedDict[str, QueryCancel] = OrderedDict()
        self._running: dict[str, asyncio.Task[Any]] = {}

    def cancelled(self, query_id: str) -> QueryCancel | None:
        return self._cancelled.get(query_id)

    def cancel(self, cancel: QueryCancel) -> bool:
        """Record ``cancel``; True if it stopped a task answering its query here."""
        self._cancelled[cancel.query_id] = cancel
        self._cancelled.move_to_end(cancel.query_id)
        while len(self._cancelled) > self.capacity:
            self._cancelled.popitem(last=False)
        task = self._running.get(cancel.query_id)
        if task is None or task.done():
            return False
        log.info("query_cancelling", query_id=cancel.query_id, reason=cancel.reason)
        task.cancel()
        return True

    def running(self, query_id: str, task: asyncio.Task[Any]) -> None:
        self._running[query_id] = task

    def finished(self, query_id: str) -> None:
        self._running.pop(query_id, None)


class CancelFeed(TopicFeed):
    """Reads the query-control topic into ``Cancellations`` until stopped."""

    def __init__(self, bootstrap: str, topic: str, cancels: Cancellations, settings: Settings | None = None) -> None:
        super().__init__(
            bootstrap, (topic,), client_id="memstream-worker-cancels", name="cancel-feed", settings=settings
        )
        self.cancels = cancels

    async def handle(self, fetched: Fetch) -> None:
        for records in fetched.values():
            for cancel in decode_records(records, QueryCancel, "query_cancel"):
                self.cancels.cancel(cancel)
